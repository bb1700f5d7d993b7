"""Bin-packing of whole samples into fixed-length packs (numpy only, no Lightning).

A sample is never split, so an image is never cut. The main packer is *shuffled fill with pair
completion*: samples are taken in their (already shuffled) order until the space left in the pack is
at most twice the largest remaining sample, then the pack is closed with the *pair* of remaining
samples of its window whose lengths best fill that space (searched exhaustively over the distinct
lengths, vectorised), then with single samples while any fits.

Why this beats best-fit-decreasing (BFD) on multimodal data: image samples are long (>= ~290
tokens), so when BFD has placed the big samples the last gap of a pack (~100 tokens on average)
can only be closed by a small sample, and there are too few of them. Searching over pairs of
*ordinary* samples closes the gap exactly most of the time, and taking the random-order samples
first keeps the pool of candidates representative until the end of the window. Packs that still
end up below ``min_fill`` are dissolved once and their samples carried to the front of the next
window (a sample is carried at most once, so nothing drifts further than one window).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Packs", "pack_best_fit_decreasing", "pack_greedy", "packing_efficiency"]


def packing_efficiency(pack_tokens: np.ndarray, seq_len: int) -> float:
    """Sum of sample tokens over (number of packs x ``seq_len``)."""
    if len(pack_tokens) == 0:
        return 0.0
    return float(np.sum(pack_tokens)) / (len(pack_tokens) * seq_len)


def _pack_window(lengths: list[int], seq_len: int) -> tuple[list[list[int]], list[int]]:
    """Packs one window; returns the packs (positions into ``lengths``) and their tokens."""
    lengths_np = np.asarray(lengths, dtype=np.int64)
    # Samples grouped by length; within a length, in window (= shuffled) order.
    order = np.argsort(lengths_np, kind="stable").tolist()
    count_np = np.bincount(lengths_np, minlength=seq_len + 1)
    head = np.zeros(seq_len + 1, dtype=np.int64)
    head[1:] = np.cumsum(count_np)[:-1]
    head_l = head.tolist()
    count_l = count_np.tolist()
    is_present = count_np > 0  # by length; a bool mask scans fastest
    present = np.flatnonzero(is_present).tolist()  # sorted distinct lengths still available

    def take(length: int) -> int:
        i = head_l[length]
        head_l[length] = i + 1
        c = count_l[length] - 1
        count_l[length] = c
        if c == 0:
            is_present[length] = False
            del present[bisect.bisect_left(present, length)]
        return order[i]

    packs: list[list[int]] = []
    fills: list[int] = []
    cursor = 0
    while present:
        room = seq_len
        pack: list[int] = []
        # 1) fill in shuffled order while any two remaining samples still fit
        while present and room > 2 * present[-1]:
            length = lengths[cursor]
            cursor += 1
            if count_l[length] > 0:  # else it was already used by a completion
                pack.append(take(length))
                room -= length
        # 2) close the pack: best pair, else largest single, until nothing fits
        while present and room >= present[0]:
            avail = is_present[: room + 1].nonzero()[0]
            single = int(avail[-1])
            best = 0
            half = int(avail.searchsorted(room >> 1, "right"))
            if half:
                # pair (a, b) with a <= room / 2 and b the longest length <= room - a (so b >= a)
                a_len = avail[:half]
                j = avail.searchsorted(room - a_len, "right") - 1
                sums = a_len + avail[j]
                # argmax over the reversed view: among equal sums take the pair with the larger
                # small element; small samples are the scarce gap fillers, keep them for later
                k = half - 1 - int(sums[::-1].argmax())
                a, b = int(a_len[k]), int(avail[j[k]])
                best = a + b
                if a == b and count_l[a] < 2:  # needs two samples of that length
                    best = 0
            if best > single:
                pack.append(take(a))
                pack.append(take(b))
                room -= best
            else:
                pack.append(take(single))
                room -= single
        packs.append(pack)
        fills.append(seq_len - room)
    return packs, fills


def _pack_window_capped(
    lengths: list[int], images: list[int], seq_len: int, cap: int
) -> tuple[list[list[int]], list[int]]:
    """:func:`_pack_window` under a second capacity: at most ``cap`` image tokens per pack.

    Fills in window order while the two longest remaining samples still fit (a sample whose
    image tokens no longer fit stays for a later pack), then closes the pack with the longest
    remaining samples that fit both capacities, earliest first among equals. Every sample has
    ``images <= cap`` (checked by the caller), so every pack takes at least one.
    """
    n = len(lengths)
    L = np.asarray(lengths, dtype=np.int64)
    img = np.asarray(images, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    count = np.bincount(L, minlength=seq_len + 1).tolist()
    longest = int(L.max()) if n else 0
    packs: list[list[int]] = []
    fills: list[int] = []
    cursor, left = 0, n

    def take(i: int) -> None:
        nonlocal longest, left
        alive[i] = False
        left -= 1
        count[lengths[i]] -= 1
        while longest > 0 and count[longest] == 0:
            longest -= 1

    while left:
        room, image_room = seq_len, cap
        pack: list[int] = []
        while cursor < n and room > 2 * longest:
            i = cursor
            cursor += 1
            if alive[i] and images[i] <= image_room:
                take(i)
                pack.append(i)
                room -= lengths[i]
                image_room -= images[i]
        while True:
            fits = np.flatnonzero(alive & (L <= room) & (img <= image_room))
            if not len(fits):
                break
            i = int(fits[L[fits].argmax()])
            take(i)
            pack.append(i)
            room -= lengths[i]
            image_room -= images[i]
        packs.append(pack)
        fills.append(seq_len - room)
    return packs, fills


@dataclass(frozen=True, slots=True)
class Packs:
    """Packs in compressed form: pack ``i`` holds ``positions[offsets[i]:offsets[i + 1]]``.

    Positions index the sequence that was packed. A flat array instead of one array per pack keeps
    a plan of millions of samples small and cheap to build.
    """

    positions: np.ndarray  # (N,) int64
    offsets: np.ndarray  # (P + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.positions[self.offsets[i] : self.offsets[i + 1]]

    def sizes(self) -> np.ndarray:
        """Number of samples in each pack."""
        return np.diff(self.offsets)

    def tokens(self, lengths: np.ndarray) -> np.ndarray:
        """Sum of ``lengths`` over each pack (``lengths`` indexed by position)."""
        sums = np.concatenate([[0], np.cumsum(np.asarray(lengths)[self.positions])])
        return sums[self.offsets[1:]] - sums[self.offsets[:-1]]

    @classmethod
    def from_lists(cls, packs: list[np.ndarray] | list[list[int]]) -> Packs:
        sizes = [len(p) for p in packs]
        offsets = np.zeros(len(packs) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        positions = (
            np.concatenate([np.asarray(p, dtype=np.int64) for p in packs])
            if packs
            else np.zeros(0, dtype=np.int64)
        )
        return cls(positions=positions, offsets=offsets)


def pack_greedy(
    lengths: np.ndarray,
    seq_len: int,
    *,
    window: int = 4096,
    min_fill: float = 0.98,
    image_tokens: np.ndarray | None = None,
    max_image_tokens: int | None = None,
) -> Packs:
    """Packs samples, in the given order, into packs of at most ``seq_len`` tokens.

    Args:
        lengths: tokens of each sample, in training order (shuffle before calling). Every length
            must be in ``[1, seq_len]``.
        seq_len: capacity of a pack.
        window: samples packed together; larger windows pack tighter, smaller ones keep packs closer
            to the training order.
        min_fill: packs filled below this fraction are dissolved (once per sample) and their
            samples carried to the front of the next window. The last window keeps every pack.
        image_tokens: image tokens of each sample (with ``max_image_tokens``).
        max_image_tokens: at most this many image tokens per pack (a vision-token budget: the
            vision encoder's memory grows with its patches); a sample over it is an error.

    Returns:
        The packs, in emission order, as positions into ``lengths``. Every position appears in
        exactly one pack.

    Raises:
        ValueError: if a length is out of ``[1, seq_len]`` or an argument is invalid.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lengths, seq_len)
    if window < 1:
        raise ValueError(f"`pack_greedy(window={window!r})` must be >= 1")
    if not 0.0 <= min_fill <= 1.0:
        raise ValueError(f"`pack_greedy(min_fill={min_fill!r})` must be in [0, 1]")
    images = None
    if max_image_tokens is not None:
        if image_tokens is None or max_image_tokens < 1:
            raise ValueError(
                f"`pack_greedy(max_image_tokens={max_image_tokens!r})` needs `image_tokens` and"
                " a positive budget"
            )
        images = np.asarray(image_tokens, dtype=np.int64)
        raise_for_first_bad(
            images > max_image_tokens,
            lambda i, k: (
                f"sample at position {i} has {int(images[i])} image tokens, more than"
                f" `max_image_tokens_per_pack={max_image_tokens}` ({k} such samples): images are"
                " never cut; raise the budget or leave those samples out"
            ),
        )
    n = len(lengths)
    limit = min_fill * seq_len
    carried = np.zeros(n, dtype=bool)
    flat: list[np.ndarray] = []
    sizes: list[int] = []
    carry = np.zeros(0, dtype=np.int64)
    for start in range(0, n, window):
        stop = min(start + window, n)
        positions = np.concatenate([carry, np.arange(start, stop, dtype=np.int64)])
        last = stop == n
        if images is None:
            packs, fills = _pack_window(lengths[positions].tolist(), seq_len)
        else:
            packs, fills = _pack_window_capped(
                lengths[positions].tolist(),
                images[positions].tolist(),
                seq_len,
                int(max_image_tokens),  # type: ignore[arg-type]
            )
        keep: list[int] = []
        next_carry: list[np.ndarray] = []
        for local, fill in zip(packs, fills):
            if fill < limit and not last:
                pack = positions[local]
                if not carried[pack].any():
                    carried[pack] = True
                    next_carry.append(pack)
                    continue
            keep.extend(local)
            sizes.append(len(local))
        flat.append(positions[keep])
        carry = np.concatenate(next_carry) if next_carry else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    positions = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    return Packs(positions=positions, offsets=offsets)


