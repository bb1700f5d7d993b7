"""One rank's straggler record (torch only, no Lightning): the core of ``StragglerMonitor``.

A :class:`StragglerRecorder` owns the rank's :class:`StepTimer`, the steps it resolved since the
last gather, the rank's JSON-lines file (one record per optimizer step, schema in
``docs/straggler_monitor.md``) and the whole-run totals of every rank, which a gather keeps the
same on every rank and ``state_dict`` / ``load_state_dict`` carry across a resume. A training
loop (or the Lightning adapter, ``callbacks/straggler_monitor.py``) drives the timer, calls
:meth:`StragglerRecorder.collect` after each optimizer step and :meth:`StragglerRecorder.gather`
at the same point on every rank. It may also note each packed micro-batch's real tokens and
capacity (:meth:`StragglerRecorder.note_pack`): they ride the same gather (two more numbers per
rank, no collective of their own) and come out as ``packing/efficiency``.

Example::

    recorder = StragglerRecorder()
    recorder.start("straggler/rank_0.jsonl", start_step=0)
    for step in range(1, 11):
        ...  # recorder.timer.start("vision_fwd") / stop(...), end_micro(), ...
        recorder.note_pack(tokens=120, capacity=128)  # optional: a packed micro-batch's fill
        recorder.timer.end_step(step, epoch=0)
        recorder.collect()
    recorder.gather()  # every rank: an all-gather over the default process group
    print(recorder.metrics(), recorder.summary())
    recorder.close()
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.parallel import collective_device
from lightning_vlmbalance.timing.summary import (
    SERIES,
    collective_waits,
    per_rank_metrics,
    stats_from_waits,
    window_row,
)
from lightning_vlmbalance.timing.timer import (
    COLLECTIVE_WAIT,
    MEASURED_PHASES,
    WAIT_PHASES,
    ResolvedStep,
    StepTimer,
)

__all__ = ["AllGather", "StragglerRecorder"]

log = logging.getLogger(__name__)

# stacks every rank's row: ``(n,) -> (world_size, n)`` (or ``(world_size * n,)``), same order on
# every rank; a ``torch.distributed`` process group (``None``: the default one) does it directly
AllGather = Callable[[torch.Tensor], torch.Tensor]

_WAIT_COLUMNS = [1 + MEASURED_PHASES.index(p) for p in WAIT_PHASES]  # in a gathered row
# appended to a rank's gathered row: [real tokens, capacity] of its packs since the last gather
_PACK_COLUMNS = 2


class StragglerRecorder:
    """One rank's phase timer, JSON-lines file and whole-run straggler totals.

    Args:
        device_clock: ``"cuda"`` to time device phases with CUDA events, else host time.

    Attributes:
        timer: the rank's :class:`StepTimer`; phases are started and stopped on it.
        jsonl_path: the open JSON-lines file (``None`` before :meth:`start`).
        total_step_ms: ``(R,)`` step milliseconds of each rank over every gathered step.
        total_wait_ms: ``(R,)`` waiting (``WAIT_PHASES``) of each rank over the same steps.
        steps_timed: optimizer steps gathered from every rank.
    """

    def __init__(self, device_clock: str = "cpu") -> None:
        self.timer = StepTimer(device_clock)
        self.rank, self.world_size = 0, 1
        self.jsonl_path: Path | None = None
        self._file: IO[str] | None = None
        self._window: list[ResolvedStep] = []  # resolved steps not gathered yet
        self._unlogged: np.ndarray = np.zeros((0, len(SERIES) + 1))  # gathered, not reported
        self._packs = np.zeros(_PACK_COLUMNS)  # this rank's [tokens, capacity], not gathered
        self._unlogged_packs = np.zeros(_PACK_COLUMNS)  # every rank's, gathered, not reported
        self.total_step_ms: np.ndarray = np.zeros(0)
        self.total_wait_ms: np.ndarray = np.zeros(0)
        self.steps_timed = 0

    def use_clock(self, device_clock: str) -> None:
        """Replaces the timer by one on ``device_clock`` (before timing starts), keeping
        ``enabled``."""
        enabled = self.timer.enabled
        self.timer = StepTimer(device_clock)
        self.timer.enabled = enabled

    @property
    def enabled(self) -> bool:
        """Whether steps are timed; switch it only between optimizer steps, on every rank."""
        return self.timer.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.timer.enabled = value

    @property
    def is_open(self) -> bool:
        """Whether the JSON-lines file is open (from :meth:`start` to :meth:`close`)."""
        return self._file is not None

    # -- the run -------------------------------------------------------------------------------
    def start(
        self, jsonl_path: str | Path, start_step: int, *, rank: int = 0, world_size: int = 1
    ) -> None:
        """Starts (or resumes) recording at optimizer step ``start_step``: whole-run totals
        restart if the number of ranks changed, and the JSON-lines file is opened for
        appending after dropping its records past ``start_step`` (see :func:`_open_jsonl`)."""
        self.rank, self.world_size = rank, world_size
        if len(self.total_step_ms) != world_size:
            if self.steps_timed:
                log.warning(
                    "StragglerMonitor: the run had %d ranks, now %d; whole-run totals restart.",
                    len(self.total_step_ms),
                    world_size,
                )
            self.total_step_ms, self.total_wait_ms = np.zeros(world_size), np.zeros(world_size)
            self.steps_timed = 0
        self._window.clear()
        self._unlogged = np.zeros((world_size, len(SERIES) + 1))
        self._packs, self._unlogged_packs = np.zeros(_PACK_COLUMNS), np.zeros(_PACK_COLUMNS)
        self.close()
        self.jsonl_path = Path(jsonl_path)
        self._file = _open_jsonl(self.jsonl_path, start_step)

    def collect(self) -> list[ResolvedStep]:
        """Writes the timer's resolved steps to the JSON-lines file (they wait for the next
        gather) and returns them."""
        steps = self.timer.drain()
        for step in steps:
            self._window.append(step)
            self._file.write(json.dumps(step.to_json(self.rank, self.world_size)))
            self._file.write("\n")
        return steps

    def note_pack(self, tokens: int, capacity: int) -> None:
        """Notes one trained micro-batch of real packs: ``tokens`` sample tokens (images
        included) in ``capacity`` token slots (``seq_len`` for one pack). Leave padding packs
        out: ``packing/efficiency`` is the fill of the real packs, as
        :attr:`EpochPlan.efficiency <lightning_vlmbalance.packing.plan.EpochPlan.efficiency>`
        defines it. Host integers only: no device sync."""
        self._packs[0] += tokens
        self._packs[1] += capacity

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def synchronize(self) -> None:
        """Waits for the device once (CUDA clock), so that every finished step resolves."""
        if self.timer.device.device:
            torch.cuda.synchronize()

    def gather(self, all_gather: AllGather | dist.ProcessGroup | None = None) -> None:
        """Adds every rank's steps since the last gather to the totals (on every rank). A
        collective: every rank calls it at the same point.

        Args:
            all_gather: a callable stacking every rank's row, or a ``torch.distributed``
                process group (``None``: the default group; one rank without one).
        """
        self.collect()
        self.flush()
        # one row per rank: the window's timings, then its packs' [tokens, capacity]
        row = torch.tensor(
            np.concatenate([window_row(self._window), self._packs]), dtype=torch.float64
        )
        calls = [ms for step in self._window for ms in step.collective_calls_ms]
        self._window.clear()
        self._packs = np.zeros(_PACK_COLUMNS)
        gathered = _all_gather_rows(row, all_gather)  # (R, 1 + len(SERIES) + 2)
        table = gathered[:, :-_PACK_COLUMNS]  # (R, 1 + len(SERIES))
        self._unlogged_packs = self._unlogged_packs + gathered[:, -_PACK_COLUMNS:].sum(axis=0)
        # time in FSDP's collectives -> the wait there, call by call (all ranks decide alike
        # from the gathered table whether to gather the calls: only where collectives ran)
        if table[:, 1 + MEASURED_PHASES.index(COLLECTIVE_WAIT)].any():
            table = collective_waits(table, _gather_calls(calls, all_gather))
        self.steps_timed += int(table[:, 0].min())
        self.total_step_ms += table[:, -1]
        for column in _WAIT_COLUMNS:
            self.total_wait_ms += table[:, column]
        self._unlogged = self._unlogged + table

    def metrics(self) -> dict[str, float]:
        """The metrics of what was gathered since the last call, the same on every rank: the
        ``straggler/*`` metrics (per-rank means; none when some rank gathered no step) and
        ``packing/efficiency``, every rank's real tokens over their capacity (none without a
        noted pack)."""
        table, self._unlogged = self._unlogged, np.zeros_like(self._unlogged)
        (tokens, capacity), self._unlogged_packs = self._unlogged_packs, np.zeros(_PACK_COLUMNS)
        metrics = {} if not len(table) or table[:, 0].min() == 0 else per_rank_metrics(table)
        if capacity > 0:
            metrics["packing/efficiency"] = float(tokens / capacity)
        return metrics

    def abort(self) -> None:
        """After a failure: writes the steps resolved so far, drops the open step and the
        ungathered window, and closes the file."""
        if self._file is not None:
            self.collect()
        self._window.clear()
        self._packs = np.zeros(_PACK_COLUMNS)
        self.timer.discard_step()
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict[str, Any]:
        """Whole-run totals, the same on every rank (as of the last gather)."""
        if not len(self.total_step_ms):
            return {"steps_timed": 0, "waste_frac": 0.0, "slowest_rank": 0,
                    "busy_ms_per_rank": [], "wait_ms_per_rank": []}  # fmt: skip
        stats = stats_from_waits(self.total_wait_ms, self.total_step_ms)
        return {
            "steps_timed": self.steps_timed,
            "waste_frac": stats.waste_frac,
            "slowest_rank": stats.worst_rank,
            "busy_ms_per_rank": [round(float(b), 1) for b in stats.busy_ms],
            "wait_ms_per_rank": [round(float(w), 1) for w in stats.wait_ms],
        }

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole-run totals (plain lists and ints)."""
        return {
            "total_step_ms": self.total_step_ms.tolist(),
            "total_wait_ms": self.total_wait_ms.tolist(),
            "steps_timed": self.steps_timed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_step_ms = np.asarray(state_dict["total_step_ms"], dtype=np.float64)
        self.total_wait_ms = np.asarray(state_dict["total_wait_ms"], dtype=np.float64)
        self.steps_timed = int(state_dict["steps_timed"])


def _gather_calls(
    calls: list[float], all_gather: AllGather | dist.ProcessGroup | None
) -> np.ndarray | None:
    """Every rank's collective-call durations of the window, ``(R, C)``; ``None`` when the
    ranks made different numbers of calls (two small all-gathers, at log points only)."""
    counts = _all_gather_rows(torch.tensor([float(len(calls))], dtype=torch.float64), all_gather)
    if counts.min() != counts.max() or counts.max() == 0:
        return None
    return _all_gather_rows(torch.tensor(calls, dtype=torch.float64), all_gather)


def _all_gather_rows(
    row: torch.Tensor, all_gather: AllGather | dist.ProcessGroup | None
) -> np.ndarray:
    """Every rank's ``row`` as a ``(R, len(row))`` array, in rank order."""
    if callable(all_gather):
        gathered = all_gather(row)
    elif not (dist.is_available() and dist.is_initialized()):
        gathered = row  # one rank, no process group
    else:
        row = row.to(collective_device(all_gather))
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(all_gather))]
        dist.all_gather(rows, row, group=all_gather)
        gathered = torch.stack(rows)
    return gathered.reshape(-1, row.numel()).cpu().numpy()


def _open_jsonl(path: Path, start_step: int) -> IO[str]:
    """Opens a rank's JSON-lines file for appending, first dropping its records past
    ``start_step`` (after a resume, the steps that are trained again) and any line cut short by
    a crash, so that the file holds each optimizer step once."""
    if path.exists():
        kept, dropped = [], 0
        with open(path) as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    step = int(json.loads(line)["global_step"])
                except (ValueError, KeyError, TypeError):
                    step = None  # not a whole record
                if step is not None and step <= start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
            log.warning(
                "StragglerMonitor: dropped %d records past global_step %d from %s (training"
                " starts at that step: each step is written once)",
                dropped,
                start_step,
                path,
            )
    return open(path, "a")
