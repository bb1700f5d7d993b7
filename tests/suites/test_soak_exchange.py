"""The exchange soak (``tests/suites/soak_exchange.py``): a short soak passes its checks in the
default run; a dying rank is reported, and the recorded 5,000-batch soaks pass, with
``pytest -m suite`` (a rank failing in its exchange: test_loader.py and test_strategy.py in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import result_of, run_jobs

MODULE = "tests.suites.soak_exchange"
SMOKE = ("--global-batches", "300", "--warmup", "50", "--sample-every", "50")


def _soak(*flags: str):
    """The arguments of a soak run (a smoke run of tests/smoke_runs.py)."""

    def argv(out: Path) -> list[str]:
        return ["-m", MODULE, "--ranks", "2", *flags, "--json"]

    return argv


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _result(smoke_runs: dict, name: str) -> tuple[int, dict, str]:
    out = result_of(smoke_runs, name).proc
    return out.returncode, _last_json(out.stdout), out.stderr


# memory growth is measured by the long soak (test_the_recorded_soaks_pass below), not decided
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


@pytest.mark.suite
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


# benchmarks/results/rebalancing.md, "soak of the exchange and loader": about 64 s each on 2 cores
RECORDED = "--ranks 2 --global-batches 5000 --micro-steps 4 --sample-every 250 --json"


@pytest.mark.suite
@pytest.mark.timeout(1800)
def test_the_recorded_soaks_pass() -> None:
    """5,000 global batches in ``overlap``, then in ``sync``: every check of the soak holds
    (every pack once and intact, resident memory under 2% growth after warm-up, thread counts
    constant, the exchange thread joined, packs moved)."""
    jobs = {mode: (MODULE, *RECORDED.split(), "--mode", mode) for mode in ("overlap", "sync")}
    for mode, job in run_jobs(jobs, parallel=1, timeout=800).items():
        assert job.returncode == 0 and not job.timed_out, (mode, job.stderr[-3000:])
        result = _last_json(job.stdout)
        assert result["ok"] and result["failures"] == [], (mode, result["failures"])
        assert result["mode"] == mode and result["global_batches"] == 5000
