"""``CompiledMoERouting``: MoE per-expert loops become one sort and one count, compiled."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_vlmbalance.moe import PatchedMoE, patch_moe_modules, unpatch_moe_modules

__all__ = ["CompiledMoERouting"]


class CompiledMoERouting(Callback):
    """Finds the MoE modules of the LightningModule (the example VLM's ``MoEFeedForward``, and
    Hugging Face transformers sparse-MoE experts such as Mixtral's and Qwen3-MoE's) and replaces
    their forward with the sorted dispatch of :mod:`lightning_vlmbalance.moe`, compiled with
    ``torch.compile``. Numerics are unchanged up to float rounding; parameters, checkpoints and
    the optimizer are untouched. The original forwards come back at teardown.

    Every ``log_every_n_steps`` optimizer steps it logs, per MoE layer, ``moe/<layer>/lb_loss``
    (the Switch-Transformer load-balancing loss of the last micro-batch) and
    ``moe/<layer>/max_load`` (tokens of the busiest expert over the mean), and their means
    ``moe/lb_loss`` and ``moe/max_load``. The statistics are tensors produced by the dispatch
    itself; they are read only when logged.

    Args:
        compile: compile the MoE forward (``False``: the sorted dispatch in eager mode).
        backend, fullgraph, dynamic, mode: passed to ``torch.compile``.
        log_every_n_steps: optimizer steps between logs of the router statistics.
    """

    def __init__(
        self,
        *,
        compile: bool = True,
        backend: str = "inductor",
        fullgraph: bool = True,
        dynamic: bool | None = None,
        mode: str | None = None,
        log_every_n_steps: int = 50,
    ) -> None:
        if log_every_n_steps < 1:
            raise ValueError(
                f"`CompiledMoERouting(log_every_n_steps={log_every_n_steps})` must be >= 1"
            )
        self.compile_kwargs: dict[str, Any] | None = (
            {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic, "mode": mode}
            if compile
            else None
        )
        self.log_every_n_steps = log_every_n_steps
        self.patched: list[PatchedMoE] = []
        self._logged_step = -1

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.patched:
            return
        self.patched = patch_moe_modules(pl_module, compile_kwargs=self.compile_kwargs)
        if not self.patched:
            rank_zero_warn(
                "CompiledMoERouting found no MoE module it knows (an expert list with a `router`"
                " and `topk`, or Hugging Face fused experts); it does nothing"
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
            lb = p.load_balancing_loss()
            if lb is None or p.counts is None:
                continue
            counts = p.counts.float()
            load = counts.max() / counts.mean().clamp_min(1e-9)
            metrics[f"moe/{p.name}/lb_loss"] = lb
            metrics[f"moe/{p.name}/max_load"] = load
            losses.append(lb)
            loads.append(load)
        if losses:
            metrics["moe/lb_loss"] = torch.stack(losses).mean()
            metrics["moe/max_load"] = torch.stack(loads).mean()
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        unpatch_moe_modules(self.patched)
        self.patched = []
