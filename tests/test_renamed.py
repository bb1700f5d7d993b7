"""Names renamed for one word per concept (docs/glossary.md) still work, with a FutureWarning.

``world_size`` is every process of the job; where it meant the data-parallel ranks it is now
``num_replicas`` (the sampler's word, torch's ``DistributedSampler``'s).
"""

from __future__ import annotations

import numpy as np
import pytest

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.planner import naive_moved_packs
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.synthetic import synthetic_length_table


def test_rebalancing_loader_world_size_is_num_replicas_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match=r"RebalancingLoader\(world_size=\.\.\.\)` is now"):
        old = RebalancingLoader([], micro_steps=2, world_size=1, rank=0)
    new = RebalancingLoader([], micro_steps=2, num_replicas=1, rank=0)
    assert old.num_replicas == new.num_replicas == 1 and type(old) is type(new)
    with pytest.warns(FutureWarning, match=r"RebalancingLoader.world_size` is now"):
        assert new.world_size == 1
    with pytest.raises(TypeError, match=r"world_size=\.\.\., num_replicas=\.\.\.\)`: give"):
        RebalancingLoader([], micro_steps=2, world_size=1, num_replicas=1, rank=0)


def test_the_plans_take_num_replicas_and_world_size_with_a_warning() -> None:
    table = synthetic_length_table(64, tile_tokens=8, max_text_tokens=64, seed=1)
    config = vb.PackingConfig(seq_len=256)
    args = (table.total_tokens, table.image_tokens, config)
    plan = vb.build_epoch_plan(*args, num_replicas=2, epoch=0)
    with pytest.warns(FutureWarning, match="build_epoch_plan"):
        old = vb.build_epoch_plan(*args, world_size=2, epoch=0)
    assert [[ids.tolist() for ids in r] for r in old.rank_packs] == [
        [ids.tolist() for ids in r] for r in plan.rank_packs
    ]
    assert plan.num_replicas == 2
    with pytest.warns(FutureWarning, match=r"EpochPlan.world_size` is now"):
        assert plan.world_size == 2
    cost, origin = np.array([9, 1, 1, 1]), np.array([0, 0, 1, 1])
    want = vb.plan_rebalance(cost, origin, num_replicas=2, micro_steps=2).assignment
    with pytest.warns(FutureWarning, match="plan_rebalance"):
        got = vb.plan_rebalance(cost, origin, world_size=2, micro_steps=2).assignment
    assert np.array_equal(want, got)
    with pytest.warns(FutureWarning, match="naive_moved_packs"):
        assert naive_moved_packs(cost, origin, world_size=2) == naive_moved_packs(cost, origin, 2)
