"""benchmarks/trainer_battery.py runs its cheapest case end to end and prints the promised JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ("devices_1",)


def test_trainer_battery_one_case() -> None:
    """A real fit passes the battery's checks; the last line is one JSON object with a row per
    case and the counts."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer_battery", "--cases", ",".join(CASES), "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["name"] for row in report["cases"]] == list(CASES)
    for row in report["cases"]:
        assert set(row) == {"name", "status", "seconds", "reason"}
        assert row["status"] == "PASS", row
        assert isinstance(row["seconds"], float) and isinstance(row["reason"], str)
    assert (report["passed"], report["failed"], report["hung"]) == (1, 0, 0)
