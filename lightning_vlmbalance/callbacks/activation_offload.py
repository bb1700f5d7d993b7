"""``ActivationOffload``: saved activations to pinned host memory in forward, back in backward."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_vlmbalance.callbacks._options import LOG_EVERY_N_STEPS, checked_log_every_n_steps
from lightning_vlmbalance.offload import OFFLOAD_MODES, ActivationOffloader

__all__ = ["ActivationOffload"]

log = logging.getLogger(__name__)

_BLOCK_LISTS = ("blocks", "layers", "h", "layer")


def _find_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: children of every ``nn.ModuleList`` named ``blocks``, ``layers``,
    ``h`` or ``layer`` (ViT/GPT/Llama/BERT conventions), in module order."""
    found: list[nn.Module] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS:
            found.extend(sub)
    return found


class ActivationOffload(Callback):
    """Offloads the activations autograd saves in ``training_step`` to pinned host memory, on a
    side stream, and brings them back during backward with double buffering (see
    ``docs/activation_offload.md``).

    Args:
        mode: ``"all"`` saved activations, or ``"checkpoint"``: only the blocks' inputs and
            outputs (one tensor per block; pairs with non-reentrant ``torch.utils.checkpoint``
            around the blocks, whose inner activations are recomputed anyway). With
            ``checkpoint(block, x)`` the first block's input is saved before any hook runs and
            stays on the device.
        min_bytes: smaller tensors stay on the device.
        prefetch: tensors reloaded ahead during backward (2: double buffering).
        blocks: for ``"checkpoint"`` mode: the block modules, or ``None`` to find them
            (:func:`_find_blocks`).
        test_mode: run the hooks on the CPU (synchronous copies): for tests, not for speed.
        log_every_n_steps: logs ``offload/*`` counters (host-side integers, no device sync).

    Without CUDA (and outside test mode) there is nothing faster to offload from: the callback
    logs one line and does nothing.

    Metrics (every ``log_every_n_steps`` optimizer steps, host-side counters):

    ====================================  ====================================================
    ``offload/offloaded_mib_total``       MiB copied to host memory so far
    ``offload/pool_mib``                  pinned host pool held now
    ``offload/reloaded_tensors_total``    tensors brought back for backward so far
    ``offload/prefetched_tensors_total``  of those, reloaded ahead of their use
    ====================================  ====================================================

    Raises:
        ValueError: for an unknown ``mode`` or ``log_every_n_steps < 1``, quoting the call.

    Example::

        trainer = L.Trainer(callbacks=[ActivationOffload(mode="checkpoint", min_bytes=1 << 22)])
    """

    def __init__(
        self,
        *,
        mode: str = "all",
        min_bytes: int = 1 << 20,
        prefetch: int = 2,
        blocks: Sequence[nn.Module] | None = None,
        test_mode: bool = False,
        log_every_n_steps: int = LOG_EVERY_N_STEPS,
    ) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"`ActivationOffload(mode={mode!r})`: expected one of {OFFLOAD_MODES}")
        self.mode = mode
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.blocks = list(blocks) if blocks is not None else None
        self.test_mode = test_mode
        self.log_every_n_steps = checked_log_every_n_steps("ActivationOffload", log_every_n_steps)
        self.offloader: ActivationOffloader | None = None
        self._handles: list[Any] = []
        self._last_logged: dict[str, int] = {}
        self.last_stats: dict[str, int] = {}  # the offloader's counters when it was closed

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # here, not in ``setup``: the strategy has moved the model to its device by now, so the
        # parameters and buffers excluded are the ones the forward will use
        if self.offloader is not None:
            return
        device = pl_module.device
        if not self.test_mode and device.type != "cuda":
            rank_zero_info(
                f"ActivationOffload: the model is on {device.type}, not CUDA: nothing to offload"
                " from, so it does nothing (test_mode=True runs the hooks on the CPU)"
            )
            return
        self.offloader = ActivationOffloader(
            mode=self.mode,
            min_bytes=self.min_bytes,
            prefetch=self.prefetch,
            device="cpu" if self.test_mode else device,
            test_mode=self.test_mode,
            exclude=[*pl_module.parameters(), *pl_module.buffers()],
        )
        if self.mode == "checkpoint":
            blocks = self.blocks if self.blocks is not None else _find_blocks(pl_module)
            if not blocks:
                raise ValueError(
                    "`ActivationOffload(mode='checkpoint')` found no blocks (children of a"
                    f" ModuleList named one of {_BLOCK_LISTS}); pass `blocks=`"
                )
            for block in blocks:
                # a checkpoint saves its inputs before the block runs (before a pre-hook in a
                # `checkpoint(block, x)` call): a block's output, the next block's input, is
                # marked as it is returned; the pre-hook covers wrappers that checkpoint inside
                self._handles.append(
                    block.register_forward_pre_hook(self._mark_inputs, with_kwargs=True)
                )
                self._handles.append(block.register_forward_hook(self._mark_output))

    def _mark_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._mark(*args, *kwargs.values())

    def _mark_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._mark(*(output if isinstance(output, tuple | list) else (output,)))

    def _mark(self, *values: Any) -> None:
        off = self.offloader
        if off is not None and off.active:
            for value in values:
                if isinstance(value, torch.Tensor):
                    off.mark(value)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any
    ) -> None:
        if self.offloader is not None and not self.offloader.active:
            self.offloader.__enter__()

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self._leave()  # the forward is over: nothing more to save

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self._leave()  # a training_step that returned None has no backward
        off = self.offloader
        if off is None or trainer.global_step % self.log_every_n_steps:
            return
        stats = off.stats()
        if self._last_logged.get("step") == trainer.global_step:
            return
        self._last_logged["step"] = trainer.global_step
        mib = 1.0 / (1 << 20)
        pl_module.log_dict(
            {
                "offload/offloaded_mib_total": stats["offloaded_bytes"] * mib,
                "offload/pool_mib": stats["pool_bytes"] * mib,
                "offload/reloaded_tensors_total": float(stats["reloaded_tensors"]),
                "offload/prefetched_tensors_total": float(stats["prefetched_tensors"]),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    def _leave(self) -> None:
        if self.offloader is not None and self.offloader.active:
            self.offloader.__exit__(None, None, None)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._shutdown()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._shutdown()

    def _shutdown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        off, self.offloader = self.offloader, None
        if off is not None:
            self.last_stats = off.stats()
            off.close()
