"""The order of an epoch's packs: no trend in image tokens through the epoch (issue 25).

The greedy packer emits the packs of a window ordered by their content (the image-heavy ones
last), so a rank that trained its packs in emission order would drift through every window and
the epoch: a curriculum nobody asked for, and a step cost that climbs. The plan trains each
rank's packs in a random order seeded by ``(seed, epoch, rank)``; these tests check that a pack's
position says nothing about its image tokens, and that the order changes nothing else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lightning_vlmbalance import (
    PackingConfig,
    PackingSampler,
    build_epoch_plan,
)
from lightning_vlmbalance.packing.plan import PADDING, _plan_in_packing_order
from lightning_vlmbalance.synthetic import (
    LengthTable,
    read_length_csv,
    resample_text_share,
    synthetic_length_table,
)

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
SHARED_MIX = (
    "omnibal/docvqa_train_10k.csv",
    "omnibal/synthdog_en.csv",
    "multipack/openchat_text.csv",
)
MAX_RANK_CORRELATION = 0.1  # |Spearman| between a pack's position and its image tokens
MAX_TENTH_DEVIATION = 0.15  # of a tenth's mean image tokens per pack from the epoch's mean


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks of ``x`` (0-based), ties sharing their mean rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (first + (counts - 1) / 2)[inverse]


def _drift(plan, image_tokens: np.ndarray, rank: int) -> tuple[float, np.ndarray]:
    """Spearman correlation of position and image tokens over ``rank``'s real packs, and each
    tenth's mean image tokens per pack relative to the epoch's mean (1 = no drift)."""
    packs = zip(plan.rank_packs[rank], plan.rank_pack_ids[rank])
    image = np.array([image_tokens[p].sum() for p, i in packs if i >= 0], dtype=np.float64)
    rho = float(np.corrcoef(_ranks(np.arange(len(image))), _ranks(image))[0, 1])
    tenths = np.array([part.mean() for part in np.array_split(image, 10)]) / image.mean()
    return rho, tenths


def _assert_no_drift(table: LengthTable, config: PackingConfig, num_replicas: int) -> None:
    plan = build_epoch_plan(
        table.total_tokens, table.image_tokens, config, num_replicas=num_replicas, epoch=0
    )
    rho, tenths = _drift(plan, table.image_tokens, rank=0)
    assert abs(rho) < MAX_RANK_CORRELATION, f"rank correlation {rho:.3f}, tenths {tenths}"
    assert np.abs(tenths - 1).max() < MAX_TENTH_DEVIATION, f"tenths {tenths.round(3)}"


def test_no_image_token_trend_on_the_shared_mix() -> None:
    """On the shared document-VQA + synthetic-document + chat-text mix (text share 0.3, 8,192-
    token packs, 8 ranks, rank 0, epoch 0), a pack's position has no rank correlation with its
    image tokens (|rho| < 0.1) and every tenth of the epoch is within 15% of the epoch's mean."""
    files = [SHARED_DATA / name for name in SHARED_MIX]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"the shared length tables are absent: {', '.join(missing)}")
    table = resample_text_share(read_length_csv(*files), 0.3, seed=0)
    _assert_no_drift(table, PackingConfig(seq_len=8192), num_replicas=8)


def test_no_image_token_trend_on_a_synthetic_table() -> None:
    """The same on a synthetic multimodal table (40,000 samples, 8 ranks: about 660 packs each),
    which always runs."""
    table = synthetic_length_table(40_000, text_share=0.3, seed=0)
    _assert_no_drift(table, PackingConfig(seq_len=8192), num_replicas=8)


def _small_table(n: int = 3000, seed: int = 0) -> LengthTable:
    return synthetic_length_table(n, text_share=0.2, tile_tokens=16, max_text_tokens=200, seed=seed)


def _rank_multisets(plan) -> list[list[tuple]]:
    return [
        sorted((i, tuple(p.tolist())) for i, p in zip(ids, packs))
        for ids, packs in zip(plan.rank_pack_ids, plan.rank_packs)
    ]


@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("packer", ["greedy", "bfd"])
def test_order_changes_only_the_order(remainder: str, packer: str) -> None:
    """Shuffling the order keeps every rank's packs (samples and ids), its pack count, the
    padding packs last, the moved, dropped and padding counts, the tokens and the packing
    efficiency of the plan in packing order; only the order differs."""
    t = _small_table()
    for seed, epoch, world_size in [(0, 0, 1), (3, 1, 4), (11, 2, 7), (5, 0, 8)]:
        config = PackingConfig(
            seq_len=512, seed=seed, window=300, remainder=remainder, packer=packer
        )
        args = (t.total_tokens, t.image_tokens, config)
        plan = build_epoch_plan(*args, num_replicas=world_size, epoch=epoch)
        packed = _plan_in_packing_order(*args, num_replicas=world_size, epoch=epoch)
        assert _rank_multisets(plan) == _rank_multisets(packed)
        assert plan.packs_per_rank == packed.packs_per_rank
        assert [len(p) for p in plan.rank_packs] == [len(p) for p in packed.rank_packs]
        for ids, packed_ids in zip(plan.rank_pack_ids, packed.rank_pack_ids):
            real = sum(i != PADDING for i in ids)
            assert all(i == PADDING for i in ids[real:])  # padding last, as in packing order
            assert ids[real:] == packed_ids[real:]
        assert np.array_equal(plan.pack_tokens, packed.pack_tokens)
        assert plan.efficiency == packed.efficiency
        assert (plan.moved_packs, plan.padding_packs) == (packed.moved_packs, packed.padding_packs)
        assert np.array_equal(plan.dropped_sample_ids, packed.dropped_sample_ids)
        assert plan.rank_pack_ids != packed.rank_pack_ids  # the order did change


def test_shuffle_false_keeps_packing_order() -> None:
    """``PackingConfig(shuffle=False)`` shuffles nothing: every rank trains its packs in packing
    order, as before the order was shuffled."""
    t = _small_table()
    config = PackingConfig(seq_len=512, shuffle=False, window=300)
    args = (t.total_tokens, t.image_tokens, config)
    plan = build_epoch_plan(*args, num_replicas=4, epoch=1)
    packed = _plan_in_packing_order(*args, num_replicas=4, epoch=1)
    assert plan.rank_pack_ids == packed.rank_pack_ids
    for packs, packed_packs in zip(plan.rank_packs, packed.rank_packs):
        assert all(np.array_equal(a, b) for a, b in zip(packs, packed_packs))


def test_every_rank_computes_the_same_order() -> None:
    """The order is a pure function of the length table, the seed and the epoch: the sampler of
    every rank computes the same plan, and yields its own rank's packs in that plan's order."""
    t = _small_table()
    world = 4
    samplers = [
        PackingSampler(
            t.total_tokens,
            t.image_tokens,
            seq_len=512,
            seed=3,
            window=300,
            num_replicas=world,
            rank=r,
        )
        for r in range(world)
    ]
    for epoch in (0, 1):
        plans = []
        for r, sampler in enumerate(samplers):
            sampler.set_epoch(epoch)
            plan = sampler.plan()
            plans.append(plan.rank_pack_ids)
            assert list(sampler) == [p.tolist() for p in plan.rank_packs[r]]
        assert all(ids == plans[0] for ids in plans)
    # the plan in the sampler is the pure function's
    plan = build_epoch_plan(
        t.total_tokens, t.image_tokens, samplers[0].config, num_replicas=world, epoch=1
    )
    assert plan.rank_pack_ids == plans[0]
