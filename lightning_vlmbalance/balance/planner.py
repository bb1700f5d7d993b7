"""Rebalance planner: which rank computes which pack at which micro-step of one global batch.

Pure numpy, no Lightning, no torch. Every rank calls :func:`plan_rebalance` with the same
all-gathered integers and gets the same plan: costs are integers (e.g. microseconds from
:meth:`CostModel.pack_cost_us`), every sort is stable with ties broken by pack index, and the only
floating-point operation (the tolerance budget) is one IEEE multiplication of identical inputs.

Notation (shape suffixes as in the rest of the package): ``R`` ranks, ``G`` micro-steps per rank
per global batch (gradient accumulation), ``K`` packs per micro-batch, ``N = R * G * K`` packs.
Pack ``i`` has cost ``cost_N[i]`` and is held by rank ``origin_N[i]``; the *baseline* is every rank
computing its own packs in index order (micro-step ``m`` gets the rank's packs ``m*K .. m*K+K-1``).

Objectives (what the synchronisation model makes a rank wait for):

* ``"microstep"``: sum over micro-steps of the slowest rank's micro-batch (a collective inside
  every micro-batch: FSDP, expert or tensor parallelism).
* ``"step"``: the slowest rank's total over the global batch (DDP with one gradient sync per
  optimizer step); where in the step a rank computes a pack does not matter.
* ``"both"``: ``"microstep"`` first, then the per-rank totals as the tie-breaker.

Two phases. Phase 1 finds the balance-optimal value ignoring where packs are; phase 2 finds a
placement within ``tolerance`` of it that moves few packs (for ``"microstep"`` at tolerance 0
provably the fewest with distinct costs, and the fewest in every brute-forced small case with
ties; a heuristic otherwise). For ``"microstep"`` with one pack per micro-batch phase 1 is exact
(sort by cost, cut into runs of ``R``: the run heads are the micro-step maxima) and phase 2 is
the *deadline* formulation below. For ``"step"`` (NP-hard: balanced number partitioning) phase 1
is the balanced largest differencing method and phase 2 repairs the baseline with swaps,
re-solving a growing neighbourhood of ranks when swaps do not reach the budget. With ``K > 1``
phase 1 cuts runs of ``R*K`` packs, fills each run's micro-batches heaviest pack to lightest
rank, and phase 2 relabels micro-batches to the ranks holding most of their packs (tolerance and
the ``"both"`` tie-break unused). Whatever the objective, a plan no better than the baseline is
replaced by the baseline (no moves): a heuristic phase 1 can be worse than not moving.

Phase 2 for ``"microstep"`` (docs/rebalancing.md has the argument): give micro-step ``m`` a cap
``cap_G[m]`` (the phase-1 run heads, raised within the tolerance budget). A pack may run in any
micro-step whose cap is at least its cost: micro-steps ``0 .. deadline[i]``. Every micro-step has
exactly ``R`` slots, so the prefix ``0..j`` must hold all packs whose deadline is ``<= j``; its
``slack[j] = (j+1)*R - #{deadline <= j}`` spare slots are the only room for a pack with a later
deadline. A rank keeps at most one own pack per micro-step. Keeping a pack at its deadline is
free; keeping it at an earlier micro-step ``m`` uses one unit of slack at every boundary
``m .. deadline-1``. The planner walks the micro-steps from the last to the first; at each one a
rank keeps an own pack due there if it has one, otherwise the pending own pack with the earliest
deadline if the slack allows. All other packs move, filled into the free slots earliest deadline
first. With a tolerance two cap choices are tried (heads raised in proportion, and heads raised
toward the no-move caps of each rank sorting its own packs); the naive plan is the fallback, so
moves never exceed it. With distinct costs and tolerance 0 the slack is zero and the
micro-steps' contents are forced: then no placement moves fewer packs than the naive one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from lightning_vlmbalance._moved import DP_RANKS, renamed_keyword

__all__ = ["OBJECTIVES", "RebalancePlan", "naive_moved_packs", "plan_rebalance"]

Objective = Literal["microstep", "step", "both"]
Objective = Literal["microstep", "step", "both"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

# Rounds of swaps in the "step" repair (bounds the work on hard inputs).
_SWAP_ROUNDS = 32
# Lighter packs tried per held pack in a covering swap.
_CANDIDATES = 8
# Largest total cost (and budget) the integer arithmetic accepts.
_MAX_TOTAL = 2**62
# Light ranks an overloaded rank may swap with in one round when no one swap covers it.
_PARTNERS = 3


@dataclass(frozen=True)
class RebalancePlan:
    """The placement of one global batch, its moves and its predicted costs.

    Attributes:
        assignment: ``(R, G, K)``, the pack rank ``r`` computes at micro-step ``m``, slot ``k``.
        moves: ``(M, 3)``, a row ``(pack, from_rank, to_rank)`` per pack that changes rank,
            by pack index.
        cost: ``(R, G)`` predicted cost of each (rank, micro-step) micro-batch under the plan.
        baseline_cost: ``(R, G)``, the same without rebalancing (each rank its own packs, in order).
        objective: ``"microstep"``, ``"step"`` or ``"both"``.
        value: the objective's value of the plan (same unit as the costs).
        baseline_value: its value without rebalancing.
        optimal_value: the best value found ignoring moves: phase 1's, or the baseline's where
            that is lower (phase 1 is a heuristic for ``"step"`` and with ``K > 1``).
        lower_bound: a value no placement can beat (equal to ``optimal_value`` for
            ``"microstep"``/``"both"`` with one pack per micro-batch).
        mean_rank_cost: total cost over ``R``: the step time of a perfectly balanced batch.
    """

    assignment: np.ndarray
    moves: np.ndarray
    cost: np.ndarray
    baseline_cost: np.ndarray
    objective: str
    value: int
    baseline_value: int
    optimal_value: int
    lower_bound: float
    mean_rank_cost: float

    @property
    def moved_packs(self) -> int:
        return len(self.moves)

    @property
    def waste_before(self) -> float:
        """``1 - mean_rank_cost / baseline_value``: share of rank-time spent waiting."""
        return _waste(self.mean_rank_cost, self.baseline_value)

    @property
    def waste_after(self) -> float:
        return _waste(self.mean_rank_cost, self.value)

    @property
    def waste_lower_bound(self) -> float:
        return _waste(self.mean_rank_cost, self.lower_bound)

    def rank_of(self) -> np.ndarray:
        """``(N,)`` the rank that computes each pack under the plan."""
        return _rank_of(self.assignment)


def _rank_of(assignment_RGK: np.ndarray) -> np.ndarray:
    """``(N,)`` the rank of each pack in an ``(R, G, K)`` assignment."""
    R = assignment_RGK.shape[0]
    rank_of = np.empty(assignment_RGK.size, dtype=np.int64)
    rank_of[assignment_RGK.reshape(-1)] = np.repeat(np.arange(R), assignment_RGK.size // R)
    return rank_of


def _waste(mean: float, value: float) -> float:
    return 1.0 - mean / value if value > 0 else 0.0


@renamed_keyword(*DP_RANKS)
def plan_rebalance(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    num_replicas: int,
    micro_steps: int,
    *,
    packs_per_micro_batch: int = 1,
    objective: Objective = "microstep",
    tolerance: float = 0.0,
) -> RebalancePlan:
    """Plans one global batch: the balance-optimal placement that moves the fewest packs.

    Args:
        cost_N: integer cost of each pack (any unit; the planner only adds and compares).
        origin_N: the rank holding each pack; every rank holds ``micro_steps *
            packs_per_micro_batch`` packs.
        num_replicas: ``R``, the data-parallel ranks (``world_size=``, deprecated, still works).
        micro_steps: ``G``, micro-batches per rank per global batch.
        packs_per_micro_batch: ``K``; with ``K > 1`` a micro-batch's cost is the sum of its
            packs and phase 1 is a heuristic (the lower bound is then not always reachable).
        objective: ``"microstep"``, ``"step"`` or ``"both"`` (module docstring).
        tolerance: the plan may be this fraction worse than phase 1's value if that moves fewer
            packs (``0.01`` = 1%).

    Returns:
        A :class:`RebalancePlan`; the same on every process for the same input.

    Raises:
        ValueError: on a bad shape, a non-integer or negative cost, an origin outside
            ``[0, num_replicas)``, a rank holding the wrong number of packs, an unknown objective
            or a negative tolerance.

    Example::

        >>> plan = plan_rebalance(np.array([9, 1, 1, 1]), np.array([0, 0, 1, 1]), 2, 2)
        >>> plan.value, plan.baseline_value, plan.moved_packs
        (10, 10, 0)
    """
    R, G, K = int(num_replicas), int(micro_steps), int(packs_per_micro_batch)
    cost_N, origin_N = _check_inputs(cost_N, origin_N, R, G, K, objective, tolerance)
    baseline_RGK = _baseline_assignment(origin_N, R, G, K)
    total = int(cost_N.sum())
    mean_rank_cost = total / R
    baseline_cost_RG = cost_N[baseline_RGK].sum(axis=2)

    if objective == "step":
        opt_RGK = _phase1_step(cost_N, R, G, K)
        optimal = _value(cost_N[opt_RGK].sum(axis=2), "step")
        assignment = _phase2_step(cost_N, origin_N, baseline_RGK, opt_RGK, optimal, tolerance)
        lower_bound = _step_lower_bound(cost_N, R, G, K)
    elif K == 1:
        order_N = _sorted_order(cost_N)
        heads_G = cost_N[order_N[::R]]
        optimal = int(heads_G.sum())
        assignment = _plan_microstep(
            cost_N, origin_N, order_N, heads_G, R, G, tolerance, balance_ranks=objective == "both"
        )
        lower_bound = float(optimal)
    else:
        opt_RGK = _phase1_microstep_multi(cost_N, R, G, K)
        optimal = _value(cost_N[opt_RGK].sum(axis=2), "microstep")
        assignment = _phase2_microstep_multi(origin_N, opt_RGK)
        order_N = _sorted_order(cost_N)
        lower_bound = float(max(int(cost_N[order_N[:: R * K]].sum()), mean_rank_cost * 1))

    cost_RG = cost_N[assignment].sum(axis=2)
    primary = "step" if objective == "step" else "microstep"
    rank_of = _rank_of(assignment)
    moved = np.flatnonzero(rank_of != origin_N)
    # phase 1 is a heuristic for "step" and for K > 1 and may be worse than not moving at all
    # (e.g. sorted runs of R*K packs split a well-balanced baseline): then keep the baseline,
    # which also moves nothing; at an equal value the baseline wins too (no exchange)
    plan_key = _objective_key(cost_RG, objective)
    baseline_key = _objective_key(baseline_cost_RG, objective)
    if plan_key > baseline_key or (plan_key == baseline_key and len(moved)):
        assignment, cost_RG = baseline_RGK, baseline_cost_RG
        rank_of = origin_N
        moved = np.zeros(0, dtype=np.int64)
    optimal = min(optimal, _value(baseline_cost_RG, primary))
    moves_M3 = np.stack([moved, origin_N[moved], rank_of[moved]], axis=1).astype(np.int64)
    return RebalancePlan(
        assignment=assignment,
        moves=moves_M3,
        cost=cost_RG,
        baseline_cost=baseline_cost_RG,
        objective=objective,
        value=_value(cost_RG, primary),
        baseline_value=_value(baseline_cost_RG, primary),
        optimal_value=optimal,
        lower_bound=lower_bound,
        mean_rank_cost=mean_rank_cost,
    )


@renamed_keyword(*DP_RANKS)
def naive_moved_packs(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    num_replicas: int,
    packs_per_micro_batch: int = 1,
    *,
    _order_N: np.ndarray | None = None,
) -> int:
    """Moves of the obvious plan: sorted runs, a pack stays if its rank's slot in the run is free.

    Packs sorted by cost (descending, ties by index) are cut into runs of ``R * K``, one per
    micro-step; inside a run each rank keeps up to ``K`` of its own packs and the rest move.
    """
    R, K = int(num_replicas), int(packs_per_micro_batch)
    cost_N = np.asarray(cost_N)
    origin_N = np.asarray(origin_N, dtype=np.int64)
    order_N = _sorted_order(cost_N) if _order_N is None else _order_N
    run_N = np.empty(len(cost_N), dtype=np.int64)
    run_N[order_N] = np.arange(len(cost_N)) // (R * K)
    counts = np.bincount(run_N * R + origin_N, minlength=(run_N.max() + 1) * R if len(run_N) else 0)
    return int(len(cost_N) - np.minimum(counts, K).sum())


# ---------------------------------------------------------------------------------------------
# input checks, baseline, values


def _check_inputs(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    R: int,
    G: int,
    K: int,
    objective: str,
    tolerance: float,
) -> tuple[np.ndarray, np.ndarray]:
    if objective not in OBJECTIVES:
        raise ValueError(f"`plan_rebalance(objective={objective!r})`: expected one of {OBJECTIVES}")
    for name, val in (("num_replicas", R), ("micro_steps", G), ("packs_per_micro_batch", K)):
        if val < 1:
            raise ValueError(f"`plan_rebalance({name}={val})` must be >= 1")
    if not (tolerance >= 0.0 and np.isfinite(tolerance)):
        raise ValueError(f"`plan_rebalance(tolerance={tolerance!r})` must be a finite value >= 0")
    cost_N = np.asarray(cost_N)
    origin_N = np.asarray(origin_N)
    if cost_N.ndim != 1 or origin_N.shape != cost_N.shape:
        raise ValueError(
            f"plan_rebalance: costs and origins must be 1-d of one length, got shapes"
            f" {cost_N.shape} and {origin_N.shape}"
        )
    if len(cost_N) != R * G * K:
        raise ValueError(
            f"plan_rebalance: {len(cost_N)} packs, but num_replicas={R} x micro_steps={G} x"
            f" packs_per_micro_batch={K} = {R * G * K}"
        )
    if cost_N.dtype.kind not in "iub" or origin_N.dtype.kind not in "iub":
        raise ValueError(
            "plan_rebalance: costs and origins must be integer arrays (got"
            f" {cost_N.dtype} and {origin_N.dtype}) so that every rank computes the same plan;"
            " use CostModel.pack_cost_us for integer costs"
        )
    cost_N = cost_N.astype(np.int64)
    origin_N = origin_N.astype(np.int64)
    if (cost_N < 0).any():
        bad = int(np.flatnonzero(cost_N < 0)[0])
        raise ValueError(f"plan_rebalance: pack {bad} has a negative cost {int(cost_N[bad])}")
    if len(cost_N) and int(cost_N.max()) * len(cost_N) >= _MAX_TOTAL:
        raise ValueError(
            f"plan_rebalance: costs up to {int(cost_N.max())} over {len(cost_N)} packs may overflow"
            " int64 sums; use a coarser unit (e.g. microseconds)"
        )
    if ((origin_N < 0) | (origin_N >= R)).any():
        bad = int(np.flatnonzero((origin_N < 0) | (origin_N >= R))[0])
        raise ValueError(
            f"plan_rebalance: pack {bad} has origin rank {int(origin_N[bad])}, outside"
            f" [0, num_replicas={R})"
        )
    held = np.bincount(origin_N, minlength=R)
    if (held != G * K).any():
        bad = int(np.flatnonzero(held != G * K)[0])
        raise ValueError(
            f"plan_rebalance: rank {bad} holds {int(held[bad])} packs; every rank must hold"
            f" micro_steps x packs_per_micro_batch = {G * K}"
        )
    return cost_N, origin_N


def _baseline_assignment(origin_N: np.ndarray, R: int, G: int, K: int) -> np.ndarray:
    """Each rank computes its own packs in index order."""
    return _argsort_by_key(origin_N).reshape(R, G, K)


def _sorted_order(cost_N: np.ndarray) -> np.ndarray:
    """Pack indices by cost, heaviest first, ties by index (a stable sort of ``-cost``)."""
    return _argsort_by_key(-np.asarray(cost_N, dtype=np.int64))


def _argsort_by_key(key: np.ndarray) -> np.ndarray:
    """Indices by integer key, ties by index: a stable sort, done as one sort of unique keys.

    Keys spanning at most 2**16 values are radix-sorted as 16-bit integers; otherwise
    ``(key - min) * n + index`` is unique, so any sort gives the one answer (and numpy's
    default sort of unique keys is about twice as fast as its stable sort).
    """
    key = np.asarray(key, dtype=np.int64)
    n = len(key)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lo = int(key.min())
    span = int(key.max()) - lo + 1
    if span <= 1 << 16:  # numpy's stable sort of 16-bit integers is a radix sort
        return np.argsort((key - lo).astype(np.uint16), kind="stable")
    if span * n < 2**62:
        return np.argsort((key - lo) * n + np.arange(n))
    return np.argsort(key, kind="stable")


def _value(cost_RG: np.ndarray, objective: str) -> int:
    if objective == "step":
        return int(cost_RG.sum(axis=1).max())
    return int(cost_RG.max(axis=0).sum())


def _objective_key(cost_RG: np.ndarray, objective: str) -> tuple[int, ...]:
    """What the objective minimises, as a tuple to compare (``"both"``: the per-rank totals
    break ties of the micro-step sum)."""
    if objective == "both":
        return (_value(cost_RG, "microstep"), _value(cost_RG, "step"))
    return (_value(cost_RG, objective),)


def _budget(value: int, tolerance: float) -> int:
    """The largest objective value phase 2 may reach (at most ``_MAX_TOTAL``: no overflow)."""
    extra = tolerance * value
    return min(value + int(extra) if extra < _MAX_TOTAL else _MAX_TOTAL, _MAX_TOTAL)


# ---------------------------------------------------------------------------------------------
# "microstep" (and "both") with one pack per micro-batch


def _plan_microstep(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    order_N: np.ndarray,
    heads_G: np.ndarray,
    R: int,
    G: int,
    tolerance: float,
    *,
    balance_ranks: bool,
) -> np.ndarray:
    """Phase 2 for ``"microstep"``: the best of a few cap choices, never worse than naive.

    At tolerance 0 the caps are the run heads (the only choice). With a tolerance there are
    two candidates: the heads raised in proportion (:func:`_raise_caps`), and the heads raised
    toward the micro-step maxima of the *local sort* (every rank its own packs, heaviest first:
    caps under which no pack moves) as far as the budget allows. The naive plan is the last
    resort, so the moves never exceed its count.
    """
    # the local sort (each rank its own packs, heaviest first) moves nothing: take it if it fits
    local_RG = -np.sort(-cost_N[_argsort_by_key(origin_N)].reshape(R, G), axis=1)
    if int(local_RG.max(axis=0).sum()) <= _budget(int(heads_G.sum()), tolerance):
        return _local_sort_assignment(cost_N, origin_N, R, G)
    if tolerance > 0:
        caps = [
            _raise_caps(heads_G, tolerance),
            _caps_toward_local(cost_N, origin_N, heads_G, R, G, tolerance),
        ]
    else:
        caps = [heads_G]
    decisions = [_keep_decisions(cost_N, origin_N, order_N, cap_G, R, G) for cap_G in caps]
    kept = [int((keep_RG >= 0).sum()) for keep_RG, _ in decisions]
    best = int(np.argmax(kept))  # ties: the first
    if len(cost_N) - kept[best] > naive_moved_packs(cost_N, origin_N, R, _order_N=order_N):
        return _naive_assignment(cost_N, origin_N, order_N, R, G, balance_ranks)
    keep_RG, deadline_N = decisions[best]
    return _materialise(cost_N, origin_N, order_N, keep_RG, deadline_N, R, G, balance_ranks)


def _naive_assignment(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    order_N: np.ndarray,
    R: int,
    G: int,
    balance_ranks: bool,
) -> np.ndarray:
    """Sorted runs; inside a run a pack stays if its rank's slot is free, the rest fill in."""
    N = len(cost_N)
    run_sorted = np.arange(N) // R
    slot_key = run_sorted * R + origin_N[order_N]
    stays = np.zeros(N, dtype=bool)
    stays[np.unique(slot_key, return_index=True)[1]] = True
    assignment_RG = np.full((R, G), -1, dtype=np.int64)
    kept = order_N[stays]
    assignment_RG[origin_N[kept], run_sorted[stays]] = kept
    _fill_free_slots(assignment_RG, cost_N, order_N[~stays], G, balance_ranks)
    return assignment_RG[:, :, None]


