"""Which rank encodes which image: the planner of encoder balancing (numpy and numba, no torch).

At one micro-step every rank computes one pack. Its language-model cost is nearly the same
whatever the pack (a fixed number of tokens); its vision cost is not (from no image to several
large ones). Encoder balancing leaves every pack where it is and spreads only the *images* of the
micro-step over the ranks: rank ``e`` runs the vision encoder on the images assigned to it and
sends each embedding back to the rank whose pack holds the image. The data, the packs and the
loss are unchanged; only the rank that runs the encoder on an image changes.

The problem, per micro-step: ranks ``r`` with a base load ``base[r]`` (everything of the step
but the vision encoder's work on images: the language model, and the encoder's fixed per-call
cost, which every rank pays since every rank calls the encoder, with or without images: its
sharded parameters are gathered by all) and images ``n`` with a cost ``cost[n]`` (forward and
backward of the encoder on that image) and a home ``home[n]`` (the rank whose pack holds it).
Minimise the largest load, and among assignments of that load, keep images at home.

Images are indivisible and few per rank (the shared mixes have about three per rank per step,
of two or three sizes), so the textbook longest-first greedy leaves several points of waste. The
planner instead bisects on the largest load ``C`` allowed, between a lower bound and the greedy's
result, and tests each ``C`` with a packing that keeps images at home first:

1. each rank keeps its own images, largest first, while its load stays within ``C``;
2. the images no home could keep go, largest first, to the rank with the least room that still
   fits them (best fit, which keeps large holes for large images).

If that packing fails at a ``C``, plain best fit of every image, largest first, is tried at
the same ``C`` (and at every tighter one). The bound is tried first: where it packs, the search
ends there. The smallest ``C`` that packs is the plan; it is never worse than the greedy, nor
than leaving every image at home (both are candidates). When every rank has the same base
load, the plan's sets of images are then handed to the ranks so that as much image cost as
possible stays at home (a greedy matching): the loads stay, the moves drop.

``bound`` is a lower bound of the largest load over all assignments: the largest of the mean
load, the largest base load, for each ``k`` the least base load plus ``k + 1`` times the
``(k R + 1)``-th largest image (among the ``k R + 1`` largest images, some rank holds ``k + 1``),
and the least load a rank can have that reaches the mean (a base plus a sum of images: with
images of two sizes, 645 and 1,075, no rank load lies between 3,010 and 3,225, so a mean of
3,171 means a rank at 3,225 at least).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numba import njit

from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.packing.binpack import Packs

__all__ = ["ImagePlan", "PackImages", "image_bound", "order_micro_steps", "plan_images"]

_BISECTIONS = 40  # at most; stops when the interval is below _REL_GAP of the load
_REL_GAP = 1e-4


@dataclass(frozen=True)
class ImagePlan:
    """The plan of one micro-step.

    Attributes:
        encoder: ``(N,)`` the rank that encodes each image.
        home: ``(N,)`` the rank whose pack holds each image.
        load: ``(R,)`` predicted load of each rank with the plan (base + its images).
        load_home: ``(R,)`` the same with every image encoded at home.
        bound: a lower bound of ``load.max()`` over all assignments (:func:`image_bound`).
    """

    encoder: np.ndarray
    home: np.ndarray
    load: np.ndarray
    load_home: np.ndarray
    bound: float

    @property
    def moved_images(self) -> int:
        return int(np.count_nonzero(self.encoder != self.home))

    @property
    def waste(self) -> float:
        """The ranks' mean idle fraction of the step with the plan: ``1 - mean / max``."""
        return _waste(self.load.mean(), self.load.max())

    @property
    def waste_home(self) -> float:
        """The same with every image at home."""
        return _waste(self.load_home.mean(), self.load_home.max())

    @property
    def waste_bound(self) -> float:
        """The least waste any assignment could reach (the mean load over :attr:`bound`)."""
        return _waste(self.load.mean(), self.bound)


