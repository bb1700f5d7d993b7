"""benchmarks/auto_sim.py runs end to end on a shared mix and reports what it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
AI2D = [
    SHARED_DATA / "omnibal" / "ai2d_train_12k.csv",
    SHARED_DATA / "multipack" / "openchat_text.csv",
]


def _argv(_: Path) -> list[str]:
    return [
        "benchmarks/auto_sim.py",
        *("--mixes", "ai2d", "--text-shares", "0.5", "--dp", "8", "--ga", "1,4"),
        *("--batches", "2", "--time-planning", "--json"),
    ]


@pytest.mark.smoke_run("auto_sim", argv=_argv, timeout=300, seconds=15)
def test_auto_sim_benchmark_on_a_shared_mix(smoke_runs) -> None:
    missing = [str(f) for f in AI2D if not f.is_file()]
    if missing:  # the script reads the shared mixes (beside the repository)
        pytest.skip(f"the shared length tables are absent: {', '.join(missing)}")
    out = result_of(smoke_runs, "auto_sim").proc  # a smoke run (tests/smoke_runs.py)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["summary"]
    assert len(rows) == 2 * 2  # two strategies x two micro-step counts
    for row in rows:
        # auto is priced by the functions every mode is priced by, on the same samples
        assert row["auto_vs_best"] >= 1 - 1e-9, row
        assert sum(row["auto_choices"].values()) >= 2 and row["choice_ms"] > 0
        if row["ga"] == 1 and not row["auto_at_source"]:  # the bound is below the step
            assert 0.0 <= row["auto_waste_vs_bound"] <= row["auto_waste"] + 1e-9
    assert result["auto_vs_best_min"] == min(r["auto_vs_best"] for r in rows)