def pack_best_fit_decreasing(
    lengths: np.ndarray,
    seq_len: int,
    *,
    window: int = 4096,
    image_tokens: np.ndarray | None = None,
    image_budget: int | None = None,
) -> Packs:
    """Best-fit-decreasing within windows; with ``image_budget``, the image-budget baseline.

    Each sample, longest first, goes to the open pack with the least room that still fits it (and,
    with a budget, whose image tokens stay within ``image_budget``). This is the comparison
    baseline: plain BFD leaves the last gap of most packs open on image-heavy data, and an image
    budget balances vision cost per pack at the price of much emptier packs.

    Returns:
        The packs, as positions into ``lengths``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lengths, seq_len)
    if (image_tokens is None) != (image_budget is None):
        raise ValueError("`image_tokens` and `image_budget` must be given together")
    images = np.zeros_like(lengths) if image_tokens is None else np.asarray(image_tokens, np.int64)
    budget = np.iinfo(np.int64).max if image_budget is None else int(image_budget)
    if image_budget is not None and (images > budget).any():
        i = int(np.flatnonzero(images > budget)[0])
        raise ValueError(
            f"sample at position {i} has {int(images[i])} image tokens, more than "
            f"`image_budget={image_budget}`"
        )
    out: list[list[int]] = []
    for start in range(0, len(lengths), window):
        positions = np.arange(start, min(start + window, len(lengths)))
        positions = positions[np.argsort(-lengths[positions], kind="stable")]
        room = np.empty(len(positions), dtype=np.int64)
        image_room = np.empty(len(positions), dtype=np.int64)
        members: list[list[int]] = []
        for p in positions.tolist():
            length, image = int(lengths[p]), int(images[p])
            n_open = len(members)
            fits = (room[:n_open] >= length) & (image_room[:n_open] >= image)
            candidates = fits.nonzero()[0]
            if len(candidates):
                k = int(candidates[room[candidates].argmin()])
                members[k].append(p)
            else:
                k = n_open
                members.append([p])
                room[k] = seq_len
                image_room[k] = budget
            room[k] -= length
            image_room[k] -= image
        out.extend(members)
    return Packs.from_lists(out)


def _check_lengths(lengths: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"`seq_len={seq_len!r}` must be >= 1")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {tuple(lengths.shape)}")
    raise_for_first_bad(
        (lengths < 1) | (lengths > seq_len),
        lambda i, n: (
            f"sample at position {i} has {int(lengths[i])} tokens, outside"
            f" [1, seq_len={seq_len}] ({n} such samples)"
        ),
    )


def raise_for_first_bad(bad: np.ndarray, message: Callable[[int, int], str]) -> None:
    """Raises ``ValueError(message(i, n))`` where ``i`` is the first sample for which ``bad``
    holds and ``n`` how many it holds for; nothing if none."""
    where = np.flatnonzero(bad)
    if len(where):
        raise ValueError(message(int(where[0]), len(where)))
