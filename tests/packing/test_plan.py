"""The epoch plan: exactly-once coverage over ranks, equal pack counts, policies, determinism."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_vlmbalance import PackingConfig, build_epoch_plan
from lightning_vlmbalance.synthetic import synthetic_length_table


def _table(n: int = 2000, seed: int = 0, text_share: float = 0.2):
    return synthetic_length_table(
        n, text_share=text_share, tile_tokens=16, max_text_tokens=200, seed=seed
    )


def _digest(plan) -> tuple:
    return tuple(
        (tuple(ids), tuple(tuple(p.tolist()) for p in packs))
        for ids, packs in zip(plan.rank_pack_ids, plan.rank_packs)
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    world_size=st.integers(1, 8),
    seq_len=st.integers(200, 600),
    epoch=st.integers(0, 3),
    window=st.integers(1, 100),
    seed=st.integers(0, 2**31),
)
@example(n=61, world_size=1, seq_len=200, epoch=0, window=1, seed=1036899)  # a 201-token sample
def test_every_sample_exactly_once_and_equal_pack_counts(
    n, world_size, seq_len, epoch, window, seed
) -> None:
    """With remainder="pad", every sample is used exactly once per epoch over all ranks, every rank
    has the same number of packs, and no pack exceeds seq_len."""
    if n < world_size:
        return
    t = _table(n, seed=seed % 1000)
    # image samples can exceed 200 tokens (text part + image tokens, up to ~235 here): this test
    # is about every sample once, so every sample must fit (over-long policies are tested apart)
    seq_len = max(seq_len, int(t.total_tokens.max()))
    cfg = PackingConfig(seq_len=seq_len, seed=seed, window=window)
    plan = build_epoch_plan(
        t.total_tokens, t.image_tokens, cfg, num_replicas=world_size, epoch=epoch
    )
    assert len({len(p) for p in plan.rank_packs}) == 1
    assert np.array_equal(np.sort(plan.sample_ids()), np.arange(n))
    for packs in plan.rank_packs:
        for p in packs:
            assert t.total_tokens[p].sum() <= seq_len
    real = [i for ids in plan.rank_pack_ids for i in ids if i >= 0]
    assert sorted(real) == list(range(len(plan.pack_tokens)))  # pack ids unique
    assert plan.padding_packs == world_size * plan.packs_per_rank - len(real) < world_size


@settings(max_examples=40, deadline=None)
@given(n=st.integers(20, 400), world_size=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_drop_policy_counts_every_dropped_sample(n, world_size, seed) -> None:
    """With remainder="drop", used + dropped samples are all samples, each once."""
    t = _table(n, seed=seed % 1000)
    cfg = PackingConfig(seq_len=256, seed=seed, remainder="drop")
    try:
        plan = build_epoch_plan(
            t.total_tokens, t.image_tokens, cfg, num_replicas=world_size, epoch=0
        )
    except ValueError as e:  # fewer packs than ranks
        assert "remainder='pad'" in str(e)
        return
    assert plan.padding_packs == 0
    assert len({len(p) for p in plan.rank_packs}) == 1
    both = np.concatenate([plan.sample_ids(), plan.dropped_sample_ids])
    assert np.array_equal(np.sort(both), np.arange(n))
    assert plan.dropped_samples == len(plan.dropped_sample_ids)


def test_deterministic_per_seed_and_epoch() -> None:
    """Same (seed, epoch) gives the same plan; another epoch or seed gives another."""
    t = _table()
    cfg = PackingConfig(seq_len=512, seed=7)
    a = build_epoch_plan(t.total_tokens, t.image_tokens, cfg, num_replicas=4, epoch=1)
    b = build_epoch_plan(t.total_tokens, t.image_tokens, cfg, num_replicas=4, epoch=1)
    c = build_epoch_plan(t.total_tokens, t.image_tokens, cfg, num_replicas=4, epoch=2)
    d = build_epoch_plan(
        t.total_tokens, t.image_tokens, PackingConfig(seq_len=512, seed=8), num_replicas=4, epoch=1
    )
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c) and _digest(a) != _digest(d)


def _plan_in_process(queue: mp.Queue) -> None:
    t = _table()
    plan = build_epoch_plan(
        t.total_tokens, t.image_tokens, PackingConfig(seq_len=512, seed=7), num_replicas=4, epoch=3
    )
    queue.put(_digest(plan))


def test_same_plan_on_separate_processes() -> None:
    """Every rank computes the identical plan: check across freshly spawned interpreters."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_plan_in_process, args=(queue,)) for _ in range(2)]
    for p in procs:
        p.start()
    digests = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    t = _table()
    local = build_epoch_plan(
        t.total_tokens, t.image_tokens, PackingConfig(seq_len=512, seed=7), num_replicas=4, epoch=3
    )
    assert digests[0] == digests[1] == _digest(local)


