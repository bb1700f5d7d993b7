"""The Trainer battery (``tests/suites/trainer_battery.py``): its cheapest case end to end in the
default run, every case with ``pytest -m suite``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import check, result_of, run_jobs

MODULE = "tests.suites.trainer_battery"
CASES = ("devices_1",)


def _argv(out: Path) -> list[str]:
    return ["-m", MODULE, "--cases", ",".join(CASES), "--json"]


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.smoke_run("trainer_battery", argv=_argv, timeout=400, seconds=13)
def test_trainer_battery_one_case(smoke_runs) -> None:
    """A real fit passes the battery's checks; the last line is one JSON object with a row per
    case and the counts."""
    out = result_of(smoke_runs, "trainer_battery").proc  # a smoke run (tests/smoke_runs.py)
    assert out.returncode == 0, out.stderr[-3000:]
    report = _report(out.stdout)
    assert [row["name"] for row in report["cases"]] == list(CASES)
    for row in report["cases"]:
        assert set(row) == {"name", "status", "seconds", "reason"}
        assert row["status"] == "PASS", row
        assert isinstance(row["seconds"], float) and isinstance(row["reason"], str)
    assert (report["passed"], report["failed"], report["hung"]) == (1, 0, 0)


@pytest.mark.suite
@pytest.mark.timeout(5400)
def test_every_case_of_the_battery_passes() -> None:
    """Every case, as recorded in ``benchmarks/results/rebalancing.md`` (31 cases, about 10 min
    on 2 cores): none fails, none hangs."""
    job = check(run_jobs({"battery": (MODULE, "--json")}, parallel=1, timeout=5000)["battery"])
    report = _report(job.stdout)
    bad = [row for row in report["cases"] if row["status"] != "PASS"]
    assert not bad, json.dumps(bad, indent=1)
    assert (report["failed"], report["hung"]) == (0, 0)
    assert report["passed"] == len(report["cases"]) > 0
