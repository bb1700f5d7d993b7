"""The preemption trials (``tests/suites/preemption.py``): one trial end to end in the default run
(its JSON, any timing), the recorded trials of our strategy with ``pytest -m suite``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import check, result_of, run_jobs

MODULE = "tests.suites.preemption"
ROW_KEYS = {
    "strategy",
    "mode",
    "target",
    "trials",
    "stopped_10s",
    "median_stop_s",
    "max_stop_s",
    "hung",
    "sigterm_all",
    "exceptions",
    "thread_left",
    "no_exit_file",
    "rank0_returncodes",
    "exit_status",
}


def _argv(keep: Path) -> list[str]:
    args = "--trials 1 --strategies vlmbalance --modes overlap --target both --cap-s 15 --json"
    return ["-m", MODULE, *args.split(), "--keep", str(keep)]


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# the SIGTERM stop itself is tested by tests/balance/test_preemption.py; this trial of the suite
# script runs with the suite (pytest -m suite)
@pytest.mark.suite
@pytest.mark.smoke_run("preemption", argv=_argv, timeout=300, seconds=17)
def test_preemption_one_trial(smoke_runs) -> None:
    run = result_of(smoke_runs, "preemption")  # a smoke run (tests/smoke_runs.py)
    out, tmp_path = run.proc, run.out
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = _report(out.stdout)
    assert {"command", "date", "machine", "cap_s", "rows", "trials"} <= set(report)
    assert report["command"].startswith(f"python -m {MODULE} --trials 1 ")
    (row,) = report["rows"]
    assert set(row) == ROW_KEYS
    assert (row["strategy"], row["mode"], row["target"], row["trials"]) == (
        "vlmbalance",
        "overlap",
        "both",
        1,
    )
    assert row["stopped_10s"] + row["hung"] <= 1
    (trial,) = report["trials"]
    assert trial["config"] == "vlmbalance-overlap-both"
    assert (
        set(trial["stop_s"]) == set(trial["exceptions"]) == set(trial["exit_status"]) == {"0", "1"}
    )
    assert 0.0 <= trial["delay_s"] < 2.0
    assert (tmp_path / "vlmbalance-overlap-both-0" / "pid1.json").exists()


# the recorded runs (benchmarks/results/rebalancing.md, "Preemption"), our strategy's rows: the
# plain "ddp" rows recorded beside them are Lightning's behaviour, hangs included, not a check
RECORDED = {
    "both": "--trials 20 --strategies vlmbalance --modes overlap --target both --json",
    "group": "--trials 3 --strategies vlmbalance --modes overlap --target group --num-workers 2"
    " --json",
}


@pytest.mark.suite
@pytest.mark.timeout(3600)
def test_every_recorded_trial_stops_cleanly() -> None:
    """SIGTERM to both ranks (20 trials) and to the whole process group with DataLoader workers
    (3 trials), one after the other: every rank of every trial gone within 10 s, through
    Lightning's ``SIGTERMException``, with exit status 143 and no exchange thread left; no hang."""
    jobs = {name: (MODULE, *args.split()) for name, args in RECORDED.items()}
    for name, job in run_jobs(jobs, parallel=1, timeout=1500).items():
        (row,) = _report(check(job).stdout)["rows"]
        n = row["trials"]
        assert (row["hung"], row["stopped_10s"], row["sigterm_all"]) == (0, n, n), (name, row)
        assert (row["thread_left"], row["no_exit_file"]) == (0, 0), (name, row)
        assert row["exit_status"] == {"143/143": n}, (name, row)
