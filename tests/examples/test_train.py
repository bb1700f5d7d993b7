"""The main job: one invocation trains off, overlap and source on 2 CPU processes (gloo), prints
the comparison and a figure, and writes TensorBoard logs that we read back. No timing is
asserted: only the comparison's structure and what each mode trained."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from tests.launch import run_module

SMALL = ("--num-samples", "400", "--seq-len", "256", "--vision-dim", "64", "--vision-layers", "1")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> tuple[dict, str]:
    root = tmp_path_factory.mktemp("main_job")
    proc = run_module(
        "examples.train", "--root", str(root), "--no-progress-bar", *SMALL, timeout=600
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    return json.loads(line.removeprefix("SUMMARY_JSON ")), proc.stdout


def _scalars(log_dir: str) -> EventAccumulator:
    events = list(Path(log_dir).glob("events.out.tfevents.*"))
    assert events, log_dir
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return acc


def test_the_main_job_compares_the_modes_on_the_same_samples(main_job) -> None:
    summary, stdout = main_job
    modes = summary["modes"]
    assert list(modes) == ["off", "overlap", "source"] and summary["ranks"] == 2
    # every mode trains every sample once; off and overlap the same global batch at every step
    assert summary["same_samples"] and summary["same_global_batches"]
    for s in modes.values():
        assert s["optimizer_steps"] > 5 and s["steps_per_s"] > 0 and s["tokens_per_s"] > 0
        assert 0 <= s["waste_frac"] < 1 and 0 <= s["planned_waste"] < 1
        assert s["packing_efficiency"] > 0.9 and s["mean_loss"] > 0
        assert "gain_vs_off" in s and Path(s["log_dir"]).parent == Path(summary["log_dir"])
    assert modes["off"]["gain_vs_off"] == 0.0 and modes["off"]["moved_packs"] == 0
    assert modes["overlap"]["moved_packs"] > 0 and modes["overlap"]["bytes_exchanged"] > 0
    assert modes["source"]["source_balanced"] and modes["source"]["moved_packs"] == 0
    assert modes["source"]["bytes_exchanged"] == 0
    assert summary["best_mode"] in ("overlap", "source")
    # the cost model the balanced modes planned with was fitted on the off run's own logs
    assert "vision_fwd_ms" in summary["cost_model_fit"]
    assert (Path(summary["log_dir"]) / "cost_model.json").is_file()
    assert "Cost model fitted on the off run's StragglerMonitor logs" in stdout
    for mode in modes:
        assert re.search(rf"^\| {mode} \| \d+ \| ", stdout, re.M), mode
    figure = Path(summary["figure"])
    assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Figure (busy and vision time per rank, per mode): {figure}" in stdout


def test_every_mode_logs_to_tensorboard(main_job) -> None:
    summary, _ = main_job
    for mode, s in summary["modes"].items():
        acc = _scalars(s["log_dir"])
        tags = set(acc.Tags()["scalars"])
        assert {"train/loss", "packing/efficiency"} <= tags
        assert {f"straggler/step_ms/rank_{r}" for r in (0, 1)} <= tags
        if mode == "overlap":
            assert sum(e.value for e in acc.Scalars("balance/moved_packs")) > 0
        if mode == "source":
            assert "balance/source_balanced" in tags
    acc = _scalars(summary["modes"]["off"]["log_dir"])
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert len(loss) >= 3 and loss[-1] < loss[0]  # it learns
    # the monitor's custom-scalars layout has its "rebalancing" category, every chart matching
    acc = _scalars(summary["modes"]["overlap"]["log_dir"])
    tags = acc.Tags()["scalars"]
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(config)
    (category,) = [c for c in layout.category if c.title == "rebalancing"]
    for chart in category.chart:
        (regex,) = chart.multiline.tag
        assert any(re.fullmatch(regex, t) for t in tags), regex
