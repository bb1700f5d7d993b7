"""benchmarks/soak_exchange.py: a short soak passes its checks, and a dying rank is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _soak(*flags: str) -> tuple[int, dict, str]:
    out = subprocess.run(
        [sys.executable, "benchmarks/soak_exchange.py", "--ranks", "2", *flags, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_short_soak_passes_its_checks() -> None:
    # memory growth is measured by the long soak (RESULTS.md), not decided in this short one
    code, result, err = _soak(
        *("--global-batches", "300", "--warmup", "50", "--sample-every", "50"),
        *("--max-rss-growth", "0.5"),
    )
    assert code == 0 and result["ok"], (err, result["failures"])
    assert result["moved_packs"] > 0
    assert result["threads_constant"] == [True, True]
    assert result["threads_after_pass"] == result["threads_before_pass"]


def test_a_rank_that_dies_is_reported_missing_with_its_exit_code() -> None:
    code, result, _ = _soak(
        *("--global-batches", "300", "--warmup", "50", "--sample-every", "50"),
        *("--die-rank", "1", "--die-at", "5", "--exchange-timeout-s", "5"),
    )
    assert code == 1 and not result["ok"]
    assert result["missing_ranks"] == [1], result
    assert "rank 1 died or hung without reporting (exit code 3)" in result["failures"], result
