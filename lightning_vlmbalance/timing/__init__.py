"""Straggler timing core: per-rank phase timers, the comm-hook wait timer, straggler statistics,
and :class:`StragglerRecorder`, one rank's JSON lines and whole-run totals (no Lightning)."""

from lightning_vlmbalance.timing.collectives import time_collectives
from lightning_vlmbalance.timing.comm_hook import timed_comm_hook
from lightning_vlmbalance.timing.monitor import StragglerRecorder
from lightning_vlmbalance.timing.summary import (
    SERIES,
    StragglerStats,
    custom_scalars_layout,
    per_rank_metrics,
    stats_from_waits,
    straggler_stats,
    window_row,
)
from lightning_vlmbalance.timing.timer import (
    COLLECTIVE_WAIT,
    COMPUTE_PHASES,
    DEVICE_PHASES,
    ENCODER_RETURN,
    LIGHTNING_SYNC,
    MEASURED_PHASES,
    SYNC_WAIT,
    WAIT_PHASES,
    ResolvedStep,
    StepTimer,
)

__all__ = [
    "COLLECTIVE_WAIT",
    "COMPUTE_PHASES",
    "DEVICE_PHASES",
    "ENCODER_RETURN",
    "LIGHTNING_SYNC",
    "MEASURED_PHASES",
    "SERIES",
    "SYNC_WAIT",
    "WAIT_PHASES",
    "ResolvedStep",
    "StepTimer",
    "StragglerRecorder",
    "StragglerStats",
    "custom_scalars_layout",
    "per_rank_metrics",
    "stats_from_waits",
    "straggler_stats",
    "time_collectives",
    "timed_comm_hook",
    "window_row",
]
