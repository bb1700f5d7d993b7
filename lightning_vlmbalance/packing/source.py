"""Balance at the source: global batches whose packs come out of even cost, formed by the sampler.

Every rank computes the whole epoch plan from the length table, so it knows every pack of every
rank at every step, and the pack cost features come from the same table. For a map-style dataset
the sampler can therefore form each global batch (``world_size x micro_steps`` packs) so that its
packs cost the same, and place them on ranks and micro-steps for the objective: no feature
all-gather, no exchange, no thread.

One global batch is formed from the front of the epoch's shuffled sample stream:

1. **window**: samples from the stream until their tokens reach ``P x seq_len x (1 + slack)``
   (``P`` packs; samples left over from the previous batch first);
2. **balance**: the samples with images and the long text samples, by decreasing cost, each into
   the pack of least cost that has room (longest-processing-time first, with capacity);
3. **fill**: the short text samples, longest first, each into the fullest pack it fits (best fit),
   then samples from the next ``lookahead`` of the stream that fit a remaining gap;
4. what did not fit waits for the next global batch (first in its window);
5. **place**: the packs' costs go to the rebalancing planner (``plan_rebalance``) with the
   objective, which puts them on ranks and micro-steps.

Every sample is in exactly one pack per epoch; the epoch's last global batch takes what is left
(padding packs, counted, where it has fewer than ``P``). The plan depends only on the integers of
the length table and the settings: every rank computes the same plan.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_vlmbalance.balance.cost import CostModel, features_from_packs
from lightning_vlmbalance.balance.planner import plan_rebalance
from lightning_vlmbalance.packing.binpack import Packs
from lightning_vlmbalance.packing.plan import (
    PADDING,
    EpochPlan,
    PackingConfig,
    apply_overlong_policy,
    as_length_column,
    build_epoch_plan,
    check_length_table,
)

__all__ = [
    "SourceBalance",
    "build_balanced_epoch_plan",
    "form_balanced_batches",
    "sample_costs",
]


@dataclass(frozen=True)
class SourceBalance:
    """Settings of balancing at the source.

    Attributes:
        micro_steps: packs per rank per global batch (``accumulate_grad_batches``).
        objective: ``"step"`` or ``"microstep"`` (as the rebalancing planner's).
        slack: extra tokens read into a global batch's window, as a fraction of its capacity.
        small_tokens: text samples up to this many tokens fill gaps (phase 3) instead of being
            balanced (phase 2).
        lookahead: samples further in the stream that may fill a gap of this global batch.
        fill_with_images: let samples with images from the lookahead fill gaps too (fuller
            packs, less even costs).
        exact: keep every global batch's samples of the unbalanced plan (the parameters then
            equal the unbalanced run's) and only re-form its packs; where the samples do not
            fit into as many packs, the batch keeps its packs and the planner only places them
            (counted in the plan's ``fallback_batches``).
    """

    micro_steps: int = 1
    objective: str = "step"
    slack: float = 0.02
    small_tokens: int = 2048
    lookahead: int = 4096
    fill_with_images: bool = False
    exact: bool = False

    def __post_init__(self) -> None:
        if self.micro_steps < 1:
            raise ValueError(f"`SourceBalance(micro_steps={self.micro_steps!r})` must be >= 1")
        if self.objective not in ("step", "microstep"):
            raise ValueError(
                f"`SourceBalance(objective={self.objective!r})`: expected 'step' or 'microstep'"
            )
        if self.slack < 0 or self.small_tokens < 0 or self.lookahead < 0:
            raise ValueError("SourceBalance: slack, small_tokens and lookahead must be >= 0")


def form_balanced_batches(
    order: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    *,
    packs_per_batch: int,
    seq_len: int,
    pack_fixed_image_cost: float,
    settings: SourceBalance,
) -> list[list[list[int]]]:
    """The epoch's global batches, each a list of ``packs_per_batch`` packs (sample id lists).

    Args:
        order: the epoch's samples in stream order (shuffled, over-long ones removed).
        tokens, image_tokens: per sample id.
        cost: per sample id, the sample's additive cost (a pack's cost is the sum of its samples'
            plus ``pack_fixed_image_cost`` once if any of them has an image).
        packs_per_batch: ``P = world_size x micro_steps``.
        seq_len: tokens per pack.
        settings: the algorithm's settings.

    Returns:
        The global batches in order; the last may have fewer than ``P`` packs.
    """
    P, T = packs_per_batch, seq_len
    stream = [int(s) for s in order]
    pos = 0  # next unread position in the stream
    waiting: list[int] = []  # samples that did not fit the previous batch
    taken = np.zeros(len(tokens), dtype=bool)  # pulled forward by a fill from the lookahead
    batches: list[list[list[int]]] = []
    while pos < len(stream) or waiting:
        window, pos = _window(stream, pos, waiting, taken, tokens, P * T * (1 + settings.slack))
        remaining = sum(int(tokens[s]) for s in window) + sum(
            int(tokens[s]) for s in stream[pos:] if not taken[s]
        )
        if remaining <= P * T:  # the epoch's last global batch: everything that is left
            window += [s for s in stream[pos:] if not taken[s]]
            pos = len(stream)
        packs, left = _balance(
            window, tokens, image_tokens, cost, P, T, pack_fixed_image_cost, settings
        )
        if pos < len(stream):
            _fill_from_lookahead(
                packs,
                stream,
                pos,
                taken,
                tokens,
                image_tokens,
                T,
                settings.lookahead,
                cost=cost,
                fill_images=settings.fill_with_images,
            )
        if pos >= len(stream) and left:
            # the last batch: whatever did not fit gets packs of its own (greedy, first fit)
            packs += _first_fit(left, tokens, T)
            left = []
        waiting = left
        packs = [p for p in packs if p]
        # the last batch may need more than P packs for what was left: more global batches
        batches += [packs[i : i + P] for i in range(0, len(packs), P)]
    return batches


def _window(
    stream: list[int],
    pos: int,
    waiting: list[int],
    taken: np.ndarray,
    tokens: np.ndarray,
    budget: float,
) -> tuple[list[int], int]:
    window = list(waiting)
    total = sum(int(tokens[s]) for s in window)
    while pos < len(stream) and total < budget:
        s = stream[pos]
        pos += 1
        if taken[s]:
            continue
        window.append(s)
        total += int(tokens[s])
    return window, pos


def _balance(
    window: Sequence[int],
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    P: int,
    T: int,
    fixed: float,
    settings: SourceBalance,
) -> tuple[list[list[int]], list[int]]:
    ids = np.asarray(window, dtype=np.int64)
    small_mask = (image_tokens[ids] == 0) & (tokens[ids] <= settings.small_tokens)
    big = ids[~small_mask]
    small = ids[small_mask]
    big = big[np.argsort(-cost[big], kind="stable")]
    room = [T] * P
    load = [0.0] * P
    has_image = [False] * P
    packs: list[list[int]] = [[] for _ in range(P)]
    left: list[int] = []
    heap = [(0.0, p) for p in range(P)]
    for s in big.tolist():
        n = int(tokens[s])
        popped = []
        chosen = -1
        while heap:
            item = heapq.heappop(heap)
            if room[item[1]] >= n:
                chosen = item[1]
                break
            popped.append(item)
        for item in popped:
            heapq.heappush(heap, item)
        if chosen < 0:
            left.append(s)
            continue
        packs[chosen].append(s)
        room[chosen] -= n
        load[chosen] += float(cost[s])
        if image_tokens[s] > 0 and not has_image[chosen]:
            has_image[chosen] = True
            load[chosen] += fixed
        if room[chosen] > 0:
            heapq.heappush(heap, (load[chosen], chosen))
    small = small[np.argsort(-tokens[small], kind="stable")]
    left += _best_fit(packs, room, small.tolist(), tokens)
    return packs, left


def _best_fit(
    packs: list[list[int]], room: list[int], samples: list[int], tokens: np.ndarray
) -> list[int]:
    """Each sample (given longest first) into the fullest pack it fits; returns the misfits."""
    gaps = sorted((room[p], p) for p in range(len(packs)) if room[p] > 0)
    keys = [g for g, _ in gaps]
    left = []
    for s in samples:
        n = int(tokens[s])
        i = bisect.bisect_left(keys, n)
        if i == len(keys):
            left.append(s)
            continue
        gap, p = gaps.pop(i)
        keys.pop(i)
        packs[p].append(s)
        gap -= n
        room[p] = gap
        if gap > 0:
            j = bisect.bisect_left(keys, gap)
            keys.insert(j, gap)
            gaps.insert(j, (gap, p))
    return left


def _fill_from_lookahead(
    packs: list[list[int]],
    stream: list[int],
    pos: int,
    taken: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    T: int,
    lookahead: int,
    *,
    cost: np.ndarray,
    fill_images: bool,
) -> None:
    """Gaps left in the packs take the best-fitting samples of the next ``lookahead`` of the
    stream (read earlier than their turn; they are then skipped where they stood)."""
    room = [T - sum(int(tokens[s]) for s in p) for p in packs]
    load = [sum(float(cost[s]) for s in p) for p in packs]
    if not any(room):
        return
    # text only: an image pulled into a gap would add vision cost to one pack
    ahead = [s for s in stream[pos : pos + lookahead] if not taken[s] and image_tokens[s] == 0]
    ahead = [s for s in ahead if tokens[s] <= max(room)]
    if not ahead:
        return
    ahead.sort(key=lambda s: -int(tokens[s]))
    misfits = set(_best_fit(packs, room, ahead, tokens))
    for s in ahead:
        if s not in misfits:
            taken[s] = True
    if fill_images and any(r > 0 for r in room):
        # then samples with images, each into the least loaded pack it fits
        cand = [s for s in stream[pos : pos + lookahead] if not taken[s] and image_tokens[s] > 0]
        cand.sort(key=lambda s: -int(tokens[s]))
        for s in cand:
            n = int(tokens[s])
            fits = [p for p in range(len(packs)) if room[p] >= n]
            if not fits:
                continue
            p = min(fits, key=lambda p: load[p])
            packs[p].append(s)
            room[p] -= n
            load[p] += float(cost[s])
            taken[s] = True


def _first_fit(samples: list[int], tokens: np.ndarray, T: int) -> list[list[int]]:
    packs: list[list[int]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: -int(tokens[s])):
        n = int(tokens[s])
        for p, r in enumerate(room):
            if r >= n:
                packs[p].append(s)
                room[p] -= n
                break
        else:
            packs.append([s])
            room.append(T - n)
    return packs


def sample_costs(
    cost_model: CostModel, total_tokens: np.ndarray, image_tokens: np.ndarray, images: np.ndarray
) -> tuple[np.ndarray, float]:
    """Each sample's additive cost under ``cost_model`` (all phases) and the fixed cost a pack
    pays once when any of its samples has an image (the per-pack constant is left out: every
    pack pays it)."""
    coef = cost_model.coefficients
    terms: dict[str, float] = {}
    for phase in coef.values():
        for term, value in phase.items():
            terms[term] = terms.get(term, 0.0) + float(value)
    total = np.asarray(total_tokens, dtype=np.float64)
    image = np.asarray(image_tokens, dtype=np.float64)
    count = np.asarray(images, dtype=np.float64)
    image_sq = np.where(count > 0, image * image / np.maximum(count, 1), 0.0)
    cost = (
        terms.get("total_tokens", 0.0) * total
        + terms.get("doc_sq_tokens", 0.0) * total * total
        + terms.get("image_tokens", 0.0) * image
        + terms.get("images", 0.0) * count
        + terms.get("image_sq_tokens", 0.0) * image_sq
    )
    return cost, terms.get("image_pack", 0.0)


def build_balanced_epoch_plan(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    config: PackingConfig,
    *,
    world_size: int,
    epoch: int,
    balance: SourceBalance,
    cost_model: CostModel,
) -> EpochPlan:
    """The epoch plan of a source-balanced sampler (see the module docstring): rank ``r``'s
    packs in order, ``micro_steps`` per global batch, placed by the planner for the objective.

    Raises:
        ValueError: as :func:`~lightning_vlmbalance.packing.plan.build_epoch_plan`, and for
            ``remainder='drop'`` (a balanced plan pads its last global batch).
    """
    total_tokens = as_length_column(total_tokens, "total_tokens")
    image_tokens = as_length_column(image_tokens, "image_tokens")
    check_length_table(total_tokens, image_tokens)
    if config.remainder != "pad":
        raise ValueError(
            "a source-balanced PackingSampler pads its last global batch: `remainder='drop'`"
            " is not supported with `balance=`"
        )
    if config.packer != "greedy":
        raise ValueError(f"`balance=` forms its own packs: `packer={config.packer!r}` conflicts")
    lengths, skipped, truncated = apply_overlong_policy(
        total_tokens, image_tokens, config.seq_len, config.overlong
    )
    keep = np.ones(len(lengths), dtype=bool)
    keep[skipped] = False
    order = np.flatnonzero(keep)
    if config.shuffle:
        order = order[np.random.default_rng([config.seed, epoch]).permutation(len(order))]
    if len(order) == 0:
        raise ValueError("no sample is left to pack (every sample was skipped)")
    cost, fixed = sample_costs(cost_model, lengths, image_tokens, images)
    R, G = world_size, balance.micro_steps
    fallback = 0
    if balance.exact:
        batches, fallback = _exact_batches(
            total_tokens, image_tokens, lengths, cost, fixed, config, R, G, epoch, balance
        )
    else:
        batches = form_balanced_batches(
            order,
            lengths,
            image_tokens,
            cost,
            packs_per_batch=R * G,
            seq_len=config.seq_len,
            pack_fixed_image_cost=fixed,
            settings=balance,
        )
    rank_packs: list[list[np.ndarray]] = [[] for _ in range(R)]
    rank_ids: list[list[int]] = [[] for _ in range(R)]
    tokens: list[int] = []
    padding = 0
    for batch in batches:
        packs = [np.asarray(p, dtype=np.int64) for p in batch]
        padding += R * G - len(packs)
        packs += [np.zeros(0, np.int64)] * (R * G - len(packs))
        feats = features_from_packs(Packs.from_lists(packs), lengths, image_tokens, images)
        pack_cost = np.round(cost_model.pack_cost_ms(feats) * 1000).astype(np.int64)
        pack_cost[[len(p) == 0 for p in packs]] = 0
        placed = plan_rebalance(
            pack_cost,
            np.repeat(np.arange(R), G),
            R,
            G,
            objective=balance.objective,
            tolerance=0.0,
        ).assignment  # (R, G, 1)
        for r in range(R):
            for m in range(G):
                p = int(placed[r, m, 0])
                rank_packs[r].append(packs[p])
                if len(packs[p]):
                    rank_ids[r].append(len(tokens))
                    tokens.append(int(lengths[packs[p]].sum()))
                else:
                    rank_ids[r].append(PADDING)
    return EpochPlan(
        epoch=epoch,
        world_size=R,
        rank_packs=rank_packs,
        rank_pack_ids=rank_ids,
        pack_tokens=np.asarray(tokens, dtype=np.int64),
        seq_len=config.seq_len,
        padding_packs=padding,
        skipped_sample_ids=skipped,
        truncated_sample_ids=truncated,
        balanced_batches=len(batches) - fallback,
        fallback_batches=fallback,
    )


def _exact_batches(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    lengths: np.ndarray,
    cost: np.ndarray,
    fixed: float,
    config: PackingConfig,
    R: int,
    G: int,
    epoch: int,
    balance: SourceBalance,
) -> tuple[list[list[list[int]]], int]:
    """The unbalanced plan's global batches, each re-formed into as many balanced packs from its
    own samples where they fit; otherwise kept as they are. Returns the batches and how many
    were kept."""
    plain = build_epoch_plan(total_tokens, image_tokens, config, world_size=R, epoch=epoch)
    n = plain.packs_per_rank
    batches, fallback = [], 0
    for k in range(0, n, G):
        packs = [plain.rank_packs[r][j].tolist() for r in range(R) for j in range(k, min(k + G, n))]
        packs = [p for p in packs if p]
        samples = [s for p in packs for s in p]
        re_formed, left = _balance(
            samples, lengths, image_tokens, cost, len(packs), config.seq_len, fixed, balance
        )
        if left:
            fallback += 1
            batches.append(packs)
        else:
            batches.append([p for p in re_formed if p])
    return batches, fallback
