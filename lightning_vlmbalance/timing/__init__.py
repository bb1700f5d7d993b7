"""Straggler timing core: per-rank phase timers, the comm-hook wait timer, straggler statistics."""

from lightning_vlmbalance.timing.comm_hook import timed_comm_hook
from lightning_vlmbalance.timing.summary import StragglerStats, stats_from_waits, straggler_stats
from lightning_vlmbalance.timing.timer import PHASES, WAIT_PHASES, ResolvedStep, StepTimer

__all__ = [
    "PHASES",
    "WAIT_PHASES",
    "ResolvedStep",
    "StepTimer",
    "StragglerStats",
    "stats_from_waits",
    "straggler_stats",
    "timed_comm_hook",
]
