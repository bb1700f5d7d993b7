"""The compiled core of balancing at the source (:mod:`lightning_vlmbalance.balance.source`).

One global batch of 4,096 packs holds about 26,000 samples; a Python loop over them costs about
a quarter of a second, so the former runs as machine code (numba, ``nogil``: a background thread
plans the next epoch while the current one trains). The algorithm is the one the module
docstring of ``source`` describes; the data structures are arrays:

- the pack of least cost that has room for a sample (phase 2): one skew heap of pack ids keyed
  by ``(load, id)`` per free-room value, and a tournament tree over the room values that gives
  the least loaded root in a range of rooms (``O(log T)`` per sample, whatever the packs);
- the fullest pack a sample fits (phases 3 and 4): one last-in-first-out list of packs per
  free-room value, with a count per block of 64 values to find the next non-empty list fast;
- packs are written as ``(sample, pack)`` pairs in the order they were filled, and sorted by
  pack (stable) when the global batch is done.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lightning_vlmbalance.packing.binpack import Packs

_BLOCK = 6  # free-room lists are counted per block of 2**6 values


@njit(cache=True, nogil=True)
def _before(load: np.ndarray, a: int, b: int) -> bool:
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True, nogil=True)
def _meld(a: int, b: int, left: np.ndarray, right: np.ndarray, load: np.ndarray) -> int:
    """Melds two skew heaps (roots ``a``, ``b``; -1 is empty); returns the new root."""
    if a < 0:
        return b
    if b < 0:
        return a
    if _before(load, b, a):
        a, b = b, a
    root = a
    while True:  # a's new left is the meld of its right and b; its new right its old left
        r = right[a]
        right[a] = left[a]
        if r < 0:
            left[a] = b
            break
        if _before(load, b, r):
            r, b = b, r
        left[a] = r
        a = r
    return root


@njit(cache=True, nogil=True)
def _better(load: np.ndarray, a: int, b: int) -> int:
    if a < 0:
        return b
    if b < 0:
        return a
    return a if _before(load, a, b) else b


@njit(cache=True, nogil=True)
def _tree_set(tree: np.ndarray, leaves: int, room: int, root: int, load: np.ndarray) -> None:
    i = leaves + room
    tree[i] = root
    i >>= 1
    while i >= 1:
        tree[i] = _better(load, tree[2 * i], tree[2 * i + 1])
        i >>= 1


@njit(cache=True, nogil=True)
def _tree_min(tree: np.ndarray, leaves: int, lo: int, hi: int, load: np.ndarray) -> int:
    """The least loaded heap root among free rooms ``lo..hi``, or -1."""
    best = -1
    lo += leaves
    hi += leaves + 1
    while lo < hi:
        if lo & 1:
            best = _better(load, best, tree[lo])
            lo += 1
        if hi & 1:
            hi -= 1
            best = _better(load, best, tree[hi])
        lo >>= 1
        hi >>= 1
    return best


@njit(cache=True, nogil=True)
def _gaps_push(head: np.ndarray, nxt: np.ndarray, blocks: np.ndarray, gap: int, p: int) -> None:
    nxt[p] = head[gap]
    head[gap] = p
    blocks[gap >> _BLOCK] += 1


@njit(cache=True, nogil=True)
def _gaps_find(head: np.ndarray, blocks: np.ndarray, n: int) -> int:
    """The smallest free room >= ``n`` that some pack has, or -1."""
    top = head.shape[0] - 1
    if n > top:
        return -1
    end = min(((n >> _BLOCK) + 1) << _BLOCK, top + 1)
    for r in range(n, end):
        if head[r] >= 0:
            return r
    for b in range((n >> _BLOCK) + 1, blocks.shape[0]):
        if blocks[b] > 0:
            for r in range(b << _BLOCK, min((b + 1) << _BLOCK, top + 1)):
                if head[r] >= 0:
                    return r
    return -1


@njit(cache=True, nogil=True)
def _best_fit(
    samples: np.ndarray,
    tokens: np.ndarray,
    room: np.ndarray,
    T: int,
    seq_s: np.ndarray,
    seq_p: np.ndarray,
    nseq: int,
    placed: np.ndarray,
) -> int:
    """Each sample (given longest first) into the fullest pack it fits (among equally full
    ones, the one filled last, else the lowest id); ``placed[i]`` says whether ``samples[i]``
    found a pack. Returns the new length of the fill record."""
    P = room.shape[0]
    head = np.full(T + 1, -1, dtype=np.int64)
    nxt = np.full(P, -1, dtype=np.int64)
    blocks = np.zeros((T >> _BLOCK) + 1, dtype=np.int64)
    for p in range(P - 1, -1, -1):
        if room[p] > 0:
            _gaps_push(head, nxt, blocks, room[p], p)
    for i in range(samples.shape[0]):
        s = samples[i]
        n = tokens[s]
        r = _gaps_find(head, blocks, max(n, 1))
        if r < 0:
            placed[i] = False
            continue
        p = head[r]
        head[r] = nxt[p]
        blocks[r >> _BLOCK] -= 1
        seq_s[nseq] = s
        seq_p[nseq] = p
        nseq += 1
        placed[i] = True
        room[p] = r - n
        if room[p] > 0:
            _gaps_push(head, nxt, blocks, room[p], p)
    return nseq


@njit(cache=True, nogil=True)
def balance_window(
    window: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    P: int,
    T: int,
    fixed: float,
    small_tokens: int,
    seq_s: np.ndarray,
    seq_p: np.ndarray,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Phases 2 and 3 for one window into ``P`` empty packs.

    Returns ``(nseq, left, room)``: the fill record ``seq_s[:nseq]`` / ``seq_p[:nseq]``
    (sample, pack) in order, the samples that did not fit (in the order they were tried) and
    each pack's free room.
    """
    nw = window.shape[0]
    is_small = np.zeros(nw, dtype=np.bool_)
    n_small = 0
    for i in range(nw):
        s = window[i]
        if image_tokens[s] == 0 and tokens[s] <= small_tokens:
            is_small[i] = True
            n_small += 1
    big = np.empty(nw - n_small, dtype=np.int64)
    small = np.empty(n_small, dtype=np.int64)
    jb = 0
    js = 0
    for i in range(nw):
        if is_small[i]:
            small[js] = window[i]
            js += 1
        else:
            big[jb] = window[i]
            jb += 1
    big = big[np.argsort(-cost[big], kind="mergesort")]
    small = small[np.argsort(-tokens[small], kind="mergesort")]

    room = np.full(P, T, dtype=np.int64)
    load = np.zeros(P, dtype=np.float64)
    has_image = np.zeros(P, dtype=np.bool_)
    # the packs with free room: one skew heap per free-room value (keyed by (load, id)) and a
    # tournament tree over the room values that knows the least loaded heap root in any range;
    # the pack a sample of n tokens goes to is the tree's answer for rooms n..T
    left_child = np.full(P, -1, dtype=np.int64)
    right_child = np.full(P, -1, dtype=np.int64)
    roots = np.full(T + 1, -1, dtype=np.int64)
    leaves = 1
    while leaves < T + 1:
        leaves *= 2
    tree = np.full(2 * leaves, -1, dtype=np.int64)  # a pack id, or -1
    for p in range(P):
        roots[T] = _meld(roots[T], p, left_child, right_child, load)
    _tree_set(tree, leaves, T, roots[T], load)
    left = np.empty(nw, dtype=np.int64)
    n_left = 0
    nseq = 0
    for i in range(big.shape[0]):
        s = big[i]
        n = tokens[s]
        chosen = _tree_min(tree, leaves, n, T, load)
        if chosen < 0:
            left[n_left] = s
            n_left += 1
            continue
        r = room[chosen]  # the root of the heap of room r: take it out
        roots[r] = _meld(left_child[chosen], right_child[chosen], left_child, right_child, load)
        left_child[chosen] = -1
        right_child[chosen] = -1
        _tree_set(tree, leaves, r, roots[r], load)
        seq_s[nseq] = s
        seq_p[nseq] = chosen
        nseq += 1
        room[chosen] -= n
        load[chosen] += cost[s]
        if image_tokens[s] > 0 and not has_image[chosen]:
            has_image[chosen] = True
            load[chosen] += fixed
        r = room[chosen]
        if r > 0:
            roots[r] = _meld(roots[r], chosen, left_child, right_child, load)
            _tree_set(tree, leaves, r, roots[r], load)

    placed = np.empty(small.shape[0], dtype=np.bool_)
    nseq = _best_fit(small, tokens, room, T, seq_s, seq_p, nseq, placed)
    for i in range(small.shape[0]):
        if not placed[i]:
            left[n_left] = small[i]
            n_left += 1
    return nseq, left[:n_left].copy(), room


