"""`strategy="fsdp_vlmbalance"` (FSDP2 through Lightning's ModelParallelStrategy) in real 2-process
CPU fits: the parameters equal plain FSDP2's, the parameters are sharded, packs change rank,
every sample once per epoch, resume from a sharded checkpoint, a failing rank stops the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vlmbalance as vb
from harness.jobs import check, result, selected
from tests.balance.fits import fit_result as _result
from tests.balance.fits import job as _job
from tests.balance.fits import max_rel_diff as _max_rel_diff
from tests.balance.fits import packs as _packs
from tests.balance.strategy_job import THEN, run_fits
from tests.launch import run_nodes

# 300 samples: 14 optimizer steps of 3 micro-batches per rank in the epoch; dense MLPs (tensor
# parallelism splits them; MoE under FSDP: test_every_callback_composes)
EPOCH = ("--samples", "300", "--epochs", "1", "--max-steps", "-1", "--accumulate", "3", "--dense")
FSDP = ("--strategy", "fsdp_vlmbalance")
# the multi-node fits and their 4-rank reference: into the second epoch
NODES_STEPS = ("--samples", "300", "--max-steps", "8", "--accumulate", "3", "--dense")


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict:
    """The single-node jobs of this module's selected tests (``@pytest.mark.jobs``), two at a
    time: one epoch each of plain FSDP2 and fsdp_vlmbalance in every mode (float64), the resumes
    from their step-4 checkpoints (``after``), a failing rank, every callback, and tensor
    parallelism on 4 processes (after plain DDP on 4 ranks, the multi-node runs' reference, in
    the same launch)."""
    root = tmp_path_factory.mktemp("fsdp_fits")
    every4 = ("--checkpoint-every", "4")

    def step4(name: str) -> str:
        return str(root / name / "ckpt" / "step=4.ckpt")

    args = {  # the longest first
        "ddp4": ("--strategy", "ddp", "--devices", "4", *NODES_STEPS),
        "tp": (*FSDP, *EPOCH, "--tp", "2", "--devices", "4"),
        "fsdp": ("--strategy", "fsdp", *EPOCH, *every4),
        "overlap": (*FSDP, "--mode", "overlap", *EPOCH, *every4),
        "off": (*FSDP, "--mode", "off", *EPOCH),
        "no_sync_accumulation": (*FSDP, "--no-sync-accumulation", *EPOCH),
        "callbacks": (
            *(*FSDP, "--all-callbacks", "--precision", "32-true"),
            *("--max-steps", "4", "--accumulate", "2"),
        ),
        "fail": (*FSDP, "--fail-rank", "1", "--fail-at", "3", "--exchange-timeout-s", "10"),
        "resumed_overlap": (*FSDP, *EPOCH, "--resume", step4("overlap")),
        "resumed_fsdp": ("--strategy", "fsdp", *EPOCH, "--resume", step4("fsdp")),
    }
    after = {"resumed_overlap": ["overlap"], "resumed_fsdp": ["fsdp"]}
    procs = run_fits(
        {name: _job(root / name, *a) for name, a in selected(request, args, after).items()},
        # fits of one launch run one after the other in the same processes (process start-up
        # is much of a fit's time): a reference first, the resumes in fresh processes, the
        # failing job alone, every callback after the fits it could disturb
        [
            ("fsdp", "overlap"),
            ("ddp4", "tp"),
            ("off", "no_sync_accumulation", "callbacks"),
            ("fail",),
            ("resumed_fsdp", "resumed_overlap"),
        ],
        after=after,
        timeouts={"fail": 240},  # a hang runs into it: an error of the test
    )
    return {"root": root, "procs": procs}


def _fit_of(jobs: dict, name: str) -> dict:
    check(result(jobs["procs"], name))
    return _result(jobs["root"] / name)


# "sync" runs the code of "overlap" in line (tests/balance/test_strategy.py covers it under DDP)
FITS = ("fsdp", "overlap", "off", "no_sync_accumulation")


@pytest.fixture(scope="module")
def fits(jobs) -> dict:
    """One epoch each of plain FSDP2 and fsdp_vlmbalance in every mode, float64."""
    return {"root": jobs["root"], **{name: _fit_of(jobs, name) for name in FITS}}


@pytest.mark.jobs(*FITS)
@pytest.mark.parametrize("mode", ["overlap", "off", "no_sync_accumulation"])
def test_same_parameters_as_plain_fsdp(fits, mode) -> None:
    """Float64, accumulation 3, 2 ranks: every mode ends with plain FSDP2's parameters, which
    really are sharded (DTensors), while packs changed rank."""
    run, plain = fits[mode], fits["fsdp"]
    steps = plain[0]["optimizer_steps"]
    assert steps >= 10 and run[0]["optimizer_steps"] == steps
    assert run[0]["dtensor_params"] > 0 and plain[0]["dtensor_params"] > 0
    assert _max_rel_diff(run["params"], plain["params"]) < 1e-10
    assert _packs(run) == _packs(plain)
    assert run[0]["objective"] == "microstep"  # FSDP meets at every micro-batch
    # the reduce-scatter was skipped in the accumulating micro-batches only where asked
    assert (run[0]["gradient_sync_skips"] > 0) == (mode == "no_sync_accumulation")
    moved = sum(s["moved_packs"] for s in run[0]["stats"])
    if mode == "off":
        assert moved == 0
    else:
        assert moved > 0, f"{mode}: nothing changed rank, the test would prove nothing"


@pytest.mark.jobs(*FITS)
@pytest.mark.parametrize("mode", ["overlap", "off"])
def test_every_sample_once_per_epoch(fits, mode) -> None:
    ids = sorted(
        s for r in (0, 1) for _, _, sample_ids in fits[mode][r]["seen"] for s in sample_ids
    )
    assert ids == list(range(300))


@pytest.mark.jobs(*FITS, "resumed_overlap", "resumed_fsdp")
def test_resume_from_a_sharded_checkpoint(fits, jobs) -> None:
    """Stop after step 4, resume from its distributed checkpoint (a folder of shards): the same
    packs in the same places as the uninterrupted run, and plain FSDP2's parameters resumed the
    same way."""
    ckpt = fits["root"] / "overlap" / "ckpt" / "step=4.ckpt"
    assert ckpt.is_dir() and any(ckpt.iterdir())  # sharded, not one file
    resumed = _fit_of(jobs, "resumed_overlap")
    for r in (0, 1):  # 4 optimizer steps x 3 micro-batches were done before the checkpoint
        assert resumed[r]["seen"] == fits["overlap"][r]["seen"][4 * 3 :]
    plain = _fit_of(jobs, "resumed_fsdp")
    assert _max_rel_diff(resumed["params"], plain["params"]) < 1e-10


@pytest.mark.jobs("fail")
def test_a_rank_failing_in_its_exchange_stops_every_rank(jobs) -> None:
    """Rank 1 raises inside its exchange: the job stops, no hang (a hang runs into the
    job's timeout, an error of the test)."""
    proc = result(jobs["procs"], "fail")
    assert not proc.timed_out and proc.returncode != 0
    assert "failed on purpose" in proc.stderr or "ExchangeError" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.jobs("callbacks")
def test_every_callback_composes(jobs) -> None:
    """StragglerMonitor, ActivationOffload and CompiledMoERouting with fsdp_vlmbalance."""
    run = _fit_of(jobs, "callbacks")
    assert run[0]["optimizer_steps"] == 4
    assert all(torch.isfinite(v.float()).all() for v in run["params"].values())
    lines = [
        json.loads(line)
        for path in sorted((jobs["root"] / "callbacks" / "straggler").glob("rank_*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert {line["rank"] for line in lines} == {0, 1}
    phases = lines[-1]["phases_ms"]
    for phase in ("data", "vision_fwd", "llm_fwd", "backward", "optimizer", "lightning_sync"):
        assert phase in phases
    # FSDP's collectives run inside forward and backward: no DDP hook times them
    assert all(line["phases_ms"]["sync_wait"] == 0 for line in lines)


@pytest.mark.jobs("fsdp", "tp")
def test_tensor_parallel_ranks_compute_the_same_packs(jobs) -> None:
    """Data-parallel 2 x tensor-parallel 2 on 4 processes (DTensor on gloo): each
    tensor-parallel pair trains the same packs, plans and exchanges run among the data-parallel
    peers (packs move), and the parameters equal plain FSDP2 on 2 data-parallel ranks (the same
    global batches, the MLPs split across the pair)."""
    run, plain = _fit_of(jobs, "tp"), _fit_of(jobs, "fsdp")
    out = jobs["root"] / "tp"
    seen = [json.loads((out / f"rank{r}.json").read_text())["seen"] for r in range(4)]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    stats = json.loads((out / "stats0.json").read_text())
    assert sum(s["moved_packs"] for s in stats["stats"]) > 0
    assert stats["dtensor_params"] > 0
    assert _max_rel_diff(run["params"], plain["params"]) < 1e-10


@pytest.fixture(scope="module")
def four_rank_ddp(jobs) -> Path:
    """Plain DDP on 4 ranks of one node: the multi-node runs' reference (in the launch of the
    tensor-parallel fit, also 4 processes)."""
    check(result(jobs["procs"], "ddp4"))
    return jobs["root"] / "ddp4"


NODE_STRATEGIES = ["vlmbalance", "fsdp_vlmbalance"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """One launch of 2 nodes x 2 ranks that fits with each strategy in turn (the second fit in
    the processes the first started): ``root / strategy``."""
    root = tmp_path_factory.mktemp("two_nodes")
    fits = [
        _job(root / s, "--strategy", s, "--num-nodes", "2", *NODES_STEPS) for s in NODE_STRATEGIES
    ]
    run_nodes(fits[0][0], *fits[0][1:], *(a for f in fits[1:] for a in (THEN, *f[1:])))
    return root


@pytest.mark.jobs("ddp4")
@pytest.mark.parametrize("strategy", NODE_STRATEGIES)
def test_two_nodes_of_two_ranks(strategy, four_rank_ddp, two_nodes) -> None:
    """num_nodes=2 x devices=2 (Lightning's multi-node environment variables, one process per
    node starting its local ranks): plans and moves use global ranks; the parameters equal plain
    DDP on 4 ranks of one node, the same samples once per epoch, and packs changed rank."""
    baseline, out = four_rank_ddp, two_nodes / strategy
    ref, run = torch.load(baseline / "params.pt"), torch.load(out / "params.pt")
    assert _max_rel_diff(run, ref) < 1e-10
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["world_size"] == 4 for r in ranks)
    ref_ranks = [json.loads((baseline / f"rank{r}.json").read_text()) for r in range(4)]
    for epoch in (0, 1):  # 8 steps run into the second epoch
        ids = [s for r in ranks for e, _, sample_ids in r["seen"] if e == epoch for s in sample_ids]
        assert len(ids) == len(set(ids))
        ref_ids = [
            s for r in ref_ranks for e, _, sample_ids in r["seen"] if e == epoch for s in sample_ids
        ]
        assert sorted(ids) == sorted(ref_ids)
    stats = json.loads((out / "stats0.json").read_text())
    assert sum(s["moved_packs"] for s in stats["stats"]) > 0


def test_registered_by_name() -> None:
    assert "fsdp_vlmbalance" in StrategyRegistry
    strategy = StrategyRegistry.get("fsdp_vlmbalance")
    assert isinstance(strategy, vb.FSDPVLMBalanceStrategy)
    assert strategy.config.objective == "microstep"
    with pytest.raises(ValueError, match="either in the config or as arguments"):
        vb.FSDPVLMBalanceStrategy(config=vb.RebalanceConfig(), mode="sync")


def test_tensor_parallel_size_must_divide_the_ranks() -> None:
    strategy = vb.FSDPVLMBalanceStrategy(tensor_parallel_size=3)
    strategy.num_nodes = 1
    strategy.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="does not divide the 2 ranks"):
        strategy.setup_environment()
