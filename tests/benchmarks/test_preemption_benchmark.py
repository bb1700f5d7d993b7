"""benchmarks/preemption.py runs one trial end to end and prints the promised JSON (any timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
}


def test_preemption_benchmark_one_trial(tmp_path) -> None:
    args = "--trials 1 --strategies vlmbalance --modes overlap --target both --cap-s 15 --json"
    out = subprocess.run(
        [sys.executable, "benchmarks/preemption.py", *args.split(), "--keep", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
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
    assert set(trial["stop_s"]) == set(trial["exceptions"]) == {"0", "1"}
    assert 0.0 <= trial["delay_s"] < 2.0
    assert (tmp_path / "vlmbalance-overlap-both-0" / "pid1.json").exists()
