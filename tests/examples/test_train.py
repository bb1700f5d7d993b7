"""The main job: a real 2-process CPU DDP fit writing TensorBoard logs that we read back."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import run_module


def test_main_job_trains_and_logs(tmp_path: Path) -> None:
    proc = run_module(
        "examples.train",
        "--root",
        str(tmp_path),
        "--num-samples",
        "600",
        "--epochs",
        "1",
        "--seq-len",
        "256",
        timeout=600,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    summary = json.loads(line.removeprefix("SUMMARY_JSON "))
    assert summary["ranks"] == 2
    assert summary["optimizer_steps"] == -(-summary["packs_per_rank"] // 2)
    assert summary["packing_efficiency"] > 0.95
    assert summary["tokens_per_s"] > 0
    # the main job runs the StragglerMonitor and names the slowest rank and the waste
    assert summary["slowest_rank"] in (0, 1) and 0 <= summary["waste_frac"] < 1
    assert "Stragglers: slowest rank" in proc.stdout
    events = list(Path(summary["log_dir"]).glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags and "packing/efficiency" in tags
    assert {f"straggler/step_ms/rank_{r}" for r in (0, 1)} <= set(tags)
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert len(loss) >= 3
    assert loss[-1] < loss[0]  # it learns
    logged = acc.Scalars("packing/efficiency")[0].value
    assert abs(logged - summary["packing_efficiency"]) < 1e-4