def test_each_rank_reads_its_contiguous_shard() -> None:
    """Rank r computes samples of shard r, apart from the packs moved to even out counts."""
    t = _table(4000)
    plan = build_epoch_plan(
        t.total_tokens, t.image_tokens, PackingConfig(seq_len=512), num_replicas=4, epoch=0
    )
    bounds = np.linspace(0, 4000, 5).astype(int)
    for r, packs in enumerate(plan.rank_packs):
        ids = np.concatenate(packs)
        inside = ((ids >= bounds[r]) & (ids < bounds[r + 1])).mean()
        assert inside > 0.95
    assert plan.moved_packs < 4 * 4


def test_overlong_error_names_the_sample() -> None:
    total = np.array([100, 700, 50, 900])
    image = np.array([64, 0, 0, 0])
    with pytest.raises(ValueError, match=r"sample 1 has 700 tokens, more than `seq_len=512`"):
        build_epoch_plan(total, image, PackingConfig(seq_len=512), num_replicas=1, epoch=0)


def test_overlong_skip_counts_and_truncate_cuts_text_only() -> None:
    total = np.array([100, 700, 50, 900, 30])
    image = np.array([64, 0, 0, 0, 0])
    skip = build_epoch_plan(
        total, image, PackingConfig(seq_len=512, overlong="skip"), num_replicas=1, epoch=0
    )
    assert skip.skipped_sample_ids.tolist() == [1, 3]
    assert sorted(skip.sample_ids().tolist()) == [0, 2, 4]
    cut = build_epoch_plan(
        total, image, PackingConfig(seq_len=512, overlong="truncate"), num_replicas=1, epoch=0
    )
    assert cut.truncated_sample_ids.tolist() == [1, 3]
    assert sorted(cut.sample_ids().tolist()) == [0, 1, 2, 3, 4]


def test_truncate_never_cuts_an_image() -> None:
    """seq_len smaller than a single image: a clear error naming the sample, in every policy
    but skip."""
    total = np.array([100, 700])
    image = np.array([0, 650])
    with pytest.raises(ValueError, match="sample 1 has 700 tokens \\(650 image tokens\\)"):
        build_epoch_plan(
            total, image, PackingConfig(seq_len=512, overlong="truncate"), num_replicas=1, epoch=0
        )


@pytest.mark.parametrize(
    ("total", "image", "match"),
    [
        ([], [], "empty"),
        ([10, 0, 5], [0, 0, 0], "sample 1 has 0 tokens"),
        ([10, 5], [0, 6], "sample 1 has 6 image tokens but 5 tokens"),
        ([10, 5], [0], "equal length"),
    ],
)
def test_bad_length_table(total, image, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_epoch_plan(
            np.array(total), np.array(image), PackingConfig(seq_len=64), num_replicas=1, epoch=0
        )


def test_empty_shard_is_an_error() -> None:
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        build_epoch_plan(
            np.array([5, 5, 5]), np.zeros(3), PackingConfig(seq_len=64), num_replicas=4, epoch=0
        )


def test_shard_with_no_images_is_fine() -> None:
    total = np.array([40] * 10 + [30] * 10)
    image = np.array([32] * 10 + [0] * 10)  # the second shard is text only
    plan = build_epoch_plan(total, image, PackingConfig(seq_len=128), num_replicas=2, epoch=0)
    assert all(image[p].sum() == 0 for p in plan.rank_packs[1] if len(p))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overlong": "cut"}, "overlong='cut'"),
        ({"remainder": "wrap"}, "remainder='wrap'"),
        ({"packer": "ffd"}, "packer='ffd'"),
        ({"packer": "budget"}, "image_budget"),
        ({"seq_len": 0}, "seq_len=0"),
    ],
)
def test_bad_config_is_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        PackingConfig(**{"seq_len": 64, **kwargs})