@njit(cache=True, nogil=True)
def _fill_images(
    order: np.ndarray,
    pos: int,
    end: int,
    taken: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    fixed: float,
    room: np.ndarray,
    seq_s: np.ndarray,
    seq_p: np.ndarray,
    nseq: int,
) -> tuple[int, int]:
    """Samples with images from the lookahead, longest first, each into the least loaded pack
    it fits; a pack's load is its samples' cost plus ``fixed`` once it has an image (also when
    it gains its first image here). Returns the new length of the fill record and the tokens
    taken."""
    P = room.shape[0]
    load = np.zeros(P, dtype=np.float64)  # the packs' costs so far, from the fill record
    has_image = np.zeros(P, dtype=np.bool_)
    for i in range(nseq):
        load[seq_p[i]] += cost[seq_s[i]]
        if image_tokens[seq_s[i]] > 0:
            has_image[seq_p[i]] = True
    for p in range(P):
        if has_image[p]:
            load[p] += fixed
    cand = np.empty(end - pos, dtype=np.int64)
    nc = 0
    for i in range(pos, end):
        s = order[i]
        if not taken[s] and image_tokens[s] > 0:
            cand[nc] = s
            nc += 1
    cand = cand[:nc]
    cand = cand[np.argsort(-tokens[cand], kind="mergesort")]
    took = 0
    for i in range(nc):
        s = cand[i]
        best = -1
        for p in range(P):
            if room[p] >= tokens[s] and (best < 0 or load[p] < load[best]):
                best = p
        if best < 0:
            continue
        seq_s[nseq] = s
        seq_p[nseq] = best
        nseq += 1
        room[best] -= tokens[s]
        load[best] += cost[s]
        if not has_image[best]:
            has_image[best] = True
            load[best] += fixed
        taken[s] = True
        took += tokens[s]
    return nseq, took


