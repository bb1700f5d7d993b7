"""benchmarks/planner.py runs end to end on a CSV and reports what its docstring promises."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.jobs import result_of
from lightning_vlmbalance.synthetic import synthetic_length_table


def _argv(tmp: Path) -> list[str]:
    table = synthetic_length_table(6000, text_share=0.3, seed=0)
    csv = tmp / "mix.csv"
    rows = np.stack([table.total_tokens, table.image_tokens, table.images], axis=1)
    np.savetxt(
        csv, rows, fmt="%d", delimiter=",", header="total_tokens,image_tokens,images", comments=""
    )
    return [
        "benchmarks/planner.py",
        *("--data", str(csv), "--text-share", "0.2", "--dp", "4,8", "--ga", "1,4"),
        *("--objective", "microstep,step,both", "--batches", "2", "--repeat", "1", "--json"),
    ]


@pytest.mark.smoke_run("planner", argv=_argv, timeout=300, seconds=5)
def test_planner_benchmark_on_a_csv(smoke_runs) -> None:
    out = result_of(smoke_runs, "planner").proc  # a smoke run (tests/benchmarks/conftest.py)
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
