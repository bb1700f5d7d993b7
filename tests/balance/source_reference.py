"""A plain-Python former of balanced global batches: the test oracle of the compiled one
(``lightning_vlmbalance.balance._source_kernel``). Same algorithm, lists and ``heapq``; slow."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

from lightning_vlmbalance.balance.source import SourceBalance


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
                fixed=pack_fixed_image_cost,
                fill_images=settings.fill_with_images,
            )
        if pos >= len(stream) and left:
            # the last batch: whatever did not fit gets packs of its own (best fit decreasing)
            extra: list[list[int]] = [[] for _ in left]
            _best_fit(extra, [T] * len(left), sorted(left, key=lambda s: -int(tokens[s])), tokens)
            packs += extra
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
    fixed: float,
    fill_images: bool,
) -> None:
    """Gaps left in the packs take the best-fitting samples of the next ``lookahead`` of the
    stream (read earlier than their turn; they are then skipped where they stood): text first,
    then, with ``fill_images``, samples with images (whether or not a text sample fitted)."""
    room = [T - sum(int(tokens[s]) for s in p) for p in packs]
    if not any(room):
        return
    # text only: an image pulled into a gap would add vision cost to one pack
    ahead = [s for s in stream[pos : pos + lookahead] if not taken[s] and image_tokens[s] == 0]
    ahead = [s for s in ahead if tokens[s] <= max(room)]
    ahead.sort(key=lambda s: -int(tokens[s]))
    misfits = set(_best_fit(packs, room, ahead, tokens))
    for s in ahead:
        if s not in misfits:
            taken[s] = True
    if fill_images and any(r > 0 for r in room):
        # then samples with images, each into the least loaded pack it fits; a pack's load is
        # its samples' cost plus the fixed image cost once it has an image
        has_image = [any(image_tokens[s] > 0 for s in p) for p in packs]
        load = [
            sum(float(cost[s]) for s in p) + (fixed if img else 0.0)
            for p, img in zip(packs, has_image)
        ]
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
            if not has_image[p]:
                has_image[p] = True
                load[p] += fixed
            taken[s] = True