@njit(cache=True, nogil=True)
def _emit(
    seq_s: np.ndarray,
    seq_p: np.ndarray,
    nseq: int,
    n_packs: int,
    out: np.ndarray,
    n_out: int,
    pack_len: np.ndarray,
    n_pack: int,
) -> tuple[int, int, int]:
    """Writes the filled packs (non-empty ones, by pack id; samples in fill order) to ``out``.
    Returns the new ``n_out``, ``n_pack`` and the number of packs written."""
    counts = np.zeros(n_packs, dtype=np.int64)
    for i in range(nseq):
        counts[seq_p[i]] += 1
    start = np.zeros(n_packs, dtype=np.int64)
    acc = n_out
    for p in range(n_packs):
        start[p] = acc
        acc += counts[p]
    for i in range(nseq):
        p = seq_p[i]
        out[start[p]] = seq_s[i]
        start[p] += 1
    written = 0
    for p in range(n_packs):
        if counts[p] > 0:
            pack_len[n_pack] = counts[p]
            n_pack += 1
            written += 1
    return acc, n_pack, written


@njit(cache=True, nogil=True)
def _read_window(
    order: np.ndarray,
    pos: int,
    rest: int,
    taken: np.ndarray,
    tokens: np.ndarray,
    waiting: np.ndarray,
    window: np.ndarray,
    budget: float,
    capacity: int,
) -> tuple[int, int, int]:
    """Step 1 of a global batch: writes its window to ``window``: the waiting samples, then
    the stream from ``pos`` on until the window holds ``budget`` tokens; and if everything
    left then fits in ``capacity`` tokens (the epoch's last global batch), the whole rest of
    the stream. Returns the window's length and the new ``pos`` and ``rest``."""
    n = order.shape[0]
    nw = 0
    total = 0
    for i in range(waiting.shape[0]):
        window[nw] = waiting[i]
        nw += 1
        total += tokens[waiting[i]]
    while pos < n and total < budget:
        s = order[pos]
        pos += 1
        if taken[s]:
            continue
        window[nw] = s
        nw += 1
        total += tokens[s]
        rest -= tokens[s]
    if total + rest <= capacity:  # the epoch's last global batch: everything that is left
        while pos < n:
            s = order[pos]
            pos += 1
            if not taken[s]:
                window[nw] = s
                nw += 1
        rest = 0
    return nw, pos, rest


@njit(cache=True, nogil=True)
def _fill_gaps(
    order: np.ndarray,
    pos: int,
    rest: int,
    taken: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    T: int,
    fixed: float,
    lookahead: int,
    fill_images: bool,
    room: np.ndarray,
    seq_s: np.ndarray,
    seq_p: np.ndarray,
    nseq: int,
) -> tuple[int, int]:
    """Step 4 of a global batch: the packs' free room filled from the next ``lookahead``
    samples of the stream, the text-only ones by best fit (longest first), then, with
    ``fill_images``, those with images (:func:`_fill_images`); the samples taken are marked in
    ``taken``. Returns the new length of the fill record and the new ``rest``."""
    max_room = 0
    for p in range(room.shape[0]):
        max_room = max(max_room, room[p])
    if max_room <= 0:
        return nseq, rest
    end = min(order.shape[0], pos + lookahead)
    cand = np.empty(end - pos, dtype=np.int64)
    nc = 0
    for i in range(pos, end):
        s = order[i]
        if not taken[s] and image_tokens[s] == 0 and tokens[s] <= max_room:
            cand[nc] = s
            nc += 1
    cand = cand[:nc]
    cand = cand[np.argsort(-tokens[cand], kind="mergesort")]
    placed = np.empty(nc, dtype=np.bool_)
    nseq = _best_fit(cand, tokens, room, T, seq_s, seq_p, nseq, placed)
    for i in range(nc):
        if placed[i]:
            taken[cand[i]] = True
            rest -= tokens[cand[i]]
    if fill_images:
        nseq, took = _fill_images(
            order,
            pos,
            end,
            taken,
            tokens,
            image_tokens,
            cost,
            fixed,
            room,
            seq_s,
            seq_p,
            nseq,
        )
        rest -= took
    return nseq, rest


