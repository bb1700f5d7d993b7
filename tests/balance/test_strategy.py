"""`strategy="vlmbalance"` in real 2-process fits: same math, coverage, one sync per step."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vlmbalance as vb
from tests.launch import run_module, run_module_raw


def _fit(out: Path, *args: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run_module("tests.balance.strategy_job", "--out", str(out), *args, timeout=600)
    result = {"params": torch.load(out / "params.pt")}
    for r in (0, 1):
        if (out / f"rank{r}.json").exists():
            result[r] = {
                **json.loads((out / f"rank{r}.json").read_text()),
                **json.loads((out / f"stats{r}.json").read_text()),
            }
    return result


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-300)) for k in a)


def test_same_parameters_as_ddp_in_sync_and_overlap_modes(tmp_path) -> None:
    """Float64, GA 4, 20 optimizer steps: rebalancing changes where packs run, not the math."""
    ddp = _fit(tmp_path / "ddp", "--strategy", "ddp", "--global-tokens")
    for mode in ("sync", "overlap"):
        run = _fit(tmp_path / mode, "--strategy", "vlmbalance", "--mode", mode)
        assert _max_rel_diff(run["params"], ddp["params"]) < 1e-10, mode
        moved = sum(s["moved_packs"] for s in run[0]["stats"])
        assert moved > 0, f"{mode}: nothing was rebalanced, the test would prove nothing"
        # the same packs were trained on, in other places
        packs = lambda res: sorted(p for r in (0, 1) for _, p, _ in res[r]["seen"])  # noqa: E731
        assert packs(run) == packs(ddp)
        assert [s["moved_packs"] for s in run[0]["stats"]] == [
            s["moved_packs"] for s in run[1]["stats"]
        ]
        # one SIGTERM broadcast per optimizer step, not per micro-batch
        assert run[0]["broadcasts"] == run[0]["optimizer_steps"] == 20
        assert set(run[0]["logged"]) == {
            "balance/moved_packs",
            "balance/planned_waste_frac",
            "balance/exchange_ms",
            "balance/exposed_exchange_ms",
        }
    assert ddp[0]["broadcasts"] == 4 * 20  # plain DDP: every micro-batch


def test_every_sample_once_per_epoch_with_rebalancing(tmp_path) -> None:
    run = _fit(tmp_path, "--strategy", "vlmbalance", "--epochs", "1", "--max-steps", "-1")
    ids = sorted(s for r in (0, 1) for _, _, sample_ids in run[r]["seen"] for s in sample_ids)
    assert ids == list(range(600))
    assert sum(s["moved_packs"] for s in run[0]["stats"]) > 0


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path) -> None:
    """Kill after step 8, resume from its checkpoint: the same packs in the same places, and the
    same parameters as plain DDP resumed the same way.

    (A resumed float64 fit differs from the uninterrupted one by ~6e-8 relative under plain
    ``"ddp"`` too, with identical batches: a property of Lightning's resume, not of rebalancing.)
    """
    full = _fit(tmp_path / "full", "--strategy", "vlmbalance", "--checkpoint-every", "8")
    ckpt = tmp_path / "full" / "ckpt" / "step=8.ckpt"
    assert ckpt.exists(), sorted((tmp_path / "full" / "ckpt").iterdir())
    resumed = _fit(tmp_path / "resumed", "--strategy", "vlmbalance", "--resume", str(ckpt))
    for r in (0, 1):  # 8 optimizer steps x 4 micro-batches were done before the checkpoint
        assert resumed[r]["seen"] == full[r]["seen"][8 * 4 :]
    ddp_full = _fit(
        tmp_path / "ddp", "--strategy", "ddp", "--global-tokens", "--checkpoint-every", "8"
    )
    ddp_resumed = _fit(
        tmp_path / "ddp_resumed",
        "--strategy",
        "ddp",
        "--global-tokens",
        "--resume",
        str(tmp_path / "ddp" / "ckpt" / "step=8.ckpt"),
    )
    assert _max_rel_diff(full["params"], ddp_full["params"]) < 1e-10
    assert _max_rel_diff(resumed["params"], ddp_resumed["params"]) < 1e-10


def test_world_size_one_is_a_no_op(tmp_path) -> None:
    run = _fit(tmp_path, "--strategy", "vlmbalance", "--devices", "1", "--max-steps", "5")
    assert all(s["moved_packs"] == 0 for s in run[0]["stats"])


def test_registered_by_name() -> None:
    assert {"vlmbalance", "ddp_vlmbalance"} <= set(StrategyRegistry)
    for name in ("vlmbalance", "DDP_VLMBalance"):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, vb.VLMBalanceStrategy)
    trainer = L.Trainer(
        strategy=vb.VLMBalanceStrategy(mode="sync"), accelerator="cpu", devices=2, logger=False
    )
    assert trainer.strategy.mode == "sync" and trainer.strategy.resolved_objective == "step"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fast"}, "mode='fast'"),
        ({"objective": "speed"}, "objective='speed'"),
        ({"tolerance": -1}, "tolerance=-1"),
        ({"exchange_timeout_s": 0}, "exchange_timeout_s=0"),
    ],
)
def test_bad_settings_are_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        vb.VLMBalanceStrategy(**kwargs)


def test_loader_with_other_micro_steps_is_named(tmp_path) -> None:
    """A user-wrapped RebalancingLoader must agree with accumulate_grad_batches."""
    out = tmp_path / "mismatch"
    out.mkdir()
    proc = run_module_raw(
        "tests.balance.strategy_job",
        "--out",
        str(out),
        "--strategy",
        "vlmbalance",
        "--global-tokens",
        "--data-micro-steps",
        "3",
    )
    assert proc.returncode != 0
    assert "RebalancingLoader(micro_steps=3)" in proc.stderr
    assert "accumulate_grad_batches=4" in proc.stderr
