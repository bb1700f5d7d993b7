"""Straggler statistics over ranks (numpy only).

Given each rank's mean phase times per optimizer step, the rank-time lost to waiting and who made
the others wait:

- ``waste_frac``: time spent waiting at synchronisation points (``sync_wait`` +
  ``lightning_sync``) summed over ranks, over the total rank-time (step time summed over ranks).
  0 when ranks are perfectly balanced; with one straggler, about ``(R - 1) / R`` of its extra time.
- ``worst_rank``: the rank with the most *busy* time (step time minus waits): the straggler.
- ``max_over_median``: busiest rank's busy time over the median rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_vlmbalance.timing.timer import PHASES, WAIT_PHASES

__all__ = ["StragglerStats", "stats_from_waits", "straggler_stats"]

_WAIT_IDX = [PHASES.index(p) for p in WAIT_PHASES]


@dataclass(frozen=True, slots=True)
class StragglerStats:
    waste_frac: float
    worst_rank: int
    max_over_median: float
    busy_ms: np.ndarray  # (R,)
    wait_ms: np.ndarray  # (R,)


def straggler_stats(phases_ms: np.ndarray, step_ms: np.ndarray) -> StragglerStats:
    """Straggler statistics from per-rank phase times.

    Args:
        phases_ms: ``(R, len(PHASES))`` milliseconds per step of each rank, in ``PHASES`` order.
        step_ms: ``(R,)`` step milliseconds of each rank.
    """
    phases_ms = np.asarray(phases_ms, dtype=np.float64)
    step_ms = np.asarray(step_ms, dtype=np.float64)
    if phases_ms.ndim != 2 or phases_ms.shape != (len(step_ms), len(PHASES)):
        raise ValueError(
            f"phases_ms must be (ranks, {len(PHASES)}) and match step_ms, got"
            f" {phases_ms.shape} and {step_ms.shape}"
        )
    return stats_from_waits(phases_ms[:, _WAIT_IDX].sum(axis=1), step_ms)


def stats_from_waits(wait_ms: np.ndarray, step_ms: np.ndarray) -> StragglerStats:
    """Straggler statistics from each rank's waiting and step time (per step or summed)."""
    wait = np.asarray(wait_ms, dtype=np.float64)
    step_ms = np.asarray(step_ms, dtype=np.float64)
    busy = np.maximum(step_ms - wait, 0.0)
    total = step_ms.sum()
    median = float(np.median(busy))
    return StragglerStats(
        waste_frac=float(wait.sum() / total) if total > 0 else 0.0,
        worst_rank=int(np.argmax(busy)),  # ties: the lowest rank
        max_over_median=float(busy.max() / median) if median > 0 else 1.0,
        busy_ms=busy,
        wait_ms=wait,
    )
