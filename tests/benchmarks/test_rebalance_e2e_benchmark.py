"""benchmarks/rebalance_e2e.py runs end to end, and its read-ahead is the same reading in order."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from harness.jobs import result_of
from tests.benchmarks.scripts import load, mix_csv


class _Source:
    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError(f"source failed at {i}")
            yield {"i": i}


def _readers() -> int:
    return sum(t.name == "e2e-read-ahead" for t in threading.enumerate())


@pytest.mark.parametrize("depth", [0, 1, 8, 100])
def test_read_ahead_yields_the_source_in_order_and_joins_its_thread(depth) -> None:
    """Reading ahead changes when a batch is built, never which batch comes next."""
    read_ahead = load("rebalance_e2e").ReadAhead(_Source(20), depth)
    assert len(read_ahead) == 20
    assert [b["i"] for b in read_ahead] == list(range(20))
    assert _readers() == 0


def test_read_ahead_raises_the_source_error_and_stops_early() -> None:
    ReadAhead = load("rebalance_e2e").ReadAhead
    with pytest.raises(RuntimeError, match="source failed at 5"):
        list(ReadAhead(_Source(20, fail_at=5), 4))
    assert _readers() == 0
    it = iter(ReadAhead(_Source(1000), 4))
    assert next(it) == {"i": 0}
    it.close()  # abandoned after one batch: the reader thread is stopped and joined
    assert _readers() == 0


def _e2e_argv(tmp: Path) -> list[str]:
    return [
        "benchmarks/rebalance_e2e.py",
        *("--data", str(mix_csv(tmp, 4000)), "--text-share", "0.2"),
        *("--ranks", "2", "--ga", "4", "--steps", "2", "--warmup", "1"),
        *("--mode", "overlap", "--timings-dir", str(tmp / "timings"), "--json"),
    ]


@pytest.mark.smoke_run("rebalance_e2e", argv=_e2e_argv, seconds=17)
def test_rebalance_e2e_benchmark_on_a_csv(smoke_runs) -> None:
    run = result_of(smoke_runs, "rebalance_e2e")  # a smoke run (tests/smoke_runs.py)
    out, timings = run.proc, run.out / "timings"
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(result["modes"]) == ["off", "overlap"]  # off first, as the reference
    assert result["read_ahead"] == 2 and result["mode"] == "overlap"
    off, overlap = result["modes"]["off"], result["modes"]["overlap"]
    assert off["moved_packs"] == 0 and off["predicted_gain"] == 0.0
    assert overlap["predicted_gain"] >= 0.0
    for r in (off, overlap):
        assert r["steps_per_s"] > 0 and 0.0 <= r["ideal_step_ms"] <= r["step_ms"] * 1.01
    for mode in ("off", "overlap"):
        for rank in (0, 1):
            lines = (timings / mode / f"rank_{rank}.jsonl").read_text().splitlines()
            steps = [json.loads(line) for line in lines]
            assert [s["global_step"] for s in steps] == [1, 2]  # the measured steps
            assert all(s["rank"] == rank and len(s["micro"]) == 4 for s in steps)
