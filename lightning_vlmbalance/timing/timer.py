"""Per-rank, per-phase step timing (torch only, no Lightning).

A :class:`StepTimer` collects, for every optimizer step of one rank, how long each phase took in
each micro-batch. Phases are timed by *marks*: on the CPU a mark is ``time.perf_counter()``; on
CUDA a device phase is marked by a ``torch.cuda.Event`` recorded on the current stream and read
later with ``query()`` (never ``synchronize()``), so timing adds no device synchronisation. A
finished step waits in a queue until every one of its events has completed; :meth:`drain` returns
the steps that are fully resolved.

Phases (milliseconds per optimizer step, summed over its micro-batches):

==================  ==========================================================================
``data``            waiting for the data loader (host)
``vision_fwd``      forward of the vision module (exclusive of nothing else)
``llm_fwd``         forward of the language module, minus any vision forward nested inside it
``backward``        backward, minus ``sync_wait``
``optimizer``       the optimizer step
``sync_wait``       from this rank's last gradient bucket being ready to the end of the gradient
                    all-reduce: waiting for the slowest rank (plus the last bucket's transfer)
``lightning_sync``  Lightning's per-micro-batch SIGTERM-flag broadcast, a barrier (host), at
                    every micro-batch of the step but the first. The first broadcast follows the
                    previous step's all-reduce, so what it waits for happened between steps
                    (validation, a checkpoint save): it is reported as ``between_steps_ms``
                    and never counted as waiting. So is the first broadcast after a pause.
``encoder_return``  under encoder balancing, the return of the image embeddings to their packs
                    (forward) and of their gradients (backward): an all-to-all every rank
                    enters, so mostly waiting for the rank whose encoder finished last (plus
                    the transfer); excluded from the phase it is nested in
``collective_wait`` under FSDP2 (``"fsdp_vlmbalance"``, ``ModelParallelStrategy``): the time
                    this rank spends in FSDP's parameter all-gathers and gradient
                    reduce-scatters, which every rank of the data-parallel group enters layer
                    by layer, so mostly waiting for the slowest (plus the transfers and their
                    copies); excluded from the phase it is nested in (host clock: measured on
                    the CPU, where gloo blocks the calling thread; see
                    :mod:`lightning_vlmbalance.timing.collectives`). The JSON lines hold the
                    time in the collectives; the gathered totals and TensorBoard hold the
                    wait: call by call, the time less the shortest any rank spent in that
                    call (the call's own cost, busy time: ``summary.collective_waits``)
``step``            the whole optimizer step, first micro-batch to optimizer end (host), less
                    its pauses
==================  ==========================================================================

Work outside training can also land *inside* a step, between two of its micro-batches
(validation at a ``val_check_interval`` that is not a multiple of the accumulation, a checkpoint
save): :meth:`StepTimer.pause` stops the step's clock from the end of its last micro-batch,
:meth:`StepTimer.resume` restarts it when training goes on. The paused time is
``outside_step_ms``, in no phase and not in ``step``.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "COLLECTIVE_WAIT",
    "COMPUTE_PHASES",
    "DEVICE_PHASES",
    "ENCODER_RETURN",
    "LIGHTNING_SYNC",
    "MEASURED_PHASES",
    "SYNC_WAIT",
    "WAIT_PHASES",
    "ResolvedStep",
    "StepTimer",
    "wait_phase",
]

# The phases the monitor measures per micro-batch (the modelled ones, which the cost model
# predicts per pack, are `balance.cost.MODELLED_PHASES`).
SYNC_WAIT = "sync_wait"  # the wait at the gradient all-reduce
LIGHTNING_SYNC = "lightning_sync"  # the wait at Lightning's per-micro-batch flag broadcast
ENCODER_RETURN = "encoder_return"  # the all-to-all of image embeddings under encoder balancing
COLLECTIVE_WAIT = "collective_wait"  # FSDP's all-gathers and reduce-scatters
COMPUTE_PHASES = ("vision_fwd", "llm_fwd", "backward")
MEASURED_PHASES = (
    "data",
    *COMPUTE_PHASES,
    "optimizer",
    SYNC_WAIT,
    LIGHTNING_SYNC,
    ENCODER_RETURN,
    COLLECTIVE_WAIT,
)
WAIT_PHASES = (SYNC_WAIT, LIGHTNING_SYNC, ENCODER_RETURN, COLLECTIVE_WAIT)
DEVICE_PHASES = (*COMPUTE_PHASES, "optimizer", SYNC_WAIT)  # timed with device events on CUDA


class _HostClock:
    device = False

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def ready(mark: Any) -> bool:
        return True

    @staticmethod
    def elapsed_ms(a: Any, b: Any) -> float:
        return (b - a) * 1e3


class _CudaClock:
    device = True

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def ready(mark: Any) -> bool:
        return mark.query()

    @staticmethod
    def elapsed_ms(a: Any, b: Any) -> float:
        return a.elapsed_time(b)


HOST = _HostClock()


@dataclass(slots=True)
class _Interval:
    phase: str
    clock: Any
    start: Any
    end: Any = None
    minus: list[_Interval] = field(default_factory=list)  # nested intervals to subtract

    def ready(self) -> bool:
        return self.end is not None and self.clock.ready(self.end)

    def close(self) -> None:
        if self.end is None:
            self.end = self.clock.mark()

    def ms(self) -> float:
        total = self.clock.elapsed_ms(self.start, self.end)
        return total - sum(i.ms() for i in self.minus)


@dataclass(slots=True)
class _Micro:
    features: dict[str, Any] = field(default_factory=dict)
    intervals: list[_Interval] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    start: float
    micro: list[_Micro] = field(default_factory=list)
    end: float = 0.0
    global_step: int = 0
    epoch: int = 0
    between_ms: float = 0.0
    outside_ms: float = 0.0  # paused: validation or a checkpoint save between micro-batches


@dataclass(slots=True)
class ResolvedStep:
    """One optimizer step of one rank, in milliseconds."""

    global_step: int
    epoch: int
    step_ms: float
    phases_ms: dict[str, float]
    micro: list[dict[str, Any]]  # per micro-batch: features and phase milliseconds
    between_steps_ms: float = 0.0  # waits for others' work outside training (first broadcast...)
    outside_step_ms: float = 0.0  # this rank's own work outside training inside the step
    # each ``collective_wait`` interval in order (every rank calls FSDP's collectives in the
    # same order: the monitor compares them call by call across ranks)
    collective_calls_ms: list[float] = field(default_factory=list)

    def to_json(self, rank: int, world_size: int) -> dict[str, Any]:
        return {
            "v": 1,
            "rank": rank,
            "world_size": world_size,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "micro_batches": len(self.micro),
            "step_ms": round(self.step_ms, 4),
            "between_steps_ms": round(self.between_steps_ms, 4),
            "outside_step_ms": round(self.outside_step_ms, 4),
            "phases_ms": {k: round(v, 4) for k, v in self.phases_ms.items()},
            "micro": self.micro,
        }


class StepTimer:
    """Collects phase intervals of one rank, step by step.

    Args:
        device_clock: ``"cuda"`` to time device phases with CUDA events, else host time.
    """

    def __init__(self, device_clock: str = "cpu") -> None:
        self.device = _CudaClock() if device_clock == "cuda" else HOST
        self._step: _Step | None = None
        self._micro: _Micro | None = None
        self._open: dict[str, _Interval] = {}
        self._pending: deque[_Step] = deque()
        self._sync_entry: Any = None
        self._between_ms = 0.0
        self._micro_end: float | None = None  # host mark at the end of the step's last micro
        self._paused_at: float | None = None
        self._after_pause = False  # the next sync point waits for work outside training
        self.enabled = True  # switch only between optimizer steps

    # -- micro-batch and step boundaries -------------------------------------------------
    def _current(self) -> _Micro:
        if self._step is None:
            self._step = _Step(start=HOST.mark())
        if self._micro is None:
            self._micro = _Micro()
            self._step.micro.append(self._micro)
        return self._micro

    def set_features(self, features: dict[str, Any]) -> None:
        """Attaches cost features (pack tokens, image tokens, ...) to the current micro-batch."""
        if not self.enabled:
            return
        self._current().features.update(features)

    def end_micro(self) -> None:
        self.resume()
        # a phase still open (say an optimizer step that a GradScaler skipped) ends here, so
        # one unfinished interval never blocks the steps after it
        for interval in self._open.values():
            interval.close()
        self._micro = None
        self._open.clear()
        self._sync_entry = None
        self._micro_end = HOST.mark() if self._step is not None else None

    def end_step(self, global_step: int, epoch: int) -> None:
        """Closes the optimizer step; it is resolved once all its device events have completed."""
        self.end_micro()  # resumes a paused step first
        if not self.enabled:
            self._step = None
            return
        if self._step is None:
            return
        self._step.end = HOST.mark()
        self._step.global_step, self._step.epoch = global_step, epoch
        self._step.between_ms, self._between_ms = self._between_ms, 0.0
        self._pending.append(self._step)
        self._step, self._micro_end, self._after_pause = None, None, False

    def discard_step(self) -> None:
        """Drops a step that did not finish (an exception or an interrupted epoch)."""
        self._step, self._micro = None, None
        self._open.clear()
        self._micro_end, self._paused_at, self._after_pause = None, None, False

    def pause(self) -> None:
        """Stops the open step's clock: work outside training (validation, a checkpoint save)
        runs until :meth:`resume`. Between two micro-batches the pause starts at the end of the
        last one (so whatever ran since, say the validation loader's set-up, is excluded too);
        outside a step, or paused already, it does nothing."""
        if self._step is None or self._paused_at is not None:
            return
        between_micro = self._micro is None and self._micro_end is not None
        self._paused_at = self._micro_end if between_micro else HOST.mark()

    def resume(self) -> bool:
        """Restarts a paused step's clock (training goes on); returns whether it was paused.
        The paused time becomes the step's ``outside_step_ms``."""
        if self._paused_at is None:
            return False
        if self._step is not None:
            self._step.outside_ms += HOST.elapsed_ms(self._paused_at, HOST.mark())
        self._paused_at, self._after_pause = None, True
        return True

    def sync_point_is_between(self) -> bool:
        """Called as a sync point starts: whether its wait is for work outside training (before
        a step's first micro-batch, or the first one after a pause), reported through
        :meth:`between_steps` and never counted as waiting. Resumes a paused step."""
        self.resume()
        between = self._step is None or self._after_pause
        self._after_pause = False
        return between

    @property
    def step_open(self) -> bool:
        """Whether the current optimizer step has started (its first mark was taken)."""
        return self._step is not None

    @property
    def in_micro_batch(self) -> bool:
        """Whether a training micro-batch is being timed now (enabled, inside a step, not
        paused for validation or a save): where work that interrupts phases (a collective's
        wait) belongs to the step."""
        return self.enabled and self._step is not None and self._paused_at is None

    def between_steps(self, ms: float) -> None:
        """Records a wait for work outside training (before the next step starts, or after a
        pause inside it): reported as ``between_steps_ms``, never counted as waiting."""
        if self.enabled:
            self._between_ms += ms

    # -- phases ---------------------------------------------------------------------------
    def start(self, phase: str, *, host: bool = False) -> None:
        if not self.enabled or phase in self._open:  # a phase re-entered (LBFGS) keeps its start
            return
        clock = HOST if host else self.device
        interval = _Interval(phase, clock, clock.mark())
        micro = self._current()
        # a phase nested in an open one is excluded from it (vision inside the language model)
        for outer in self._open.values():
            if outer.clock is clock:
                outer.minus.append(interval)
        self._open[phase] = interval
        micro.intervals.append(interval)

    def stop(self, phase: str) -> None:
        interval = self._open.pop(phase, None)
        if interval is not None:
            interval.end = interval.clock.mark()

    def mark_sync_entry(self) -> None:
        """Called when a gradient bucket is handed to the all-reduce (from the DDP comm hook)."""
        if self.enabled:
            self._sync_entry = self.device.mark()

    def stop_backward(self) -> None:
        """Ends ``backward``; the time after the last bucket was ready becomes ``sync_wait``."""
        interval = self._open.pop("backward", None)
        if interval is None:
            return
        interval.end = interval.clock.mark()
        if self._sync_entry is not None and interval.clock is self.device:
            wait = _Interval(SYNC_WAIT, self.device, self._sync_entry, interval.end)
            interval.minus.append(wait)
            self._current().intervals.append(wait)
            self._sync_entry = None

    # -- results --------------------------------------------------------------------------
    def drain(self) -> list[ResolvedStep]:
        """The finished steps whose events have all completed, oldest first."""
        out: list[ResolvedStep] = []
        while self._pending:
            step = self._pending[0]
            if not all(i.ready() for m in step.micro for i in m.intervals):
                break
            self._pending.popleft()
            out.append(_resolve(step))
        return out


@contextlib.contextmanager
def wait_phase(timers: Iterable[StepTimer], phase: str) -> Iterator[None]:
    """Times the block as ``phase`` on each of ``timers`` that is inside a training micro-batch
    (:attr:`StepTimer.in_micro_batch`): a wait inside a collective, which interrupts the phases
    around it and is excluded from them. Each timer uses its own clock: the host clock on the
    CPU (gloo blocks the calling thread there), and on CUDA events on the current stream
    (the compute stream), which measure how long that stream stalls on the collective's
    stream, without a host synchronisation."""
    active = [t for t in timers if t.in_micro_batch]
    for t in active:
        t.start(phase)
    try:
        yield
    finally:
        for t in active:
            t.stop(phase)


def _resolve(step: _Step) -> ResolvedStep:
    phases = dict.fromkeys(MEASURED_PHASES, 0.0)
    micro_out = []
    calls = [
        max(i.ms(), 0.0)
        for m in step.micro
        for i in m.intervals
        if i.phase == COLLECTIVE_WAIT and i.end is not None
    ]
    for m in step.micro:
        ms = dict.fromkeys(MEASURED_PHASES, 0.0)
        for i in m.intervals:
            if i.end is not None:
                ms[i.phase] += max(i.ms(), 0.0)
        for k, v in ms.items():
            phases[k] += v
        micro_out.append({**m.features, **{f"{k}_ms": round(v, 4) for k, v in ms.items()}})
    return ResolvedStep(
        global_step=step.global_step,
        epoch=step.epoch,
        step_ms=HOST.elapsed_ms(step.start, step.end) - step.outside_ms,
        phases_ms=phases,
        micro=micro_out,
        between_steps_ms=step.between_ms,
        outside_step_ms=step.outside_ms,
        collective_calls_ms=calls,
    )
