"""benchmarks/preemption.py runs one trial end to end and prints the promised JSON (any timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of

ROW_KEYS = {
    "strategy",
    "mode",
    "target",
    "trials",
    "stopped_10s",
    "median_stop_s",
    "max_stop_s",
    "hung",
    "sigterm_all",
    "exceptions",
    "thread_left",
    "no_exit_file",
    "rank0_returncodes",
    "exit_status",
}


def _argv(keep: Path) -> list[str]:
    args = "--trials 1 --strategies vlmbalance --modes overlap --target both --cap-s 15 --json"
    return ["benchmarks/preemption.py", *args.split(), "--keep", str(keep)]


@pytest.mark.smoke_run("preemption", argv=_argv, timeout=300, seconds=17)
def test_preemption_benchmark_one_trial(smoke_runs) -> None:
    run = result_of(smoke_runs, "preemption")  # a smoke run (tests/benchmarks/conftest.py)
    out, tmp_path = run.proc, run.out
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"command", "date", "machine", "cap_s", "rows", "trials"} <= set(report)
    (row,) = report["rows"]
    assert set(row) == ROW_KEYS
    assert (row["strategy"], row["mode"], row["target"], row["trials"]) == (
        "vlmbalance",
        "overlap",
        "both",
        1,
    )
    assert row["stopped_10s"] + row["hung"] <= 1
    (trial,) = report["trials"]
    assert trial["config"] == "vlmbalance-overlap-both"
    assert (
        set(trial["stop_s"]) == set(trial["exceptions"]) == set(trial["exit_status"]) == {"0", "1"}
    )
    assert 0.0 <= trial["delay_s"] < 2.0
    assert (tmp_path / "vlmbalance-overlap-both-0" / "pid1.json").exists()
