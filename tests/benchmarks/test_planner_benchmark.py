"""benchmarks/planner.py runs end to end on a CSV and reports what its docstring promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of
from tests.benchmarks.scripts import mix_csv


def _argv(tmp: Path) -> list[str]:
    return [
        "benchmarks/planner.py",
        *("--data", str(mix_csv(tmp, 6000)), "--text-share", "0.2", "--dp", "4,8", "--ga", "1,4"),
        *("--objective", "microstep,step,both", "--batches", "2", "--repeat", "1", "--json"),
    ]


@pytest.mark.smoke_run("planner", argv=_argv, timeout=300, seconds=5)
def test_planner_benchmark_on_a_csv(smoke_runs) -> None:
    out = result_of(smoke_runs, "planner").proc  # a smoke run (tests/smoke_runs.py)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["rows"]) == 2 * 2 * 3
    for row in result["rows"]:
        assert row["failures"] == []
        assert 0.0 <= row["waste_lower_bound"] <= row["waste_planned"] + 1e-9
        assert row["waste_planned"] <= row["waste_baseline"] + 1e-9
        if row["ga"] == 1:  # one pack per rank: nothing to rebalance
            assert row["moved_fraction"] == 0.0
        if row["objective"] != "step":
            assert row["moved_fraction"] <= row["moved_fraction_naive"]
