"""benchmarks/soak_exchange.py: a short soak passes its checks, and a dying rank is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of

SMOKE = ("--global-batches", "300", "--warmup", "50", "--sample-every", "50")


def _soak(*flags: str):
    """The arguments of a soak run (a smoke run of tests/benchmarks/conftest.py)."""

    def argv(out: Path) -> list[str]:
        return ["benchmarks/soak_exchange.py", "--ranks", "2", *flags, "--json"]

    return argv


def _result(smoke_runs: dict, name: str) -> tuple[int, dict, str]:
    out = result_of(smoke_runs, name).proc
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


# memory growth is measured by the long soak (benchmarks/results/rebalancing.md), not decided
# in this short one
@pytest.mark.smoke_run(
    "soak_short", argv=_soak(*SMOKE, "--max-rss-growth", "0.5"), timeout=300, seconds=10
)
def test_a_short_soak_passes_its_checks(smoke_runs) -> None:
    code, result, err = _result(smoke_runs, "soak_short")
    assert code == 0 and result["ok"], (err, result["failures"])
    assert result["moved_packs"] > 0
    assert result["threads_constant"] == [True, True]
    assert result["threads_after_pass"] == result["threads_before_pass"]


@pytest.mark.smoke_run(
    "soak_die",
    argv=_soak(*SMOKE, "--die-rank", "1", "--die-at", "5", "--exchange-timeout-s", "5"),
    timeout=300,
    seconds=10,
)
def test_a_rank_that_dies_is_reported_missing_with_its_exit_code(smoke_runs) -> None:
    code, result, _ = _result(smoke_runs, "soak_die")
    assert code == 1 and not result["ok"]
    assert result["missing_ranks"] == [1], result
    assert "rank 1 died or hung without reporting (exit code 3)" in result["failures"], result
