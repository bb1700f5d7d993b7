"""The bin-packing core: whole samples, exact coverage, capacity, determinism, efficiency."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_vlmbalance.packing import (
    Packs,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.synthetic import synthetic_length_table

lengths_st = st.integers(min_value=1, max_value=64).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=0, max_size=300))
)


def _check_packs(packs: Packs, lengths: np.ndarray, seq_len: int) -> None:
    # every sample in exactly one pack (a sample is never split), no pack over capacity
    assert np.array_equal(np.sort(packs.positions), np.arange(len(lengths)))
    assert len(packs) == 0 or packs.tokens(lengths).max() <= seq_len
    assert (packs.sizes() >= 1).all()


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 50), st.floats(0.0, 1.0))
def test_greedy_covers_every_sample_once_within_capacity(case, window, min_fill) -> None:
    """Packing must place each sample exactly once and never exceed seq_len."""
    seq_len, lengths = case
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_packs(pack_greedy(lengths, seq_len, window=window, min_fill=min_fill), lengths, seq_len)


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(1, 50))
def test_best_fit_decreasing_and_budget_respect_both_capacities(case, window) -> None:
    """The baselines place each sample once; the budget packer also caps image tokens per pack."""
    seq_len, lengths = case
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_packs(pack_best_fit_decreasing(lengths, seq_len, window=window), lengths, seq_len)
    image = lengths // 2
    budget = max(int(image.max(initial=0)), 1)
    packs = pack_best_fit_decreasing(
        lengths, seq_len, window=window, image_tokens=image, image_budget=budget
    )
    _check_packs(packs, lengths, seq_len)
    assert len(packs) == 0 or packs.tokens(image).max() <= budget


def test_greedy_is_deterministic_and_order_sensitive() -> None:
    """The same input order gives the same packs; another order gives other packs."""
    table = synthetic_length_table(3000, seed=2)
    a = pack_greedy(table.total_tokens, 8192)
    b = pack_greedy(table.total_tokens, 8192)
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.offsets, b.offsets)
    c = pack_greedy(table.total_tokens[::-1].copy(), 8192)
    as_sets = {frozenset(a[i].tolist()) for i in range(len(a))}
    reversed_sets = {frozenset((len(table) - 1 - c[i]).tolist()) for i in range(len(c))}
    assert as_sets != reversed_sets


@pytest.mark.parametrize("text_share", [0.0, 0.2, 0.4])
def test_greedy_beats_best_fit_decreasing(text_share: float) -> None:
    """On a realistic mix the greedy packer packs tighter than BFD and close to the limit."""
    lengths = synthetic_length_table(20000, text_share=text_share, seed=0).total_tokens
    greedy = packing_efficiency(pack_greedy(lengths, 8192).tokens(lengths), 8192)
    bfd = packing_efficiency(pack_best_fit_decreasing(lengths, 8192).tokens(lengths), 8192)
    assert greedy > bfd
    assert greedy > 0.99


def test_image_budget_collapses_efficiency() -> None:
    """Capping image tokens per pack balances vision load but leaves packs far from full."""
    t = synthetic_length_table(8000, text_share=0.2, seed=0)
    packs = pack_best_fit_decreasing(
        t.total_tokens, 8192, image_tokens=t.image_tokens, image_budget=4096
    )
    assert packing_efficiency(packs.tokens(t.total_tokens), 8192) < 0.8


def test_training_order_is_kept_within_windows() -> None:
    """Packs follow the shuffled order window by window: no global sort by length."""
    lengths = synthetic_length_table(20000, seed=1).total_tokens
    packs = pack_greedy(lengths, 8192, window=1000)
    first_pos = np.array([packs[i].min() for i in range(len(packs))])
    # the earliest sample of the k-th pack advances through the sequence with the windows
    assert np.corrcoef(np.arange(len(packs)), first_pos)[0, 1] > 0.99
    # long samples are spread over the epoch, not bunched at the start or the end
    tokens = packs.tokens(lengths)
    q = len(packs) // 4
    assert abs(tokens[:q].mean() - tokens[-q:].mean()) < 0.02 * 8192


@pytest.mark.parametrize(
    ("lengths", "match"),
    [([5, 0, 3], "position 1 has 0 tokens"), ([5, 11, 3], "position 1 has 11 tokens")],
)
def test_bad_lengths_name_the_sample(lengths: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_greedy(np.array(lengths), 10)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="window"):
        pack_greedy(np.array([1]), 10, window=0)
    with pytest.raises(ValueError, match="min_fill"):
        pack_greedy(np.array([1]), 10, min_fill=1.5)
    with pytest.raises(ValueError, match="image_budget"):
        pack_best_fit_decreasing(np.array([5]), 10, image_tokens=np.array([6]), image_budget=4)


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 50), st.floats(0.0, 1.0), st.data())
def test_greedy_with_a_vision_budget_keeps_both_capacities(case, window, min_fill, data) -> None:
    """``max_image_tokens``: every sample once, no pack over ``seq_len`` or over the budget."""
    seq_len, lengths = case
    lengths = np.asarray(lengths, dtype=np.int64)
    image = np.asarray(
        [data.draw(st.integers(0, int(n))) for n in lengths.tolist()], dtype=np.int64
    )
    budget = data.draw(st.integers(max(int(image.max(initial=0)), 1), max(2 * seq_len, 1)))
    packs = pack_greedy(
        lengths,
        seq_len,
        window=window,
        min_fill=min_fill,
        image_tokens=image,
        max_image_tokens=budget,
    )
    _check_packs(packs, lengths, seq_len)
    assert len(packs) == 0 or packs.tokens(image).max() <= budget


def test_vision_budget_packs_full_where_the_budget_allows() -> None:
    """On a synthetic mix, a budget above the packs' mean image load costs little fill; the
    same budget in the best-fit-decreasing baseline costs more; no budget is unchanged."""
    table = synthetic_length_table(20_000, text_share=0.2, seed=3)
    keep = table.total_tokens <= 4096
    total, image = table.total_tokens[keep], table.image_tokens[keep]
    free = pack_greedy(total, 4096)
    assert pack_greedy(total, 4096, image_tokens=image, max_image_tokens=None).offsets.tolist() == (
        free.offsets.tolist()
    )
    mean_load = image.sum() / len(free)
    budget = int(1.25 * mean_load)
    capped = pack_greedy(total, 4096, image_tokens=image, max_image_tokens=budget)
    assert capped.tokens(image).max() <= budget < free.tokens(image).max()
    eff = packing_efficiency(capped.tokens(total), 4096)
    bfd = pack_best_fit_decreasing(total, 4096, image_tokens=image, image_budget=budget)
    assert eff >= 0.95 and eff > packing_efficiency(bfd.tokens(total), 4096)


def test_vision_budget_names_the_sample_over_it() -> None:
    with pytest.raises(
        ValueError, match=r"position 1 has 50 image tokens.*max_image_tokens_per_pack=40"
    ):
        pack_greedy(
            np.array([10, 60, 5]), 64, image_tokens=np.array([0, 50, 0]), max_image_tokens=40
        )
    with pytest.raises(ValueError, match="needs `image_tokens`"):
        pack_greedy(np.array([10]), 64, max_image_tokens=40)
