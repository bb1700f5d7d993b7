"""Lightning Fabric: a 2-rank Fabric loop over the package's packed loader, timed by
``FabricStragglerMonitor`` (every sample once; the slow rank found, the other one waiting for
it; JSON lines and TensorBoard scalars read back), and the Trainer-only strategy names refused in
Fabric with the reason. No timing is asserted beyond which rank waits."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_vlmbalance  # noqa: F401  (registers the names)
from tests.launch import run_module


def test_a_fabric_loop_trains_packs_and_records_the_straggler(tmp_path: Path) -> None:
    run_module(
        "tests.fabric_job",
        *("--out", str(tmp_path), "--slow-rank", "1", "--sleep-ms", "40"),
        timeout=600,
    )
    result = json.loads((tmp_path / "result.json").read_text())
    seen = result["seen"]
    assert sorted(seen[0] + seen[1]) == list(range(160))  # every sample once over both ranks
    steps, summary = result["steps"], result["summary"]
    # the loader weighed each optimizer step (2 packs per rank) over both ranks: the weights
    # times the loss tokens sum to R x A = 4 (the loop divides by A, DDP averages over R: the
    # gradient of the global batch's token mean)
    assert len(result["step_share"]) == steps
    assert all(abs(x - 4.0) < 1e-9 for x in result["step_share"]), result["step_share"]
    assert summary["steps_timed"] == steps >= 4
    # rank 1 sleeps 40 ms in every forward: it is the slowest, and rank 0 waits for it
    assert summary["slowest_rank"] == 1
    wait = summary["wait_ms_per_rank"]
    assert wait[0] > wait[1] and wait[0] > 0.5 * 40 * 2 * steps  # 2 forwards per step
    for rank in (0, 1):
        lines = (tmp_path / "straggler" / f"rank_{rank}.jsonl").read_text().splitlines()
        assert [json.loads(x)["global_step"] for x in lines] == list(range(1, steps + 1))
    (logs,) = (tmp_path / "fabric").glob("version_*")
    acc = EventAccumulator(str(logs))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for rank in (0, 1):
        assert len(acc.Scalars(f"straggler/step_ms/rank_{rank}")) >= steps // 4
    assert 0.5 < acc.Scalars("packing/efficiency")[-1].value <= 1.0, tags


def test_a_fabric_loop_balances_at_the_source(tmp_path: Path) -> None:
    """``PackingSampler(balance=...)`` in a Fabric loop: the global batches of the loop's
    micro-steps are formed at the source, every sample once, every step weighed."""
    run_module("tests.fabric_job", "--out", str(tmp_path), "--balance", timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    assert sorted(result["seen"][0] + result["seen"][1]) == list(range(160))
    assert result["formed"] > 0
    assert all(abs(x - 4.0) < 1e-9 for x in result["step_share"]), result["step_share"]


@pytest.mark.parametrize("name", ["vlmbalance", "fsdp_vlmbalance"])
def test_the_trainer_only_strategies_are_refused_in_fabric_by_name(name: str) -> None:
    with pytest.raises(
        ValueError,
        match=f"strategy='{name}'.*Trainer` only.*PackingSampler.*FabricStragglerMonitor",
    ):
        L.Fabric(accelerator="cpu", devices=1, strategy=name)


def test_a_loader_of_your_own_steps_is_not_also_given_a_trainer() -> None:
    import numpy as np

    import lightning_vlmbalance as vb

    sampler = vb.PackingSampler(np.full(4, 10), seq_len=32, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"micro_steps=2.*a loop of your own"):
        vb.PackedDataLoader(list(range(4)), sampler, micro_steps=2, trainer=None)
    with pytest.raises(ValueError, match="micro_steps=0"):
        vb.PackedDataLoader(list(range(4)), sampler, micro_steps=0)


def test_a_balanced_loader_of_your_own_steps_plans_them_before_the_first_step() -> None:
    """``len`` and a resume read the plan of the loop's micro-steps from the start (the loader
    told the balanced sampler only at the first step: ``len`` answered for one micro-step and a
    fresh loader refused its own state)."""
    import lightning_vlmbalance as vb
    from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table

    table = synthetic_length_table(37, tile_tokens=8, max_text_tokens=64, seed=5)

    def loader() -> vb.PackedDataLoader:
        sampler = vb.PackingSampler(
            table.total_tokens, table.image_tokens, seq_len=128, num_replicas=1, rank=0,
            balance=True,
        )  # fmt: skip
        data = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
        collate = vb.PackCollator(128, image_feature_shape=(8,))
        return vb.PackedDataLoader(data, sampler, collate, micro_steps=3)

    first = loader()
    told = len(first)
    batches = list(first)
    assert told == len(batches) and first.sampler.micro_steps == 3
    resumed = loader()
    resumed.load_state_dict(first.state_dict())  # the same settings: accepted
