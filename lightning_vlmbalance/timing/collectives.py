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

The wrap is per model: :func:`time_collectives` wraps the methods of the parameter groups of
one model's FSDP2 modules (instance attributes over the class's methods), with the timer it is
given, and the handle it returns removes them. Another model in the process (a frozen teacher,
a second fit's model) is not timed, and nothing is kept at module level.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from lightning_vlmbalance.timing.timer import COLLECTIVE_WAIT, wait_phase

__all__ = ["TimedCollectives", "time_collectives"]

log = logging.getLogger(__name__)

# FSDP2's parameter-group methods where a rank blocks on its group (torch private API)
_METHODS = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")


class TimedCollectives:
    """The wraps :func:`time_collectives` installed on one model's FSDP2 parameter groups."""

    def __init__(self, groups: list[Any]) -> None:
        self.groups = groups

    def remove(self) -> None:
        """Restores the groups' own methods (the class's)."""
        for group in self.groups:
            for name in _METHODS:
                group.__dict__.pop(name, None)
        self.groups = []


def time_collectives(timer: Any, module: Any = None) -> TimedCollectives | None:
    """Times the collectives of ``module``'s FSDP2 parameter groups as ``collective_wait`` of
    ``timer`` (a :class:`~lightning_vlmbalance.timing.StepTimer`: host clock on the CPU, CUDA
    events on the compute stream on a GPU). Returns the handle that stops it
    (:meth:`TimedCollectives.remove`), or ``None`` where ``module`` has no FSDP2 module (plain
    DDP) or this torch's FSDP2 lacks the methods (warned).

    Raises:
        TypeError: without ``module`` (the timing was process-wide before; it is per model).
    """
    if module is None:
        raise TypeError(
            "time_collectives(timer, module): give the model whose FSDP2 collectives are timed"
            " (and call `.remove()` on the handle it returns to stop)"
        )
    groups = [g for m in module.modules() for g in _param_groups(m)]
    if not groups:
        return None
    missing = [m for m in _METHODS if not callable(getattr(groups[0], m, None))]
    if missing:
        log.warning(
            "lightning_vlmbalance: this torch's FSDP2 has no %s: the waits inside FSDP's"
            " collectives are not timed (collective_wait stays 0)",
            missing,
        )
        return None
    if any(name in group.__dict__ for group in groups for name in _METHODS):
        raise ValueError(
            "time_collectives: this model's FSDP2 collectives are timed already (`remove()` the"
            " first handle before timing them again): each call would be timed twice, and one"
            " handle's remove would take the other's wraps"
        )
    for group in groups:
        for name in _METHODS:
            setattr(group, name, _wrapped(getattr(group, name), timer))
    return TimedCollectives(groups)


def _param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` itself (not its children)."""
    state_of = getattr(module, "_get_fsdp_state", None)
    if not callable(state_of):
        return []
    state = state_of()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before the list of groups: one group or none
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _wrapped(bound: Callable[..., Any], timer: Any) -> Callable[..., Any]:
    @functools.wraps(bound)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with wait_phase([timer], COLLECTIVE_WAIT):
            return bound(*args, **kwargs)

    return timed
