"""benchmarks/trainer_battery.py runs its cheapest case end to end and prints the promised JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of

ROOT = Path(__file__).resolve().parents[2]
CASES = ("devices_1",)


def _argv(out: Path) -> list[str]:
    return ["-m", "benchmarks.trainer_battery", "--cases", ",".join(CASES), "--json"]


@pytest.mark.smoke_run(
    "trainer_battery", argv=_argv, env={"PYTHONPATH": str(ROOT)}, timeout=400, seconds=13
)
def test_trainer_battery_one_case(smoke_runs) -> None:
    """A real fit passes the battery's checks; the last line is one JSON object with a row per
    case and the counts."""
    out = result_of(smoke_runs, "trainer_battery").proc  # tests/benchmarks/conftest.py
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["name"] for row in report["cases"]] == list(CASES)
    for row in report["cases"]:
        assert set(row) == {"name", "status", "seconds", "reason"}
        assert row["status"] == "PASS", row
        assert isinstance(row["seconds"], float) and isinstance(row["reason"], str)
    assert (report["passed"], report["failed"], report["hung"]) == (1, 0, 0)
