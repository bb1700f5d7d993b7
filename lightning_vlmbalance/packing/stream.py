"""Packing a stream: whole samples into fixed-length packs from a bounded buffer (numpy only).

A streamed dataset (WebDataset shards, LitData chunks, Hugging Face ``datasets`` in streaming
mode) is read in order, without random access and without a length table of every sample ahead
of training. :func:`pack_stream` packs such a stream with the package's greedy packer
(:func:`~lightning_vlmbalance.packing.pack_greedy`) one window at a time: it reads ``buffer``
samples (their lengths from a cheap function of the sample, never the data of the whole epoch),
packs them together with the samples the previous window carried over, emits the packs, and
carries the packs filled below ``min_fill`` (each sample at most once) to the front of the next
window. Memory is bounded by the window: ``buffer`` samples plus what was carried.

Over the same order the packs are exactly :func:`pack_greedy`'s with ``window=buffer``: the map
style sampler's packer, so a stream packs as tightly as the map-style path packs the same
order (``benchmarks/stream_packing.py`` measures it against the map-style sampler's globally
shuffled order on the shared mixes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from lightning_vlmbalance.packing.binpack import _pack_window

__all__ = ["pack_stream"]


def pack_stream(
    lengths: Iterable[int], seq_len: int, *, buffer: int = 4096, min_fill: float = 0.98
) -> Iterator[np.ndarray]:
    """Packs a stream of sample lengths, in order, into packs of at most ``seq_len`` tokens.

    Args:
        lengths: tokens of each sample, in stream order (any iterable, read once, ``buffer`` at
            a time). Every length must be in ``[1, seq_len]``.
        seq_len: capacity of a pack.
        buffer: new samples per window (the packer's ``window``); larger packs tighter, smaller
            holds fewer samples and keeps packs closer to the stream order.
        min_fill: packs filled below this fraction are dissolved (once per sample) and their
            samples carried to the front of the next window; the last window keeps every pack.

    Yields:
        Each pack as the stream positions (0-based indices into ``lengths``) of its samples,
        window by window. Every position appears in exactly one pack.

    Raises:
        ValueError: naming the position of a length out of ``[1, seq_len]``, or a bad argument.
    """
    if buffer < 1:
        raise ValueError(f"`pack_stream(buffer={buffer!r})` must be >= 1")
    if not 0.0 <= min_fill <= 1.0:
        raise ValueError(f"`pack_stream(min_fill={min_fill!r})` must be in [0, 1]")
    if seq_len < 1:
        raise ValueError(f"`pack_stream(seq_len={seq_len!r})` must be >= 1")
    limit = min_fill * seq_len
    source = iter(lengths)
    ahead: list[int] = []  # one sample read ahead: a window knows whether the stream ended
    read = 0  # stream positions read so far
    carry: list[int] = []  # positions carried into this window (carried once: never again)
    carry_len: list[int] = []

    def checked(length: object, position: int) -> int:
        value = int(length)  # type: ignore[call-overload]
        if not 1 <= value <= seq_len:
            raise ValueError(
                f"`pack_stream`: sample {position} has {value} tokens; every sample must have"
                f" 1 to seq_len={seq_len} tokens"
            )
        return value

    while True:
        new_len = ahead
        for length in source:
            new_len.append(checked(length, read + len(new_len)))
            if len(new_len) == buffer:
                break
        ahead = [checked(x, read + len(new_len)) for x in _first(source)]
        last = not ahead  # the stream ends in this window
        if not new_len and not carry:
            return
        positions = carry + list(range(read, read + len(new_len)))
        read += len(new_len)
        window_len = carry_len + new_len
        carried = set(carry)
        packs, fills = _pack_window(window_len, seq_len)
        carry, carry_len = [], []
        for local, fill in zip(packs, fills):
            pack = [positions[i] for i in local]
            if fill < limit and not last and not carried.intersection(pack):
                carry.extend(pack)
                carry_len.extend(window_len[i] for i in local)
                continue
            yield np.asarray(pack, dtype=np.int64)
        if last:
            return


def _first(source: Iterator[object]) -> list[object]:
    """The next item of ``source`` as a one-item list (empty at the end)."""
    for item in source:
        return [item]
    return []
