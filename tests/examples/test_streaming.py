"""The streaming main job (``examples/streaming.py``), small: one format on 2 CPU ranks, the
record of every record trained once, the resume reproducing the uninterrupted packs, and the
TensorBoard logs read back. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import run_module


def test_the_streaming_main_job_trains_every_record_once_and_resumes_the_same_packs(
    tmp_path,
) -> None:
    proc = run_module(
        "examples.streaming",
        *("--root", str(tmp_path), "--formats", "hf", "--samples", "400"),
        *("--seq-len", "256", "--checkpoint-at", "4"),
        timeout=600,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    summary = json.loads(line.removeprefix("SUMMARY_JSON "))
    (run,) = summary["runs"]
    assert run["format"] == "hf" and run["every_record_once"] and run["resume_reproduced"]
    assert run["resumed_micro_batches"] > 0 and run["bad_samples"] == 0
    assert 0.9 < run["packing_efficiency"] <= 1.0 and run["optimizer_steps"] > 4
    assert "| hf |" in proc.stdout and "same packs" in proc.stdout
    logs = Path(summary["dir"]) / "hf" / "full"
    acc = EventAccumulator(str(logs))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for rank in (0, 1):  # one line per rank
        assert f"straggler/step_ms/rank_{rank}" in tags
        assert len(acc.Scalars(f"straggler/step_ms/rank_{rank}")) > 0
    assert "balance/moved_packs" in tags