def _local_sort_assignment(cost_N: np.ndarray, origin_N: np.ndarray, R: int, G: int) -> np.ndarray:
    """Every rank computes its own packs, heaviest first (ties by index): no move."""
    own_RG = _argsort_by_key(origin_N).reshape(R, G)  # each rank's packs, by index
    by_cost = np.argsort(-cost_N[own_RG], axis=1, kind="stable")
    return np.take_along_axis(own_RG, by_cost, axis=1)[:, :, None]


def _caps_toward_local(
    cost_N: np.ndarray, origin_N: np.ndarray, heads_G: np.ndarray, R: int, G: int, tolerance: float
) -> np.ndarray:
    """The run heads moved toward the local sort's micro-step maxima, within the budget."""
    local_RG = -np.sort(-cost_N[_argsort_by_key(origin_N)].reshape(R, G), axis=1)
    local_G = local_RG.max(axis=0)
    heads = [int(h) for h in heads_G]  # python ints: (local - head) * extra may not fit in int64
    local = [int(v) for v in local_G]
    total = sum(heads)
    extra = _budget(total, tolerance) - total
    span = sum(local) - total
    if span <= extra:
        return local_G
    caps = [h + (v - h) * extra // span for h, v in zip(heads, local)]
    return np.minimum.accumulate(np.array(caps, dtype=np.int64))


def _keep_decisions(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    order_N: np.ndarray,
    cap_G: np.ndarray,
    R: int,
    G: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Which own pack each rank keeps at each micro-step under the caps (module docstring).

    Returns ``(keep_RG, deadline_N)``: ``keep_RG[r, m]`` is the deadline of the own pack rank
    ``r`` keeps at micro-step ``m`` (``-1``: the slot takes a moved pack), and each pack's
    deadline.
    """
    N = len(cost_N)
    # deadline[i] = last micro-step whose cap is >= cost[i]; caps are non-increasing, so the
    # deadlines are non-decreasing along order_N (heaviest first)
    above = np.searchsorted(-cost_N[order_N], -cap_G[1:], side="left")  # packs above each cap
    deadline_N = np.empty(N, dtype=np.int64)
    deadline_N[order_N] = np.repeat(np.arange(G), np.diff(np.concatenate([[0], above, [N]])))
    # slack[j]: spare slots of the prefix 0..j (a python list: G is small, numpy is slower)
    slack = (np.arange(1, G + 1) * R - np.cumsum(np.bincount(deadline_N, minlength=G))).tolist()

    # own packs per (rank, deadline) not yet kept
    pending_RG = np.bincount(origin_N * G + deadline_N, minlength=R * G).reshape(R, G)
    keep_deadline_RG = np.full((R, G), -1, dtype=np.int64)  # deadline of the pack kept at (r, m)
    next_R = np.full(R, G, dtype=np.int64)  # earliest later deadline still pending (G: none)
    for m in range(G - 1, -1, -1):
        due = pending_RG[:, m] > 0
        keep_deadline_RG[due, m] = m
        pending_RG[due, m] -= 1
        # ranks with nothing due here may keep a pending own pack due later (earliest deadline
        # first: it crosses the fewest boundaries), if every boundary m..d-1 has slack
        if slack[m] > 0:
            want_ranks = np.flatnonzero(~due & (next_R < G))  # ascending: ties to lower ranks
            want_deadline = next_R[want_ranks]
            room = slack[m]
            for d in range(m + 1, G):
                room = min(room, slack[d - 1])
                if room == 0:
                    break
                chosen = want_ranks[want_deadline == d][:room]
                if not len(chosen):
                    continue
                keep_deadline_RG[chosen, m] = d
                pending_RG[chosen, d] -= 1
                for j in range(m, d):
                    slack[j] -= len(chosen)
                room -= len(chosen)
                emptied = chosen[pending_RG[chosen, d] == 0]
                if len(emptied) and d + 1 == G:
                    next_R[emptied] = G
                elif len(emptied):
                    rest_ED = pending_RG[emptied, d + 1 :] > 0
                    next_R[emptied] = np.where(
                        rest_ED.any(axis=1), d + 1 + np.argmax(rest_ED, axis=1), G
                    )
        next_R[pending_RG[:, m] > 0] = m  # leftovers due here are pending for earlier steps

    return keep_deadline_RG, deadline_N


def _materialise(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    order_N: np.ndarray,
    keep_deadline_RG: np.ndarray,
    deadline_N: np.ndarray,
    R: int,
    G: int,
    balance_ranks: bool,
) -> np.ndarray:
    """The assignment from the keep decisions: which own pack each keep is (lowest index
    first within a (rank, deadline) group), and the moved packs in the free slots."""
    N = len(cost_N)
    assignment_RG = np.full((R, G), -1, dtype=np.int64)
    key_N = origin_N * G + deadline_N
    pack_by_key = _argsort_by_key(key_N)  # packs grouped by (rank, deadline), by index
    key_sorted = key_N[pack_by_key]
    kept_r, kept_m = np.nonzero(keep_deadline_RG >= 0)
    kept_key = kept_r * G + keep_deadline_RG[kept_r, kept_m]
    # rank of each keep within its (rank, deadline) group
    by_key = _argsort_by_key(kept_key * G + kept_m)
    kept_r, kept_m, kept_key = kept_r[by_key], kept_m[by_key], kept_key[by_key]
    first = np.searchsorted(kept_key, kept_key, side="left")
    nth = np.arange(len(kept_key)) - first
    group_start = np.searchsorted(key_sorted, kept_key, side="left")
    kept_pack = pack_by_key[group_start + nth]
    assignment_RG[kept_r, kept_m] = kept_pack

    # Moved packs fill the free slots, earliest deadline first (feasible by the slack check).
    is_kept = np.zeros(N, dtype=bool)
    is_kept[kept_pack] = True
    # earliest deadline first = heaviest first (deadlines grow along order_N), ties by index
    _fill_free_slots(assignment_RG, cost_N, order_N[~is_kept[order_N]], G, balance_ranks)
    return assignment_RG[:, :, None]


def _raise_caps(heads_G: np.ndarray, tolerance: float) -> np.ndarray:
    """Micro-step caps: the run heads, with ``tolerance * sum(heads)`` spread over steps 1.. .

    Raising micro-step 0's cap frees nothing (no pack is heavier); the others rise in proportion
    to their heads, never above the heaviest pack, so the caps stay non-increasing.
    """
    heads = [int(h) for h in heads_G]  # python ints: extra * head may not fit in int64
    total = sum(heads)
    extra = _budget(total, tolerance) - total
    rest = total - heads[0]
    if extra <= 0 or rest <= 0:
        return heads_G.astype(np.int64)
    caps = [heads[0]] + [min(h + extra * h // rest, heads[0]) for h in heads[1:]]
    return np.array(caps, dtype=np.int64)


def _fill_free_slots(
    assignment_RG: np.ndarray, cost_N: np.ndarray, movers: np.ndarray, G: int, balance_ranks: bool
) -> None:
    """Puts the moved packs (earliest deadline first) into the free slots, micro-step by
    micro-step; with ``balance_ranks`` each micro-step's heaviest pack goes to its least loaded
    free rank, else in rank order."""
    free_m, free_r = np.nonzero((assignment_RG < 0).T)  # free slots by micro-step, then rank
    if balance_ranks:
        _fill_balanced(assignment_RG, cost_N, movers, free_r, free_m, G)
    else:
        assignment_RG[free_r, free_m] = movers


def _fill_balanced(
    assignment_RG: np.ndarray,
    cost_N: np.ndarray,
    free_packs: np.ndarray,
    free_r: np.ndarray,
    free_m: np.ndarray,
    G: int,
) -> None:
    """Fills the free slots micro-step by micro-step, the heaviest pack to the lightest rank."""
    load_R = np.where(assignment_RG >= 0, cost_N[np.maximum(assignment_RG, 0)], 0).sum(axis=1)
    bounds = np.searchsorted(free_m, np.arange(G + 1))
    for m in range(G):
        lo, hi = bounds[m], bounds[m + 1]
        if lo == hi:
            continue
        packs = free_packs[lo:hi]
        packs = packs[_sorted_order(cost_N[packs])]
        ranks = free_r[lo:hi]
        ranks = ranks[np.lexsort((ranks, load_R[ranks]))]
        assignment_RG[ranks, m] = packs
        load_R[ranks] += cost_N[packs]


# ---------------------------------------------------------------------------------------------
# "microstep" with several packs per micro-batch (heuristic)


def _phase1_microstep_multi(cost_N: np.ndarray, R: int, G: int, K: int) -> np.ndarray:
    """Sorted runs of ``R*K`` packs per micro-step; inside a run, heaviest pack to lightest rank."""
    order_N = _sorted_order(cost_N)
    out = np.empty((R, G, K), dtype=np.int64)
    for m in range(G):
        run = order_N[m * R * K : (m + 1) * R * K]
        load_R = np.zeros(R, dtype=np.int64)
        count_R = np.zeros(R, dtype=np.int64)
        for k in range(K):
            packs = run[k * R : (k + 1) * R]
            ranks = np.lexsort((np.arange(R), load_R))
            out[ranks, m, count_R[ranks]] = packs
            load_R[ranks] += cost_N[packs]
            count_R[ranks] += 1
    return out


def _phase2_microstep_multi(origin_N: np.ndarray, opt_RGK: np.ndarray) -> np.ndarray:
    """Per micro-step: relabel phase 1's micro-batches to the ranks holding most of their packs.

    Inside a micro-step the ``R`` micro-batches of phase 1 may go to any ranks; each goes to the
    rank that holds most of its packs (greedy matching, heaviest overlaps first), which keeps the
    objective value and moves only packs whose micro-batch went elsewhere.
    """
    R, G, _ = opt_RGK.shape
    out = np.empty_like(opt_RGK)
    for m in range(G):
        batches_RK = opt_RGK[:, m, :]
        out[_match_groups(batches_RK, origin_N, np.arange(R)), m, :] = batches_RK
    return out


def _match_groups(groups_SX: np.ndarray, origin_N: np.ndarray, ranks_S: np.ndarray) -> np.ndarray:
    """Gives each of ``S`` pack groups one of the ranks ``ranks_S``: the rank holding most of its
    packs where possible (a greedy matching, largest overlaps first, ties by group then rank);
    groups left over take the remaining ranks in order. Returns the rank of each group.
    """
    S = len(ranks_S)
    local_of = np.full(int(max(ranks_S.max(), origin_N.max())) + 1, -1, dtype=np.int64)
    local_of[ranks_S] = np.arange(S)
    group = np.repeat(np.arange(S), groups_SX.shape[1])
    holder = local_of[origin_N[groups_SX.reshape(-1)]]
    inside = holder >= 0
    pairs, counts = np.unique(group[inside] * S + holder[inside], return_counts=True)
    pairs = pairs[_argsort_by_key(-counts)]  # most shared packs first, ties by (group, rank)
    g_of, h_of = pairs // S, pairs % S
    rank_of = np.full(S, -1, dtype=np.int64)
    taken = np.zeros(S, dtype=bool)
    alive = np.ones(len(pairs), dtype=bool)
    while alive.any():
        # every group's best remaining pair; of those, every rank's best: all are accepted
        idx = np.flatnonzero(alive)
        cand = np.sort(idx[np.unique(g_of[idx], return_index=True)[1]])
        win = cand[np.unique(h_of[cand], return_index=True)[1]]
        rank_of[g_of[win]] = h_of[win]
        taken[h_of[win]] = True
        alive &= (rank_of[g_of] < 0) & ~taken[h_of]
    rank_of[rank_of < 0] = np.flatnonzero(~taken)
    return ranks_S[rank_of]


# ---------------------------------------------------------------------------------------------
# "step": per-rank totals


def _step_lower_bound(cost_N: np.ndarray, R: int, G: int, K: int) -> float:
    """``max(total / R, heaviest pack + the G*K-1 lightest)``: the rank with the heaviest pack."""
    n = G * K
    light = np.sort(cost_N)[: n - 1].sum() if n > 1 else 0
    return float(max(cost_N.sum() / R, int(cost_N.max()) + int(light)))


def _phase1_step(cost_N: np.ndarray, R: int, G: int, K: int) -> np.ndarray:
    """Balanced largest differencing over all packs."""
    return _bldm(cost_N, np.arange(len(cost_N)), R)[0].reshape(R, G, K)


def _bldm(cost_N: np.ndarray, packs_P: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits ``packs_P`` into ``R`` equal-count sets of near-equal cost: ``(sets (R, X), sums)``.

    Balanced largest differencing (BLDM): each run of ``R`` packs by cost is a partial
    solution of ``R`` one-pack sets; repeatedly the two partial solutions with the largest
    spread (max - min set sum) merge by joining the heaviest sets of one to the lightest of the
    other, so their spreads cancel (the differencing method of Karmarkar and Karp, 1982, in
    its balanced form: Yakir, 1996, for two sets; Michiels, Korst, Aarts and van Leeuwen,
    2003, for k sets).
    """
    order_P = packs_P[_sorted_order(cost_N[packs_P])]
    parts: list[tuple[np.ndarray, np.ndarray]] = []  # (set sums (R,), members (R, x))
    for j in range(len(packs_P) // R):
        run = order_P[j * R : (j + 1) * R]
        parts.append((cost_N[run], run[:, None]))
    spreads = [int(p[0].max() - p[0].min()) for p in parts]
    while len(parts) > 1:
        # the two largest spreads, ties by position (deterministic)
        first, second = sorted(range(len(spreads)), key=lambda i: (-spreads[i], i))[:2]
        (sa, ma), (sb, mb) = parts[first], parts[second]
        ia = _argsort_by_key(sa)  # lightest first
        ib = _argsort_by_key(-sb)  # heaviest first
        merged = (sa[ia] + sb[ib], np.concatenate([ma[ia], mb[ib]], axis=1))
        keep = [i for i in range(len(parts)) if i not in (first, second)]
        parts = [parts[i] for i in keep] + [merged]
        spreads = [spreads[i] for i in keep] + [int(merged[0].max() - merged[0].min())]
    load_R, held_RX = parts[0]
    return np.ascontiguousarray(held_RX), load_R.copy()


def _cover_swaps(
    held_RX: np.ndarray,
    load_R: np.ndarray,
    cost_N: np.ndarray,
    target: int,
    max_rounds: int = _SWAP_ROUNDS,
) -> bool:
    """Swaps that bring overloaded ranks under ``target``, in place; True when all are.

    Per round, every overloaded rank first tries one swap that covers its whole excess
    (:func:`_covering_swaps`); the ranks left uncovered then make partial swaps with the light
    ranks no covering swap used (:func:`_partial_swaps`). Rounds stop when every rank fits, when
    no rank has room, or when a round makes less than 1% progress.
    """
    R, X = held_RX.shape
    ascending_N = _argsort_by_key(cost_N)  # lightest first, ties by index
    holder_N = np.empty(len(cost_N), dtype=np.int64)
    holder_N[held_RX.reshape(-1)] = np.repeat(np.arange(R), X)
    last_excess = None
    for _ in range(max_rounds):
        over = np.flatnonzero(load_R > target)
        if not len(over):
            return True
        excess_sum = int((load_R[over] - target).sum())
        if last_excess is not None and excess_sum > last_excess - last_excess // 100:
            return False  # less than 1% progress in a round: leave the rest to the re-solve
        last_excess = excess_sum
        over = over[_argsort_by_key(target - load_R[over])]  # largest excess first
        has_room = load_R < target
        if not has_room.any():
            return False
        (heavy, light, x, y), rest = _covering_swaps(
            held_RX, load_R, cost_N, target, over, has_room, ascending_N, holder_N
        )
        # a light rank swaps once per round: the partial swaps get the ones not yet used
        used = np.zeros(R, dtype=bool)
        used[light] = True
        pool_ranks = np.flatnonzero(has_room)
        free = pool_ranks[~used[pool_ranks]]
        partial = _partial_swaps(held_RX, load_R, cost_N, target, rest, free)
        swaps = [(heavy, light, x, y), *partial]
        heavy, light, x, y = (np.concatenate(parts) for parts in zip(*swaps))
        if not len(heavy):
            return False
        _apply_swaps(held_RX, load_R, holder_N, cost_N, heavy, light, x, y)
    return bool(int(load_R.max()) <= target)


def _covering_swaps(
    held_RX: np.ndarray,
    load_R: np.ndarray,
    cost_N: np.ndarray,
    target: int,
    over: np.ndarray,
    has_room: np.ndarray,
    ascending_N: np.ndarray,
    holder_N: np.ndarray,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """One swap per overloaded rank that covers its excess: ``((heavy, light, x, y), rest)``.

    Each rank ``a`` of ``over`` (largest excess first, excess ``e``) looks, for each pack ``x``
    it holds, at the packs ``y`` held by ranks with room whose cost is at most ``c_x - e`` (the
    ``_CANDIDATES`` heaviest of them, found by binary search in the sorted pool) and keeps the
    swap with the smallest difference that the receiving rank has room for. Conflicting
    choices (one light rank chosen twice) go to the rank with the larger excess; the others
    retry in the next round. ``rest``: the ranks with no covering swap, in the order of ``over``.
    """
    big = np.iinfo(np.int64).max
    pool = ascending_N[has_room[holder_N[ascending_N]]]  # packs of ranks with room, by cost
    pool_owner = holder_N[pool]
    pool_cost = cost_N[pool]
    room = target - load_R  # (R,), > 0 on pool ranks
    cx_PX = cost_N[held_RX[over]]
    excess = (load_R[over] - target)[:, None]
    top = np.searchsorted(pool_cost, cx_PX - excess, side="right") - 1  # (P, X)
    cand_PXW = top[:, :, None] - np.arange(_CANDIDATES)[None, None, :]
    valid = cand_PXW >= 0
    cand_PXW = np.maximum(cand_PXW, 0)
    diff_PXW = cx_PX[:, :, None] - pool_cost[cand_PXW]
    valid &= diff_PXW <= room[pool_owner[cand_PXW]]
    score = np.where(valid, diff_PXW, big).reshape(len(over), -1)
    best = np.argmin(score, axis=1)
    covered = score[np.arange(len(over)), best] < big
    x, w = best // _CANDIDATES, best % _CANDIDATES
    slot = cand_PXW[np.arange(len(over)), x, w]
    # one covering swap per light rank per round, largest excess first
    heavy, x, slot = over[covered], x[covered], slot[covered]
    light = pool_owner[slot]
    first = np.sort(np.unique(light, return_index=True)[1])
    heavy, x, light = heavy[first], x[first], light[first]
    y = np.argmax(held_RX[light] == pool[slot[first]][:, None], axis=1)
    return (heavy, light, x, y), over[~covered]


def _partial_swaps(
    held_RX: np.ndarray,
    load_R: np.ndarray,
    cost_N: np.ndarray,
    target: int,
    rest: np.ndarray,
    free: np.ndarray,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Partial swaps for the ranks ``rest`` that no one swap covers: ``[(heavy, light, x, y)]``.

    The largest partial swaps with the light ranks ``free``, up to ``_PARTNERS`` of them per
    rank (each with another held pack), largest excess with most room.
    """
    X = held_RX.shape[1]
    big = np.iinfo(np.int64).max
    room = target - load_R
    free = free[_argsort_by_key(load_R[free])]  # most room first
    partners = min(_PARTNERS, len(free) // len(rest)) if len(rest) else 0
    if len(rest) and not partners:
        rest = rest[: len(free)]
        partners = 1 if len(rest) else 0
    remaining = load_R[rest] - target
    x_taken = np.zeros((len(rest), X), dtype=bool)
    cx_PX = cost_N[held_RX[rest]]
    swaps = []
    for j in range(partners):
        mate = free[j * len(rest) : (j + 1) * len(rest)]
        diff_PXX = cx_PX[:, :, None] - cost_N[held_RX[mate]][:, None, :]
        gain = np.minimum(diff_PXX, remaining[:, None, None])
        ok = (diff_PXX > 0) & (diff_PXX <= room[mate][:, None, None]) & ~x_taken[:, :, None]
        ok &= remaining[:, None, None] > 0
        part = np.where(ok, -gain, big).reshape(len(rest), -1)
        pick = np.argmin(part, axis=1)
        useful = part[np.arange(len(rest)), pick] < big
        px, py = pick // X, pick % X
        x_taken[np.flatnonzero(useful), px[useful]] = True
        remaining[useful] -= diff_PXX[useful, px[useful], py[useful]]
        swaps.append((rest[useful], mate[useful], px[useful], py[useful]))
    return swaps


def _apply_swaps(
    held_RX: np.ndarray,
    load_R: np.ndarray,
    holder_N: np.ndarray,
    cost_N: np.ndarray,
    heavy: np.ndarray,
    light: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
) -> None:
    """Swaps pack ``held_RX[heavy, x]`` with ``held_RX[light, y]``, pairwise, in place."""
    pack_h, pack_l = held_RX[heavy, x], held_RX[light, y]
    held_RX[heavy, x] = pack_l
    held_RX[light, y] = pack_h
    holder_N[pack_h], holder_N[pack_l] = light, heavy
    delta = cost_N[pack_h] - cost_N[pack_l]
    np.add.at(load_R, heavy, -delta)  # a heavy rank may swap with several partners
    load_R[light] += delta


def _phase2_step(
    cost_N: np.ndarray,
    origin_N: np.ndarray,
    baseline_RGK: np.ndarray,
    opt_RGK: np.ndarray,
    optimal: int,
    tolerance: float,
) -> np.ndarray:
    """Repairs the baseline: swaps first, then re-solves a growing neighbourhood.

    1. Swaps bring overloaded ranks under the budget, each the smallest that covers the excess
       (two packs move per swap; :func:`_cover_swaps`).
    2. Ranks still over the budget and as many of the lightest ranks pool their packs and split
       them again with BLDM; the new sets go to the ranks holding most of their packs. The
       neighbourhood doubles until the split fits under the budget; at its largest it is every
       rank, i.e. phase 1's sets relabelled, which fits by construction.

    Own packs come first in each rank's order (they need no exchange, so compute starts on
    them), each part in index order.
    """
    R, G, K = baseline_RGK.shape
    target = _budget(optimal, tolerance)
    held_RX = baseline_RGK.reshape(R, G * K).copy()
    load_R = cost_N[held_RX].sum(axis=1)
    fits = _cover_swaps(held_RX, load_R, cost_N, target)
    over = np.flatnonzero(load_R > target)
    size = 2 * len(over)
    while not fits:
        if size >= R:
            groups_RX = opt_RGK.reshape(R, G * K)
            held_RX[_match_groups(groups_RX, origin_N, np.arange(R))] = groups_RX
            break
        light = _argsort_by_key(load_R)  # lightest first
        light = light[load_R[light] <= target][: size - len(over)]
        ranks_S = np.concatenate([over, light])
        groups_SX, sums_S = _bldm(cost_N, held_RX[ranks_S].reshape(-1), len(ranks_S))
        fits = int(sums_S.max()) <= target
        if fits:
            new_rank = _match_groups(groups_SX, origin_N, ranks_S)
            held_RX[new_rank] = groups_SX
            load_R[new_rank] = sums_S
        size *= 2
    foreign_RX = origin_N[held_RX] != np.arange(R)[:, None]
    order_RX = np.lexsort((held_RX, foreign_RX), axis=1)
    held_RX = np.take_along_axis(held_RX, order_RX, axis=1)
    return held_RX.reshape(R, G, K)
