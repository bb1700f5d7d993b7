"""benchmarks/encoder_planning.py runs end to end on a CSV and reports what its docstring
promises: one row per configuration, the plan between the bound and leaving images at home."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.jobs import result_of
from tests.benchmarks.scripts import mix_csv

FIELDS = {
    "mix",
    "dp",
    "ga",
    "waste_off",
    "waste_planned",
    "waste_bound",
    "moved_fraction",
    "images_per_rank",
    "plan_ms",
    "plan_ms_per_global_batch",
    "order_ms",
    "failures",
    "packing_efficiency",
    "per_call_ms",
}


def _argv(tmp: Path) -> list[str]:
    return [
        "benchmarks/encoder_planning.py",
        *("--data", str(mix_csv(tmp, 6000)), "--text-share", "0.3"),
        *("--dp", "4", "--ga", "1,2", "--batches", "2", "--json"),
    ]


@pytest.mark.smoke_run("encoder_planning", argv=_argv, timeout=300, seconds=5)
def test_encoder_planning_benchmark_on_a_csv(smoke_runs) -> None:
    out = result_of(smoke_runs, "encoder_planning").proc  # a smoke run (tests/smoke_runs.py)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sources"] == {"mix": ["mix.csv"]}
    assert result["text_share"] == 0.3 and result["batches"] == 2
    assert [(row["mix"], row["dp"], row["ga"]) for row in result["rows"]] == [
        ("mix", 4, 1),
        ("mix", 4, 2),
    ]
    for row in result["rows"]:
        assert FIELDS <= row.keys()
        assert row["failures"] == []
        assert 0.0 <= row["waste_bound"] <= row["waste_planned"] + 1e-9
        assert row["waste_planned"] <= row["waste_off"] + 1e-9
        assert row["waste_off"] > 0.0  # the mix's images are uneven over 4 ranks
        assert 0.0 <= row["moved_fraction"] <= 1.0
        assert row["images_per_rank"] > 0.0
        for key in ("plan_ms", "plan_ms_per_global_batch", "order_ms"):
            assert math.isfinite(row[key]) and row[key] >= 0.0
        if row["ga"] == 1:  # one micro-step: nothing to order
            assert row["order_ms"] == 0.0