@dataclass(frozen=True)
class PackImages:
    """Every pack's images, from a length table (which has no per-image sizes): pack ``i``
    holds images ``offsets[i]:offsets[i + 1]`` of ``tokens`` / ``cost_ms``, a sample's image
    tokens split evenly over its images (the remainder to the first); ``llm_ms`` is each
    pack's language model (zero for an empty padding pack), ``per_call_ms`` the encoder's cost
    per call. What the simulator and ``benchmarks/encoder_planning.py`` plan with."""

    offsets: np.ndarray
    tokens: np.ndarray
    cost_ms: np.ndarray
    llm_ms: np.ndarray
    per_call_ms: float

    @classmethod
    def of(
        cls,
        packs: Packs,
        features: Mapping[str, np.ndarray],
        image_tokens: np.ndarray,
        images: np.ndarray,
        cost_model: CostModel,
    ) -> PackImages:
        """``packs`` over a table's ``image_tokens`` and ``images`` columns; ``features``
        their cost features (``features_from_packs``)."""
        count = images[packs.positions]  # per sample of the packs, in pack order
        whole = image_tokens[packs.positions]
        owner = np.repeat(np.arange(len(count)), count)
        nth = np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
        tokens = whole[owner] // count[owner] + (nth < whole[owner] % count[owner])
        offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)[packs.offsets]
        cost_ms, per_call = cost_model.image_cost_ms(tokens)
        llm_ms = cost_model.llm_cost_ms(features)
        llm_ms[features["total_tokens"] == 0] = 0.0
        return cls(offsets, tokens, cost_ms, llm_ms, per_call)

    @property
    def vision_ms(self) -> np.ndarray:
        """Each pack's images' encoder cost (without the per-call cost)."""
        total = np.concatenate([[0.0], np.cumsum(self.cost_ms)])
        return total[self.offsets[1:]] - total[self.offsets[:-1]]

    def of_micro_step(self, packs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The images of ``packs`` (the pack of each rank at one micro-step): their indices
        into ``tokens`` / ``cost_ms`` and each one's home rank."""
        first, last = self.offsets[packs], self.offsets[packs + 1]
        index = np.concatenate([np.arange(a, b) for a, b in zip(first, last)]).astype(np.int64)
        return index, np.repeat(np.arange(len(packs), dtype=np.int64), last - first)


def _waste(mean: float, top: float) -> float:
    return 0.0 if top <= 0 else max(0.0, 1.0 - float(mean) / float(top))


def image_bound(base: np.ndarray, cost: np.ndarray) -> float:
    """A lower bound of the largest load over every assignment of images of ``cost`` to ranks
    of ``base`` loads (see the module docstring)."""
    R = len(base)
    mean = float((base.sum() + cost.sum()) / R)
    bound = max(mean, float(base.max()))
    if len(cost):
        desc = np.sort(cost)[::-1]
        k = np.arange(0, (len(desc) - 1) // R + 1)  # the (kR+1)-th largest exists
        bound = max(bound, float(base.min() + ((k + 1) * desc[k * R]).max()))
        bound = max(bound, _level_at_least(base, cost, mean))
    return bound


_LEVEL_TYPES = 6  # distinct image costs up to which the load levels are enumerated
_LEVEL_COMBINATIONS = 200_000


def _level_at_least(base: np.ndarray, cost: np.ndarray, mean: float) -> float:
    """The most loaded rank carries at least the mean, and its load is its base plus a sum of
    some images' costs: the least such sum that reaches the mean is a lower bound. Enumerated
    when the images have few distinct costs (and ranks few distinct bases); else the mean."""
    values, counts = np.unique(cost, return_counts=True)
    bases = np.unique(base)
    if len(values) > _LEVEL_TYPES or len(bases) > _LEVEL_TYPES or values[0] <= 0:
        return mean
    best = np.inf
    for b in bases:
        need = mean - float(b)
        if need <= 0:
            best = min(best, float(b))
            continue
        # every sum of up to counts[t] images of each cost, up to the first that passes `need`
        sums = np.zeros(1)
        for v, n in zip(values, counts):
            reach = min(int(n), int(np.ceil(need / v)))
            sums = (sums[:, None] + v * np.arange(reach + 1)[None, :]).ravel()
            sums = np.unique(np.minimum(sums, need + v))  # beyond the first pass: one value
            if len(sums) > _LEVEL_COMBINATIONS:
                return mean
        above = sums[sums >= need - 1e-9]
        if len(above):
            best = min(best, float(b) + float(above.min()))
    return float(best) if np.isfinite(best) else mean


def plan_images(base: np.ndarray, cost: np.ndarray, home: np.ndarray) -> ImagePlan:
    """Plans which rank encodes each image of one micro-step (see the module docstring).

    Args:
        base: ``(R,)`` each rank's load without its images (any unit, e.g. ms; the encoder's
            per-call cost included).
        cost: ``(N,)`` each image's encoder cost (forward and backward), same unit.
        home: ``(N,)`` the rank whose pack holds each image.

    Returns:
        the :class:`ImagePlan`; every rank computing the same inputs gets the same plan.

    Raises:
        ValueError: for negative or non-finite costs, or a home outside ``[0, R)``.
    """
    base = np.ascontiguousarray(base, dtype=np.float64)
    cost = np.ascontiguousarray(cost, dtype=np.float64)
    home = np.ascontiguousarray(home, dtype=np.int64)
    R, N = len(base), len(cost)
    if R < 1:
        raise ValueError("plan_images needs at least one rank")
    if home.shape != cost.shape or cost.ndim != 1:
        raise ValueError(f"home {home.shape} and cost {cost.shape}: one entry per image")
    for name, arr in (("base", base), ("cost", cost)):
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"plan_images: `{name}` must be finite and >= 0")
    if N and (home.min() < 0 or home.max() >= R):
        raise ValueError(f"plan_images: a home rank is outside [0, {R})")
    load_home = base + np.bincount(home, weights=cost, minlength=R)
    bound = image_bound(base, cost)
    if N == 0 or R == 1 or load_home.max() <= bound:
        return ImagePlan(home.copy(), home, load_home, load_home, bound)
    order = np.argsort(-cost, kind="stable")  # largest first; ties by image index
    encoder = _plan(base, cost, home, order, bound)
    if np.all(base == base[0]):  # equal ranks: any rank may take any rank's set of images
        encoder = _keep_home(encoder, home, cost, R)
    load = base + np.bincount(encoder, weights=cost, minlength=R)
    if load.max() >= load_home.max():  # never worse than not moving
        return ImagePlan(home.copy(), home, load_home, load_home, bound)
    return ImagePlan(encoder, home, load, load_home, bound)


def order_micro_steps(vision: np.ndarray) -> np.ndarray:
    """The order in which each rank computes its packs of a global batch so that every
    micro-step carries about the same vision work, no pack changing rank.

    Under encoder balancing the ranks meet at every micro-step, which lasts as long as its most
    loaded rank; images are spread within a micro-step but cannot leave it, so a micro-step
    heavier than the others wastes time that its images cannot fill. Each rank's packs (ranks
    taken from the most uneven) go, heaviest first, to the micro-steps with the least vision
    work so far. A global batch is one optimizer step: the order of its micro-steps changes
    only the order of a gradient sum.

    Args:
        vision: ``(R, G)`` the vision cost of the pack rank ``r`` computes at micro-step ``m``.

    Returns:
        ``(R, G)`` int64: ``order[r, m]`` is the micro-step (column of ``vision``) of the pack
        rank ``r`` computes at micro-step ``m``.
    """
    vision = np.ascontiguousarray(vision, dtype=np.float64)
    if vision.shape[1] == 1:
        return np.zeros(vision.shape, dtype=np.int64)
    return _order(vision, np.argsort(-vision.std(axis=1), kind="stable"))


@njit(cache=True, nogil=True)
def _order(vision: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    R, G = vision.shape
    order = np.empty((R, G), dtype=np.int64)
    totals = np.zeros(G)
    for r in ranks:
        heaviest = np.argsort(-vision[r], kind="mergesort")
        emptiest = np.argsort(totals, kind="mergesort")
        for k in range(G):
            order[r, emptiest[k]] = heaviest[k]
            totals[emptiest[k]] += vision[r, heaviest[k]]
    return order


def _keep_home(encoder: np.ndarray, home: np.ndarray, cost: np.ndarray, R: int) -> np.ndarray:
    """The same sets of images, handed to the ranks so that the most image cost stays at home:
    a greedy matching of sets to ranks, heaviest shared cost first (the sets' loads, hence the
    plan's, are unchanged when every rank has the same base)."""
    pair, inverse = np.unique(encoder * R + home, return_inverse=True)
    shared = np.bincount(inverse, weights=cost + 1e-9)  # + ties: an image counts if its cost is 0
    taker = _match(pair // R, pair % R, shared, R)
    return taker[encoder]


@njit(cache=True, nogil=True)
def _match(sets: np.ndarray, ranks: np.ndarray, weight: np.ndarray, R: int) -> np.ndarray:
    """``taker[s]``: the rank given set ``s``; pairs by decreasing weight, then the rest in
    order."""
    taker = np.full(R, -1, dtype=np.int64)
    taken = np.zeros(R, dtype=np.bool_)
    for k in np.argsort(-weight, kind="mergesort"):
        s, r = sets[k], ranks[k]
        if taker[s] < 0 and not taken[r]:
            taker[s], taken[r] = r, True
    free = 0
    for s in range(R):
        if taker[s] < 0:
            while taken[free]:
                free += 1
            taker[s], taken[free] = free, True
    return taker


@njit(cache=True, nogil=True)
def _add(level: np.ndarray, rank: np.ndarray, j: int, c: float) -> float:
    """Adds ``c`` to the load of the rank at position ``j`` of the ascending ``level`` (with its
    ``rank``) and moves it up to keep the order; returns its new load."""
    r, new = rank[j], level[j] + c
    while j + 1 < len(level) and level[j + 1] <= new:
        level[j], rank[j] = level[j + 1], rank[j + 1]
        j += 1
    level[j], rank[j] = new, r
    return new


@njit(cache=True, nogil=True)
def _greedy(base: np.ndarray, cost: np.ndarray, home: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Longest first: each image to the least loaded rank (its home if that is as little
    loaded). The ranks are kept in an indexed binary min-heap of loads (``O(log R)`` per image:
    with equal bases a sorted list would move a rank past every equal one)."""
    R = len(base)
    load = base.copy()
    heap = np.argsort(load, kind="mergesort")  # a sorted array is a valid min-heap
    pos = np.empty(R, dtype=np.int64)
    for i in range(R):
        pos[heap[i]] = i
    encoder = np.empty(len(cost), dtype=np.int64)
    for n in order:
        r = home[n] if load[home[n]] <= load[heap[0]] else heap[0]
        encoder[n] = r
        load[r] += cost[n]
        _sift_down(heap, pos, load, pos[r])
    return encoder


@njit(cache=True, nogil=True)
def _sift_down(heap: np.ndarray, pos: np.ndarray, load: np.ndarray, i: int) -> None:
    """Restores the min-heap order of ``heap`` (ranks keyed by ``load``, ties by rank) below
    position ``i`` after the load of ``heap[i]`` grew; ``pos`` follows every rank."""
    R = len(heap)
    while True:
        child = 2 * i + 1
        if child >= R:
            return
        right = child + 1
        if right < R and _before(load, heap[right], heap[child]):
            child = right
        if not _before(load, heap[child], heap[i]):
            return
        heap[i], heap[child] = heap[child], heap[i]
        pos[heap[i]], pos[heap[child]] = i, child
        i = child


@njit(cache=True, nogil=True)
def _before(load: np.ndarray, a: int, b: int) -> bool:
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True, nogil=True)
def _fits(
    base: np.ndarray,
    cost: np.ndarray,
    home: np.ndarray,
    order: np.ndarray,
    cap: float,
    home_first: bool,
    encoder: np.ndarray,
) -> bool:
    """Packs every image within ``cap`` (home first then best fit of the rest, or best fit of
    all) into ``encoder``; says whether it packed. Best fit keeps the ranks sorted by load: the
    fullest rank an image fits is found by bisection (``O(log R)``) and moved up in place."""
    load = base.copy()
    left = np.empty(len(order), dtype=np.int64)
    k = 0
    for n in order:
        h = home[n]
        if home_first and load[h] + cost[n] <= cap:
            load[h] += cost[n]
            encoder[n] = h
        else:
            left[k] = n
            k += 1
    if k == 0:
        return True
    rank = np.argsort(load, kind="mergesort")  # ranks by load, ascending
    level = load[rank]
    for i in range(k):
        n = left[i]
        j = np.searchsorted(level, cap - cost[n], side="right") - 1  # the fullest that fits
        if j < 0:
            return False
        encoder[n] = rank[j]
        _add(level, rank, j, cost[n])
    return True


@njit(cache=True, nogil=True)
def _plan(
    base: np.ndarray, cost: np.ndarray, home: np.ndarray, order: np.ndarray, bound: float
) -> np.ndarray:
    best = _greedy(base, cost, home, order)
    load = base.copy()
    for n in range(len(cost)):
        load[best[n]] += cost[n]
    hi, lo = load.max(), bound
    trial = np.empty(len(cost), dtype=np.int64)
    home_first = _fits(base, cost, home, order, hi, True, trial)  # the greedy's load, fewer moves
    if home_first:
        best[:] = trial
    # the bound is often reached: one packing at it ends the search
    if hi > lo and (
        _fits(base, cost, home, order, lo, True, trial)
        or _fits(base, cost, home, order, lo, False, trial)
    ):
        best[:] = trial
        return best
    for _ in range(_BISECTIONS):
        if hi - lo <= _REL_GAP * hi:
            break
        mid = 0.5 * (lo + hi)
        # once keeping images home first fails, a tighter load will not bring it back
        home_first = home_first and _fits(base, cost, home, order, mid, True, trial)
        if home_first or _fits(base, cost, home, order, mid, False, trial):
            hi = mid
            best[:] = trial
        else:
            lo = mid
    return best
