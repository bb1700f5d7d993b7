"""``CompiledMoERouting``: MoE per-expert loops become one sort and one count, compiled."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_vlmbalance.callbacks._options import LOG_EVERY_N_STEPS, checked_log_every_n_steps
from lightning_vlmbalance.moe import (
    PatchedMoE,
    patch_moe_modules,
    unpatch_moe_modules,
    unsupported_moe_modules,
)

__all__ = ["CompiledMoERouting"]


class CompiledMoERouting(Callback):
    """Finds the MoE modules of the LightningModule (the example VLM's ``MoEFeedForward``, and
    Hugging Face transformers sparse-MoE experts such as Mixtral's and Qwen3-MoE's) and replaces
    their forward with the sorted dispatch of :mod:`lightning_vlmbalance.moe`, compiled with
    ``torch.compile``. Numerics are unchanged up to float rounding; parameters, checkpoints and
    the optimizer are untouched. The original forwards come back at teardown, or when fit stops
    with an exception (Lightning skips ``teardown`` then). A deep copy of a patched module made
    during fit (a frozen reference or a teacher copied in the LightningModule's ``setup`` or
    ``configure_model``, which Lightning calls after this callback's ``setup``) computes with
    its own weights, and is restored with the original. MoE-looking modules it cannot prove it
    computes the same (expert biases, interleaved gate/up, their own gating, a subclass that
    overrides the declared ``forward``, experts whose forward is not transformers' own, ...) are
    left alone and named, with the reason, in a warning at setup.

    Every ``log_every_n_steps`` optimizer steps it logs, per MoE layer, ``moe/<layer>/lb_loss``
    (the Switch-Transformer load-balancing loss of the last micro-batch, from the router's own
    scores: softmax, or sigmoid normalised per token for DeepSeek-V3-style routers) and
    ``moe/<layer>/max_load`` (tokens of the busiest expert over the mean), and their means
    ``moe/lb_loss`` and ``moe/max_load``. The statistics are tensors produced by the dispatch
    itself; they are read only when logged.

    Args:
        compile: compile the MoE forward (``False``: the sorted dispatch in eager mode).
        backend, fullgraph, dynamic, mode: passed to ``torch.compile``.
        log_every_n_steps: optimizer steps between logs of the router statistics.

    Metrics (every ``log_every_n_steps`` optimizer steps):

    ============================  ============================================================
    ``moe/<layer>/lb_loss``       load-balancing loss of the layer's last micro-batch
    ``moe/<layer>/max_load``      tokens of the busiest expert over the mean
    ``moe/lb_loss``               mean over the layers
    ``moe/max_load``              mean over the layers
    ============================  ============================================================

    Raises:
        ValueError: for ``log_every_n_steps < 1``, quoting the call.

    Example::

        trainer = L.Trainer(callbacks=[CompiledMoERouting(backend="inductor", mode=None)])
    """

    def __init__(
        self,
        *,
        compile: bool = True,
        backend: str = "inductor",
        fullgraph: bool = True,
        dynamic: bool | None = None,
        mode: str | None = None,
        log_every_n_steps: int = LOG_EVERY_N_STEPS,
    ) -> None:
        self.compile_kwargs: dict[str, Any] | None = (
            {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic, "mode": mode}
            if compile
            else None
        )
        self.log_every_n_steps = checked_log_every_n_steps("CompiledMoERouting", log_every_n_steps)
        self.patched: list[PatchedMoE] = []
        self._logged_step = -1

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.patched:
            return
        skipped = unsupported_moe_modules(pl_module)
        self.patched = patch_moe_modules(pl_module, compile_kwargs=self.compile_kwargs)
        if skipped:
            rank_zero_warn(
                f"CompiledMoERouting leaves {len(skipped)} MoE module(s) as they are (it patches"
                " only layouts whose computation it knows):\n"
                + "\n".join(f"  {name}: {why}" for name, why in skipped.items())
            )
        if not self.patched:
            if not skipped:
                rank_zero_warn(
                    "CompiledMoERouting found no MoE module it knows (an expert list with a"
                    " `router` and `topk`, or Hugging Face fused experts); it does nothing"
                )
            return
        kinds = sorted({p.kind for p in self.patched})
        rank_zero_info(
            f"CompiledMoERouting: {len(self.patched)} MoE modules use the sorted dispatch"
            f" ({', '.join(kinds)}; compiled: {self.compile_kwargs is not None})"
        )

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if not self.patched or step % self.log_every_n_steps or step == self._logged_step:
            return
        self._logged_step = step
        metrics: dict[str, torch.Tensor] = {}
        losses, loads = [], []
        for p in self.patched:
            if p.counts is None:
                continue
            counts = p.counts.float()
            load = counts.max() / counts.mean().clamp_min(1e-9)
            metrics[f"moe/{p.name}/max_load"] = load
            loads.append(load)
            lb = p.load_balancing_loss()  # None when the router's scoring is unknown
            if lb is not None:
                metrics[f"moe/{p.name}/lb_loss"] = lb
                losses.append(lb)
        if loads:
            metrics["moe/max_load"] = torch.stack(loads).mean()
            if losses:
                metrics["moe/lb_loss"] = torch.stack(losses).mean()
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # Lightning skips the callbacks' teardown after an exception: restore the forwards here
        self._restore()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        """Restores the original forwards (once: a second call finds nothing to restore)."""
        unpatch_moe_modules(self.patched)
        self.patched = []
