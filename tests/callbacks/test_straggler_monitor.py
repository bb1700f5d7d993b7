"""StragglerMonitor in real Lightning fits (subprocesses), read back from TensorBoard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_vlmbalance.timing import PHASES
from tests.launch import run_module

DELAY_MS = 40.0


def _run(out: Path, *args: str) -> None:
    run_module("tests.callbacks.straggler_job", "--out", str(out), *args)


def _events(out: Path) -> EventAccumulator:
    acc = EventAccumulator(str(out / "tb" / "run" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _series(acc: EventAccumulator, tag: str) -> np.ndarray:
    return np.array([e.value for e in acc.Scalars(tag)])


@pytest.mark.parametrize(("accumulate", "extra"), [(1, ()), (4, ("--val-sleep-ms", "100"))])
def test_slow_rank_is_found_and_the_other_waits(tmp_path: Path, accumulate: int, extra) -> None:
    """Rank 1 sleeps 40 ms in every vision forward: it is the worst rank, its vision_fwd is longer
    by the delay per micro-batch, and rank 0 waits about delay x micro-batches per step. With 4
    micro-batches, rank 1 is also slow in validation (between steps): that is not training wait."""
    _run(tmp_path, "--accumulate", str(accumulate), "--delay-ms", str(DELAY_MS), *extra)
    acc = _events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    for phase in (*PHASES, "step"):
        for r in (0, 1):
            assert f"straggler/{phase}_ms/rank_{r}" in tags
    worst = _series(acc, "straggler/worst_rank")
    assert len(worst) >= 5 and (worst == 1).mean() >= 0.9
    per_step = DELAY_MS * accumulate
    vision = _series(acc, "straggler/vision_fwd_ms/rank_1") - _series(
        acc, "straggler/vision_fwd_ms/rank_0"
    )
    # the sleep is a lower bound of rank 1's vision time; rank 0's own compute varies by a few ms
    assert np.median(vision) >= 0.95 * per_step and vision.min() >= 0.8 * per_step, vision
    wait0 = _series(acc, "straggler/sync_wait_ms/rank_0") + _series(
        acc, "straggler/lightning_sync_ms/rank_0"
    )
    assert abs(np.median(wait0) - per_step) <= 0.25 * per_step, wait0
    waste = _series(acc, "straggler/waste_frac")
    assert ((waste > 0) & (waste < 1)).all()
    assert (_series(acc, "straggler/max_over_median") >= 1).all()

    # the custom-scalars layout is in the event file and its regexes match the written tags
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(config)
    charts = {c.title: c for cat in layout.category for c in cat.chart}
    for phase in (*PHASES, "step"):
        (regex,) = charts[f"{phase}_ms"].multiline.tag
        matched = {t for t in tags if re.fullmatch(regex, t)}
        assert matched == {f"straggler/{phase}_ms/rank_{r}" for r in (0, 1)}

    # raw per-step JSON lines on every rank, one line per optimizer step
    for r in (0, 1):
        lines = tmp_path / "tb" / "run" / "version_0" / "straggler" / f"rank_{r}.jsonl"
        rows = [json.loads(x) for x in lines.read_text().splitlines()]
        assert [row["global_step"] for row in rows] == list(range(1, 13))
        row = rows[-1]
        assert row["rank"] == r and row["world_size"] == 2 and row["micro_batches"] == accumulate
        assert set(row["phases_ms"]) == set(PHASES)
        assert len(row["micro"]) == accumulate
        micro = row["micro"][0]
        assert {"pack_id", "total_tokens", "image_tokens", "vision_fwd_ms"} <= set(micro)
        assert (
            abs(sum(m["vision_fwd_ms"] for m in row["micro"]) - row["phases_ms"]["vision_fwd"])
            < 1e-2
        )
        assert sum(row["phases_ms"].values()) <= row["step_ms"] + 1e-6
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["slowest_rank"] == 1 and summary["steps_timed"] == 12
    if extra:  # rank 0 waited for rank 1's validation before the steps that followed it
        rows = [
            json.loads(x)
            for x in (tmp_path / "tb" / "run" / "version_0" / "straggler" / "rank_0.jsonl")
            .read_text()
            .splitlines()
        ]
        after_val = [r["between_steps_ms"] for r in rows if r["global_step"] % 2 == 1][1:]
        assert min(after_val) >= 150, after_val


def test_single_device_logs_phases_without_waits(tmp_path: Path) -> None:
    _run(tmp_path, "--devices", "1", "--delay-ms", "0", "--max-steps", "4")
    acc = _events(tmp_path)
    assert _series(acc, "straggler/llm_fwd_ms/rank_0").min() > 0
    assert (_series(acc, "straggler/sync_wait_ms/rank_0") == 0).all()
    assert (_series(acc, "straggler/lightning_sync_ms/rank_0") == 0).all()
    assert (_series(acc, "straggler/waste_frac") == 0).all()


def test_totals_survive_checkpoint_and_resume(tmp_path: Path) -> None:
    """Totals continue after a resume; the resumed run times whole steps of 4 micro-batches."""
    first, second = tmp_path / "a", tmp_path / "b"
    common = ("--delay-ms", "10", "--accumulate", "4")
    _run(first, "--max-steps", "3", *common)
    _run(second, "--max-steps", "5", "--resume", str(first / "last.ckpt"), *common)
    a = json.loads((first / "summary.json").read_text())
    b = json.loads((second / "summary.json").read_text())
    assert a["steps_timed"] == 3 and b["steps_timed"] == 5
    assert all(y > x for x, y in zip(a["busy_ms_per_rank"], b["busy_ms_per_rank"]))
    rows = [
        json.loads(x)
        for x in (second / "tb" / "run" / "version_0" / "straggler" / "rank_0.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [(r["global_step"], r["micro_batches"]) for r in rows] == [(4, 4), (5, 4)]


def test_user_comm_hook_stays_off_on_cpu(tmp_path: Path) -> None:
    """Lightning registers a strategy's comm hook only on CUDA; the monitor must not switch the
    user's hook on (it would change the gradients): here the hook raises if it is ever called."""
    _run(tmp_path, "--user-hook", "--max-steps", "3", "--delay-ms", "0")
