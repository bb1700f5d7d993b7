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
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_vlmbalance.packing.binpack import _pack_window

__all__ = ["WindowState", "pack_stream", "pack_stream_windows"]


@dataclass(frozen=True)
class WindowState:
    """Where the packer of a stream stands at the start of a window: what resumes it there.

    Attributes:
        read: stream positions read into earlier windows (the window's new samples start here).
        carry: ``(position, tokens)`` of the samples carried into this window, in order.
        packs_before: packs emitted before this window.
    """

    read: int = 0
    carry: tuple[tuple[int, int], ...] = ()
    packs_before: int = 0

    def to_list(self) -> list[Any]:
        """A plain form for a checkpoint (ints and lists)."""
        return [self.read, [list(c) for c in self.carry], self.packs_before]

    @classmethod
    def from_list(cls, state: list[Any]) -> WindowState:
        read, carry, before = state
        return cls(int(read), tuple((int(p), int(n)) for p, n in carry), int(before))


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
    for _, packs in pack_stream_windows(lengths, seq_len, buffer=buffer, min_fill=min_fill):
        yield from packs


def pack_stream_windows(
    lengths: Iterable[int],
    seq_len: int,
    *,
    buffer: int = 4096,
    min_fill: float = 0.98,
    start: WindowState | None = None,
) -> Iterator[tuple[WindowState, list[np.ndarray]]]:
    """:func:`pack_stream` window by window, resumable at any window's start.

    Yields ``(state, packs)`` per window: ``state`` is where the packer stood when the window
    began (give it back as ``start``, with ``lengths`` from stream position ``state.read`` on,
    and the packs from that window on are the same), ``packs`` the window's packs in order.
    The packs of a window hold its new samples and the samples carried into it, which the
    previous window read: to rebuild a window's packs a reader needs the stream from the
    previous window's ``state.read``.
    """
    if buffer < 1:
        raise ValueError(f"`pack_stream(buffer={buffer!r})` must be >= 1")
    if not 0.0 <= min_fill <= 1.0:
        raise ValueError(f"`pack_stream(min_fill={min_fill!r})` must be in [0, 1]")
    if seq_len < 1:
        raise ValueError(f"`pack_stream(seq_len={seq_len!r})` must be >= 1")
    state = start or WindowState()
    limit = min_fill * seq_len
    source = iter(lengths)
    ahead: list[int] = []  # one sample read ahead: a window knows whether the stream ended
    read = state.read  # stream positions read so far
    carry = [p for p, _ in state.carry]  # positions carried into this window (never again)
    carry_len = [n for _, n in state.carry]
    emitted = state.packs_before

    def checked(length: object, position: int) -> int:
        value = int(length)  # type: ignore[call-overload]
        if not 1 <= value <= seq_len:
            raise ValueError(
                f"`pack_stream`: sample {position} has {value} tokens; every sample must have"
                f" 1 to seq_len={seq_len} tokens"
            )
        return value

    while True:
        state = WindowState(read, tuple(zip(carry, carry_len)), emitted)
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
        out: list[np.ndarray] = []
        for local, fill in zip(packs, fills):
            pack = [positions[i] for i in local]
            if fill < limit and not last and not carried.intersection(pack):
                carry.extend(pack)
                carry_len.extend(window_len[i] for i in local)
                continue
            out.append(np.asarray(pack, dtype=np.int64))
        emitted += len(out)
        yield state, out
        if last:
            return


def _first(source: Iterator[object]) -> list[object]:
    """The next item of ``source`` as a one-item list (empty at the end)."""
    for item in source:
        return [item]
    return []
