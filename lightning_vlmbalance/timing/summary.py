"""Straggler statistics over ranks (numpy only).

Given each rank's mean phase times per optimizer step, the rank-time lost to waiting and who made
the others wait:

- ``waste_frac``: time spent waiting at synchronisation points (``WAIT_PHASES``: the gradient
  all-reduce, Lightning's barriers, encoder balancing's returns, FSDP's collectives beyond their
  own cost, see :func:`collective_waits`) summed over ranks, over the total rank-time (step time
  summed over ranks).
  0 when ranks are perfectly balanced; with one straggler, about ``(R - 1) / R`` of its extra time.
- ``worst_rank``: the rank with the most *busy* time (step time minus waits): the straggler.
- ``max_over_median``: busiest rank's busy time over the median rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_vlmbalance.timing.timer import (
    COLLECTIVE_WAIT,
    MEASURED_PHASES,
    WAIT_PHASES,
    ResolvedStep,
)

__all__ = [
    "SERIES",
    "StragglerStats",
    "collective_waits",
    "custom_scalars_layout",
    "per_rank_metrics",
    "stats_from_waits",
    "straggler_stats",
    "window_row",
]

_WAIT_IDX = [MEASURED_PHASES.index(p) for p in WAIT_PHASES]
SERIES: tuple[str, ...] = (*MEASURED_PHASES, "step")  # what is logged per rank


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
        phases_ms: ``(R, len(MEASURED_PHASES))`` milliseconds per step of each rank, in
            ``MEASURED_PHASES`` order.
        step_ms: ``(R,)`` step milliseconds of each rank.
    """
    phases_ms = np.asarray(phases_ms, dtype=np.float64)
    step_ms = np.asarray(step_ms, dtype=np.float64)
    if phases_ms.ndim != 2 or phases_ms.shape != (len(step_ms), len(MEASURED_PHASES)):
        raise ValueError(
            f"phases_ms must be (ranks, {len(MEASURED_PHASES)}) and match step_ms, got"
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


def window_row(steps: Sequence[ResolvedStep]) -> np.ndarray:
    """One rank's window of resolved steps as the row gathered to rank 0: ``[n_steps, sum of
    each phase's ms (MEASURED_PHASES order), sum of step ms]``."""
    row = np.zeros(len(SERIES) + 1)
    row[0] = len(steps)
    for step in steps:
        row[1:-1] += [step.phases_ms[p] for p in MEASURED_PHASES]
        row[-1] += step.step_ms
    return row


_COLLECTIVE = 1 + MEASURED_PHASES.index(COLLECTIVE_WAIT)  # its column in a gathered row


def collective_waits(table: np.ndarray, calls: np.ndarray | None = None) -> np.ndarray:
    """The gathered rows (``(R, 1 + len(SERIES))``, the same steps on every rank) with the
    ``collective_wait`` column turned from the time each rank spent in FSDP's collectives into
    its wait there.

    In a blocking collective the rank that arrives last waits for nobody: its time is the
    collective's own cost (the transfer, the copies), which every rank pays and which is busy
    time, not waiting. With ``calls`` (``(R, C)``: every rank's duration of each of the
    window's ``C`` collective calls, in the order all ranks make them) a rank's wait is the sum
    over the calls of its duration less the shortest of that call: exact, whichever rank is
    last at each call. Without them (or when the ranks' call counts differ) the excess over the
    rank that spent the least over the whole window, which comes out low where the last rank
    to arrive changes from call to call."""
    table = np.array(table, dtype=np.float64)
    steps = table[:, 0]
    if len(table) < 2 or steps.min() <= 0:
        return table
    if calls is not None and calls.ndim == 2 and calls.shape[0] == len(table) and calls.size:
        table[:, _COLLECTIVE] = (calls - calls.min(axis=0)).sum(axis=1)
        return table
    per_step = table[:, _COLLECTIVE] / steps
    table[:, _COLLECTIVE] = (per_step - per_step.min()) * steps
    return table


def per_rank_metrics(table: np.ndarray) -> dict[str, float]:
    """The ``straggler/*`` metrics from the gathered rows (``(R, 1 + len(SERIES))``, every rank
    with at least one step): per-rank means of each series, and the straggler statistics."""
    means = table[:, 1:] / table[:, :1]
    stats = straggler_stats(means[:, :-1], means[:, -1])
    metrics = {
        f"straggler/{series}_ms/rank_{r}": float(means[r, k])
        for r in range(len(means))
        for k, series in enumerate(SERIES)
    }
    metrics["straggler/waste_frac"] = stats.waste_frac
    metrics["straggler/worst_rank"] = float(stats.worst_rank)
    metrics["straggler/max_over_median"] = stats.max_over_median
    return metrics


def custom_scalars_layout() -> dict[str, dict[str, list]]:
    """TensorBoard layout: one multi-line chart per phase (a line per rank), the summary, and
    the ``balance/*`` metrics of the ``"vlmbalance"`` strategy next to them (empty without it)."""
    per_rank = {f"{s}_ms": ["Multiline", [rf"straggler/{s}_ms/rank_\d+"]] for s in SERIES}
    summary = {
        k: ["Multiline", [rf"straggler/{k}$"]]
        for k in ("waste_frac", "worst_rank", "max_over_median")
    }
    balance = {
        k: ["Multiline", [rf"balance/{k}$"]]
        for k in (
            "moved_packs",
            "planned_waste_frac",
            "exchange_ms",
            "exposed_exchange_ms",
            "choice",
        )
    }
    # mode="auto": its predicted step on the chart of every rank's measured one
    balance["predicted_step_ms"] = [
        "Multiline",
        [r"balance/predicted_step_ms$", r"straggler/step_ms/rank_\d+"],
    ]
    return {
        "straggler per rank": per_rank,
        "straggler summary": summary,
        "rebalancing": balance,
    }
