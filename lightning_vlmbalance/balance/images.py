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

If that packing fails at a ``C``, plain best fit of every image, largest first (homes only
breaking ties), is tried at the same ``C``. The smallest ``C`` that packs is the plan; it is
never worse than the greedy, nor than leaving every image at home (both are candidates).

``bound`` is a lower bound of the largest load over all assignments: the largest of the mean
load, the largest base load, and for each ``k`` the least base load plus ``k + 1`` times the
``(k R + 1)``-th largest image (among the ``k R + 1`` largest images, some rank holds ``k + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["ImagePlan", "image_bound", "plan_images"]

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


def _waste(mean: float, top: float) -> float:
    return 0.0 if top <= 0 else max(0.0, 1.0 - float(mean) / float(top))


def image_bound(base: np.ndarray, cost: np.ndarray) -> float:
    """A lower bound of the largest load over every assignment of images of ``cost`` to ranks
    of ``base`` loads (see the module docstring)."""
    R = len(base)
    bound = max(float((base.sum() + cost.sum()) / R), float(base.max()))
    if len(cost):
        desc = np.sort(cost)[::-1]
        k = np.arange(0, (len(desc) - 1) // R + 1)  # the (kR+1)-th largest exists
        bound = max(bound, float(base.min() + ((k + 1) * desc[k * R]).max()))
    return bound


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
    load = base + np.bincount(encoder, weights=cost, minlength=R)
    if load.max() >= load_home.max():  # never worse than not moving
        return ImagePlan(home.copy(), home, load_home, load_home, bound)
    return ImagePlan(encoder, home, load, load_home, bound)


@njit(cache=True, nogil=True)
def _greedy(base: np.ndarray, cost: np.ndarray, home: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Longest first: each image to the least loaded rank (its home on a tie)."""
    load = base.copy()
    encoder = np.empty(len(cost), dtype=np.int64)
    for n in order:
        best = home[n]
        for r in range(len(load)):
            if load[r] < load[best]:
                best = r
        encoder[n] = best
        load[best] += cost[n]
    return encoder


@njit(cache=True, nogil=True)
def _best_fit(load: np.ndarray, c: float, cap: float, prefer: int) -> int:
    """The fullest rank that still fits ``c`` within ``cap`` (``prefer`` on a tie); -1: none."""
    best, best_load = -1, -1.0
    if load[prefer] + c <= cap:
        best, best_load = prefer, load[prefer]
    for r in range(len(load)):
        if load[r] + c <= cap and load[r] > best_load:
            best, best_load = r, load[r]
    return best


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
    all) into ``encoder``; says whether it packed."""
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
    for i in range(k):
        n = left[i]
        r = _best_fit(load, cost[n], cap, home[n])
        if r < 0:
            return False
        load[r] += cost[n]
        encoder[n] = r
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
    if _fits(base, cost, home, order, hi, True, trial):  # the greedy's load, fewer moves
        best[:] = trial
    for _ in range(_BISECTIONS):
        if hi - lo <= _REL_GAP * hi:
            break
        mid = 0.5 * (lo + hi)
        if _fits(base, cost, home, order, mid, True, trial) or _fits(
            base, cost, home, order, mid, False, trial
        ):
            hi = mid
            best[:] = trial
        else:
            lo = mid
    return best
