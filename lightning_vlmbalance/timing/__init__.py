"""Straggler timing core: per-rank phase timers, the comm-hook wait timer, straggler statistics."""

from lightning_vlmbalance.timing.comm_hook import timed_comm_hook
from lightning_vlmbalance.timing.summary import (
    SERIES,
    StragglerStats,
    custom_scalars_layout,
    per_rank_metrics,
    stats_from_waits,
    straggler_stats,
    window_row,
)
from lightning_vlmbalance.timing.timer import PHASES, WAIT_PHASES, ResolvedStep, StepTimer

__all__ = [
    "PHASES",
    "SERIES",
    "WAIT_PHASES",
    "ResolvedStep",
    "StepTimer",
    "StragglerStats",
    "custom_scalars_layout",
    "per_rank_metrics",
    "stats_from_waits",
    "straggler_stats",
    "timed_comm_hook",
    "window_row",
]
