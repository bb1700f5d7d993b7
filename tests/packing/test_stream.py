"""Packing a stream (``pack_stream``): the greedy packer one bounded window at a time."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlmbalance.packing.binpack import pack_greedy
from lightning_vlmbalance.packing.stream import pack_stream


@pytest.mark.parametrize(("n", "buffer"), [(1000, 64), (1024, 256), (5000, 4096), (300, 1000)])
def test_a_stream_packs_as_the_greedy_packer_packs_the_same_order(n, buffer) -> None:
    """Read ``buffer`` at a time from an iterator (never the whole stream), the packs are those of
    ``pack_greedy(window=buffer)`` over the same order: every sample once, none cut, the same
    packs in the same order, also when the stream ends exactly at a window's end (1024/256)."""
    lengths = np.random.default_rng(n).integers(1, 1500, n)
    reads = []

    def source():
        for k, x in enumerate(lengths.tolist()):
            reads.append(k)
            yield x

    greedy = pack_greedy(lengths, 2048, window=buffer)
    packs = []
    for pack in pack_stream(source(), 2048, buffer=buffer):
        # bounded: a pack is emitted before the stream is read a window (and one sample) past it
        assert len(reads) <= int(pack.max()) + 2 * buffer + 1
        packs.append(pack)
    assert len(packs) == len(greedy)
    assert all(np.array_equal(packs[i], greedy[i]) for i in range(len(greedy)))
    assert np.sort(np.concatenate(packs)).tolist() == list(range(n))
    assert max(int(lengths[p].sum()) for p in packs) <= 2048


def test_an_empty_stream_has_no_packs_and_bad_lengths_are_named() -> None:
    assert list(pack_stream(iter([]), 16)) == []
    with pytest.raises(ValueError, match="sample 2 has 17 tokens"):
        list(pack_stream(iter([3, 4, 17, 5]), 16, buffer=2))
    with pytest.raises(ValueError, match="buffer=0"):
        list(pack_stream(iter([3]), 16, buffer=0))