@njit(cache=True, nogil=True)
def _pack_leftovers(
    left: np.ndarray,
    tokens: np.ndarray,
    P: int,
    T: int,
    seq_s: np.ndarray,
    seq_p: np.ndarray,
    nseq: int,
) -> tuple[int, int]:
    """The epoch's last global batch: the samples that did not fit its ``P`` packs get packs
    of their own, ids ``P`` on (best fit decreasing). Returns the new length of the fill
    record and the batch's pack count."""
    left = left[np.argsort(-tokens[left], kind="mergesort")]
    extra_room = np.full(left.shape[0], T, dtype=np.int64)
    placed = np.empty(left.shape[0], dtype=np.bool_)
    first = nseq
    nseq = _best_fit(left, tokens, extra_room, T, seq_s, seq_p, nseq, placed)
    for i in range(first, nseq):
        seq_p[i] += P
    return nseq, P + left.shape[0]


@njit(cache=True, nogil=True)
def form_epoch(
    order: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    P: int,
    T: int,
    fixed: float,
    slack: float,
    small_tokens: int,
    lookahead: int,
    fill_images: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's packs: ``(samples, pack_len, window_packs)``; the packs are consecutive
    runs of ``samples`` of lengths ``pack_len``, and the ``k``-th window made
    ``window_packs[k]`` of them (``P`` but for the last)."""
    n = order.shape[0]
    taken = np.zeros(tokens.shape[0], dtype=np.bool_)
    rest = 0  # tokens of the samples not yet read nor taken, from ``pos`` on
    for i in range(n):
        rest += tokens[order[i]]
    out = np.empty(n, dtype=np.int64)
    pack_len = np.empty(n, dtype=np.int64)
    window_packs = np.empty(n + 1, dtype=np.int64)
    n_out = 0
    n_pack = 0
    n_window = 0
    seq_s = np.empty(n, dtype=np.int64)
    seq_p = np.empty(n, dtype=np.int64)
    waiting = np.empty(0, dtype=np.int64)
    window = np.empty(n, dtype=np.int64)
    budget = P * T * (1.0 + slack)
    pos = 0
    while pos < n or waiting.shape[0] > 0:
        # 1. window: the waiting samples, then the stream up to the budget
        nw, pos, rest = _read_window(
            order, pos, rest, taken, tokens, waiting, window, budget, P * T
        )
        # 2-3. balance the big samples, best-fit the small ones
        nseq, left, room = balance_window(
            window[:nw], tokens, image_tokens, cost, P, T, fixed, small_tokens, seq_s, seq_p
        )
        # 4. fill the gaps from the lookahead (text only, unless fill_images)
        if pos < n:
            nseq, rest = _fill_gaps(
                order,
                pos,
                rest,
                taken,
                tokens,
                image_tokens,
                cost,
                T,
                fixed,
                lookahead,
                fill_images,
                room,
                seq_s,
                seq_p,
                nseq,
            )
        n_packs = P
        if pos >= n and left.shape[0] > 0:
            # the last batch: whatever did not fit gets packs of its own
            nseq, n_packs = _pack_leftovers(left, tokens, P, T, seq_s, seq_p, nseq)
            left = left[:0]
        n_out, n_pack, written = _emit(seq_s, seq_p, nseq, n_packs, out, n_out, pack_len, n_pack)
        window_packs[n_window] = written
        n_window += 1
        waiting = left.copy()
    return out[:n_out].copy(), pack_len[:n_pack].copy(), window_packs[:n_window].copy()


def emit_packs(seq_s: np.ndarray, seq_p: np.ndarray, n_packs: int) -> Packs:
    """The non-empty packs of a fill record, as :class:`Packs` (samples in fill order)."""
    out = np.empty(len(seq_s), dtype=np.int64)
    pack_len = np.empty(n_packs, dtype=np.int64)
    _, made, _ = _emit(seq_s, seq_p, len(seq_s), n_packs, out, 0, pack_len, 0)
    offsets = np.zeros(made + 1, dtype=np.int64)
    np.cumsum(pack_len[:made], out=offsets[1:])
    return Packs(out, offsets)
