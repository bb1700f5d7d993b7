"""The main job: a real 2-process CPU DDP fit writing TensorBoard logs that we read back."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

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
    # the main job rebalances ("vlmbalance" strategy, overlap mode) and says what it moved
    assert summary["balance_mode"] == "overlap" and summary["moved_packs"] > 0
    assert "Rebalancing (overlap):" in proc.stdout
    assert {"balance/moved_packs", "balance/exposed_exchange_ms"} <= set(tags)
    moved = sum(e.value for e in acc.Scalars("balance/moved_packs"))
    assert moved > 0
    # ... and the monitor's custom-scalars layout shows them in its "rebalancing" category
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(config)
    (category,) = [c for c in layout.category if c.title == "rebalancing"]
    for chart in category.chart:
        (regex,) = chart.multiline.tag
        assert any(re.fullmatch(regex, t) for t in tags), regex
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert len(loss) >= 3
    assert loss[-1] < loss[0]  # it learns
    logged = acc.Scalars("packing/efficiency")[0].value
    assert abs(logged - summary["packing_efficiency"]) < 1e-4
