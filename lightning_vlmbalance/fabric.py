"""Lightning Fabric: the straggler record from a loop you write yourself.

Fabric users (LitGPT's among them) drive their own loop, so the Trainer callbacks cannot time it.
:class:`FabricStragglerMonitor` is the same per-rank, per-phase record as
:class:`~lightning_vlmbalance.StragglerMonitor` (the torch-only
:class:`~lightning_vlmbalance.timing.monitor.StragglerRecorder` under both): the loop marks its
phases, the monitor hooks DDP's gradient all-reduce to tell each rank's own backward from its
wait for the slowest rank, gathers every rank's row every ``log_every_n_steps`` optimizer steps,
logs the ``straggler/*`` and ``packing/efficiency`` metrics through ``fabric.log_dict`` (every
logger Fabric has: TensorBoard, CSV, ...) and writes one JSON line per step and rank.

The packed loaders work in a Fabric loop as they are (give the sampler ``num_replicas`` and
``rank`` from Fabric). Runtime rebalancing (moving packs and images between ranks inside a step)
is done by the Trainer strategies, which own the step; in Fabric, ``strategy="vlmbalance"`` and
``"fsdp_vlmbalance"`` are refused by name (registered in Fabric's registry as refusals that say
why), and balancing at the source (``PackingSampler(balance=...)``, a property of the data
order) is what Fabric gets.

Example::

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=TensorBoardLogger(...))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    monitor = FabricStragglerMonitor(fabric, log_every_n_steps=10)
    monitor.watch(model)
    for step, batch in enumerate(loader, 1):
        with monitor.phase("llm_fwd"):
            loss = model(batch)
        monitor.backward(loss)
        with monitor.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        monitor.end_step(step, batch=batch)
    print(monitor.close())
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_vlmbalance.timing.comm_hook import timed_comm_hook
from lightning_vlmbalance.timing.monitor import StragglerRecorder

__all__ = ["FabricStragglerMonitor"]


class FabricStragglerMonitor:
    """Per-rank, per-phase step timing of a Fabric loop (see the module docstring).

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        log_every_n_steps: optimizer steps between two gathers (a small all-gather on every
            rank) and two ``fabric.log_dict`` calls.
        jsonl_dir: the folder of the per-rank JSON-lines files (``rank_{r}.jsonl``).
        start_step: the optimizer steps trained before (a resumed run): the files keep their
            records up to it and go on after it (``0``: they start afresh).
    """

    def __init__(
        self,
        fabric: Any,
        *,
        log_every_n_steps: int = 50,
        jsonl_dir: str | Path = "straggler",
        start_step: int = 0,
    ) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"FabricStragglerMonitor(log_every_n_steps={log_every_n_steps})")
        self.fabric = fabric
        self.every = log_every_n_steps
        clock = "cuda" if fabric.device.type == "cuda" else "cpu"
        self.recorder = StragglerRecorder(clock)
        Path(jsonl_dir).mkdir(parents=True, exist_ok=True)
        self.recorder.start(
            Path(jsonl_dir) / f"rank_{fabric.global_rank}.jsonl",
            int(start_step),
            rank=fabric.global_rank,
            world_size=fabric.world_size,
        )
        self._steps = 0  # end_step calls since the last gather: when to gather, on every rank
        self._last_step: int | None = None
        self._closed = False

    @property
    def timer(self) -> Any:
        return self.recorder.timer

    def watch(self, module: torch.nn.Module) -> None:
        """Marks each gradient bucket's hand-over to DDP's all-reduce, so the rest of a backward
        counts as waiting for the slowest rank. Call it once after ``fabric.setup(model)``,
        before the first backward (a DDP module only; others are left as they are)."""
        ddp = getattr(module, "_forward_module", module)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(
                state=getattr(ddp, "process_group", None),
                hook=timed_comm_hook(self.timer.mark_sync_entry),
            )
        elif self.fabric.world_size > 1:
            warnings.warn(
                f"FabricStragglerMonitor.watch: {type(module).__name__} is not wrapped in"
                " DistributedDataParallel (call watch() after fabric.setup(model) under"
                " strategy='ddp'): the ranks' waiting for each other is not measured",
                stacklevel=2,
            )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times one phase of the current micro-batch (``data``, ``vision_fwd``, ``llm_fwd``,
        ``optimizer``; the backward through :meth:`backward`)."""
        self.timer.start(name)
        try:
            yield
        finally:
            self.timer.stop(name)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``fabric.backward(loss)``, timed: the rank's own backward up to its last gradient
        bucket, and its wait for the others after it."""
        self.timer.start("backward")
        self.fabric.backward(loss, **kwargs)
        self.timer.stop_backward()

    def end_micro(self, batch: Mapping[str, Any] | None = None) -> None:
        """Closes one micro-batch; a packed ``batch`` (one pack) adds its fill to
        ``packing/efficiency`` (padding packs left out)."""
        self._note(batch)
        self.timer.end_micro()

    def end_step(
        self, step: int, *, epoch: int = 0, batch: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Closes optimizer step ``step`` (counted from 1, the same on every rank). Every
        ``log_every_n_steps`` calls it gathers every rank's steps (a collective: every rank
        calls it as often; ranks at different step numbers raise there, naming them), logs the
        metrics and returns them; else ``{}``."""
        if self._closed:
            raise RuntimeError("FabricStragglerMonitor.end_step after close()")
        self._note(batch)
        self.timer.end_step(step, epoch)
        self.recorder.collect()
        self._last_step = step
        self._steps += 1
        if self._steps < self.every:
            return {}
        return self._gather(step)

    def close(self) -> dict[str, Any]:
        """Gathers the steps not gathered yet (a collective), closes the files, and returns the
        whole-run summary (the same on every rank): ``waste_frac``, ``slowest_rank``, per-rank
        busy and waiting milliseconds."""
        if not self._closed:
            if self._steps and self._last_step is not None:
                self._gather(self._last_step)
            self.recorder.close()
            self._closed = True
        return self.recorder.summary()

    def _gather(self, step: int) -> dict[str, float]:
        # the ranks gather at the same count of steps; their step numbers must agree (a rank
        # a step ahead would wait in the next gather for ever)
        steps = self.fabric.all_gather(torch.tensor(step, device=self.fabric.device))
        if steps.numel() > 1 and bool((steps != steps.reshape(-1)[0]).any()):
            raise RuntimeError(
                f"FabricStragglerMonitor: the ranks ended different optimizer steps"
                f" ({steps.reshape(-1).tolist()}): call end_step(step) with the same step on"
                " every rank"
            )
        self.recorder.synchronize()
        self.recorder.gather()
        self._steps = 0
        metrics = self.recorder.metrics()
        if metrics:
            self.fabric.log_dict(metrics, step=step)
        return metrics

    def _note(self, batch: Mapping[str, Any] | None) -> None:
        meta = (batch or {}).get("meta") or {}
        if meta and not meta.get("padding"):
            self.recorder.note_pack(int(meta["total_tokens"]), int(batch["input_ids"].shape[-1]))
