"""The waits inside FSDP2's collectives, as the monitor phase ``collective_wait``.

Under FSDP2 every rank of the data-parallel group meets the others at every unit's parameter
all-gather (forward, and again in the backward) and gradient reduce-scatter (backward): a fast
rank waits there for the slowest, inside its own forward and backward. Without this module those
waits land in ``vision_fwd``, ``llm_fwd`` and ``backward``, ``sync_wait`` stays 0 and
``straggler/waste_frac`` understates exactly on the sharded path; a cost model fitted on such
phase times is biased toward the slowest rank's packs.

:func:`time_collectives` wraps the four methods of FSDP2's parameter group where a rank blocks
on its group: ``unshard`` (issues the all-gather; blocking when it is not asynchronous),
``wait_for_unshard`` (waits for it), ``post_backward`` (the reduce-scatter) and
``finalize_backward`` (waits for what is still in flight at the end of the backward). Each call
made while a training micro-batch is timed becomes an interval of ``collective_wait``, excluded
from the phase it interrupts (the timer's nesting). On the CPU (gloo) the calling thread blocks
in them, so the host clock measures the wait, plus the transfer and the collective's own copies.
On CUDA these calls only queue work and make the compute stream wait for FSDP's all-gather and
reduce-scatter streams: the timer's CUDA events, recorded on the compute stream before and after
each call, measure how long that stream stalled (plus the copy-out kernels queued there), read
later without a host synchronisation. The CUDA path has not run on a GPU yet.

The wrap is installed while at least one timer is registered and removed with the last one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from lightning_vlmbalance.timing.timer import COLLECTIVE_WAIT, wait_phase

__all__ = ["time_collectives"]

log = logging.getLogger(__name__)

# FSDP2's parameter-group methods where a rank blocks on its group (torch private API)
_METHODS = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
_TIMERS: list[Any] = []
_ORIGINALS: dict[str, Callable[..., Any]] = {}


def time_collectives(timer: Any, *, on: bool = True) -> bool:
    """Times FSDP2's collectives as ``collective_wait`` of ``timer`` (a
    :class:`~lightning_vlmbalance.timing.StepTimer`: host clock on the CPU, CUDA events on the
    compute stream on a GPU), or stops that with ``on=False``. Returns whether ``timer`` is
    registered now.
    """
    if not on:
        if timer in _TIMERS:
            _TIMERS.remove(timer)
        if not _TIMERS:
            _unpatch()
        return False
    if timer not in _TIMERS:
        if not _patch():
            return False
        _TIMERS.append(timer)
    return True


def _group_class() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return None
    return FSDPParamGroup


def _patch() -> bool:
    if _ORIGINALS:
        return True
    cls = _group_class()
    missing = [m for m in _METHODS if cls is None or not callable(getattr(cls, m, None))]
    if missing:
        log.warning(
            "lightning_vlmbalance: this torch's FSDP2 has no %s: the waits inside FSDP's"
            " collectives are not timed (collective_wait stays 0)",
            missing,
        )
        return False
    for name in _METHODS:
        original = getattr(cls, name)
        _ORIGINALS[name] = original
        setattr(cls, name, _wrapped(original))
    return True


def _unpatch() -> None:
    cls = _group_class()
    for name, original in _ORIGINALS.items():
        setattr(cls, name, original)
    _ORIGINALS.clear()


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _TIMERS:
            return original(self, *args, **kwargs)
        with wait_phase(_TIMERS, COLLECTIVE_WAIT):
            return original(self, *args, **kwargs)

    return timed
