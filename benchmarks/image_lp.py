"""A tighter lower bound of the image planner's largest load, for reports (numpy only).

:func:`~lightning_vlmbalance.balance.images.image_bound` counts the mean, the largest images
and the load levels a rank can reach; it is cheap enough to start every plan's search. Where the
images have few distinct costs and there are several per rank, it can be loose: on chartqa at
512 ranks (costs of 1,075, 645 and 215 ms), a rank with three large images has no room left
for a middle one, so the middle ones force ranks with fewer large images, and the large ones no
longer fit in the ranks left. :func:`lp_bound` proves such limits: for a capacity ``cap`` per
rank, the linear relaxation of the configuration program (Gilmore-Gomory: a *configuration* is
a multiset of image costs that fits in ``cap``; cover every image with at most ``R``
configurations) needs more than ``R`` ranks when ``cap`` is infeasible for every assignment.
Solved in its dual, a ``K``-variable LP (one weight per distinct cost: the most image weight a
rank can hold is 1), by the simplex method, over the maximal configurations only. The smallest
capacity the relaxation admits, rounded up to a load a rank can actually reach, is a lower
bound of the largest load over every assignment.

Used by `benchmarks/encoder_planning.py` and the tests (it is not part of the package: nothing at
run time needs it).

Only for equal base loads (every rank pays the same per-call cost: encoder balancing's case).
With more than ``max_classes`` distinct costs, the costs are rounded *down* to that many classes
(a relaxation, so the bound stays valid, if weaker).
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["lp_bound", "lp_min_ranks"]

_EPS = 1e-9


def _configurations(sizes: np.ndarray, counts: np.ndarray, cap: float) -> np.ndarray:
    """Every maximal multiset (``(M, K)`` counts per class) of ``sizes`` that fits in ``cap``
    (no class could take one more item, within its count)."""
    limits = [min(int(n), int((cap + _EPS) // s)) for s, n in zip(sizes, counts)]
    out = []
    for head in itertools.product(*(range(m + 1) for m in limits[:-1])):
        used = float(np.dot(head, sizes[:-1])) if head else 0.0
        if used > cap + _EPS:
            continue
        last = min(limits[-1], int((cap - used + _EPS) // sizes[-1]))
        config = np.array([*head, last], dtype=np.int64)
        room = cap - float(np.dot(config, sizes))
        if not np.any((config < counts) & (sizes <= room + _EPS)):
            out.append(config)
    return np.array(out, dtype=np.int64).reshape(-1, len(sizes))


def lp_min_ranks(sizes: np.ndarray, counts: np.ndarray, cap: float) -> float:
    """The linear relaxation's least number of ranks (bins of capacity ``cap``) that cover
    ``counts[i]`` images of cost ``sizes[i]``: ``inf`` when one image does not fit."""
    sizes = np.asarray(sizes, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if len(sizes) == 0 or counts.sum() == 0:
        return 0.0
    if sizes.max() > cap + _EPS:
        return float("inf")
    configs = _configurations(sizes, counts.astype(np.int64), cap).astype(np.float64)
    # dual: maximise counts . w  subject to  configs @ w <= 1, w >= 0  (tableau, Bland's rule)
    M, K = configs.shape
    table = np.zeros((M + 1, K + M + 1))
    table[:M, :K] = configs
    table[:M, K : K + M] = np.eye(M)
    table[:M, -1] = 1.0
    table[M, :K] = -counts
    basis = list(range(K, K + M))
    for _ in range(50 * (K + M)):
        negative = np.nonzero(table[M, :-1] < -_EPS)[0]
        if not len(negative):
            break
        j = int(negative[0])
        column = table[:M, j]
        rows = np.nonzero(column > _EPS)[0]
        ratios = table[rows, -1] / column[rows]
        best = ratios.min()
        ties = rows[ratios <= best + _EPS]
        r = int(min(ties, key=lambda t: basis[t]))
        table[r] /= table[r, j]
        others = np.arange(M + 1) != r
        table[others] -= np.outer(table[others, j], table[r])
        basis[r] = j
    return float(table[M, -1])


def lp_bound(
    base: float,
    cost: np.ndarray,
    ranks: int,
    *,
    upper: float,
    lower: float = 0.0,
    max_classes: int = 6,
) -> float:
    """A lower bound of the largest load when images of ``cost`` go to ``ranks`` ranks that
    each carry ``base`` besides their images (see the module docstring).

    Args:
        upper: a load known to be reachable (a plan's largest load): the search stays below it.
        lower: a bound known already (e.g. ``image_bound``): the result is never below it.
    """  # fmt: skip
    cost = np.sort(np.asarray(cost, dtype=np.float64))[::-1]
    if not len(cost) or upper <= lower:
        return max(lower, float(base) + (float(cost[0]) if len(cost) else 0.0))
    sizes, counts = np.unique(cost, return_counts=True)
    if len(sizes) > max_classes:  # round down to quantiles of the costs: a relaxation
        edges = np.quantile(cost, np.linspace(0.0, 1.0, max_classes + 1)[:-1])
        classes = np.unique(edges)
        which = np.searchsorted(classes, cost, side="right") - 1
        sizes, counts = classes, np.bincount(which, minlength=len(classes))
        keep = (counts > 0) & (sizes > 0)
        sizes, counts = sizes[keep], counts[keep]
    sizes, counts = sizes[::-1].copy(), counts[::-1].copy()  # largest first
    # the loads a rank can reach below ``upper``: sums of the maximal configurations' subsets
    levels = _levels(sizes, counts, upper - base)
    levels = levels[levels + base > lower - _EPS]
    if not len(levels):
        return lower
    lo, hi = 0, len(levels) - 1  # the smallest feasible level, by bisection (monotone)
    if lp_min_ranks(sizes, counts, float(levels[hi])) > ranks * (1 + 1e-7):
        return max(lower, float(base + levels[hi]))
    while lo < hi:
        mid = (lo + hi) // 2
        if lp_min_ranks(sizes, counts, float(levels[mid])) <= ranks * (1 + 1e-7):
            hi = mid
        else:
            lo = mid + 1
    return max(lower, float(base + levels[lo]))


def _levels(sizes: np.ndarray, counts: np.ndarray, cap: float) -> np.ndarray:
    """Every sum of images (within the counts) up to ``cap``, ascending."""
    sums = np.zeros(1)
    for s, n in zip(sizes, counts):
        reach = min(int(n), int((cap + _EPS) // s))
        sums = (sums[:, None] + s * np.arange(reach + 1)[None, :]).ravel()
        sums = np.unique(np.round(sums[sums <= cap + _EPS], 9))
    return sums
