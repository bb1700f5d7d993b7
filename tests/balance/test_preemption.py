"""SIGTERM stops a 2-process ``strategy="vlmbalance"`` fit, on every rank, through Lightning.

SLURM and Kubernetes preempt a job by sending SIGTERM to every rank at once, to one rank (rank 0
alone must be enough), or, at SLURM's time limit and with ``kill -TERM -PGID``, to every process
of the job, DataLoader workers included. Whatever the rebalancing mode and wherever the signal
lands (mid-micro-batch, mid-exchange, between optimizer steps), every rank must:

- leave ``trainer.fit`` through Lightning's ``SIGTERMException`` (``Callback.on_exception`` sees
  it), not through an error of a collective its peer abandoned;
- have joined the ``vlmbalance-exchange`` thread by the time the interpreter exits;
- exit with status 143 (128 + SIGTERM), which torchrun's agent, a Kubernetes Job and a SLURM
  requeue script read as "terminated", not "finished" (rank 0's as the harness sees it, rank 1's
  as its launcher, rank 0, sees it); and with DataLoader workers, leave none behind;
- be gone within 10 s of the signal. This is a hang bound, not a performance figure: a hung
  rank otherwise stays until a collective's timeout (30 min by default), and the scheduler's
  grace period before SIGKILL is typically 30 s. Timings are measured by
  ``tests/suites/preemption.py``.

Each case launches ``tests.balance.preempt_job`` (about 10 s to start on 2 CPU cores) and sends
the signal after a seeded random delay of 0-2 s once both ranks train.
``VLMBALANCE_PREEMPT_TRIALS=N`` runs N trials per case (delays stratified over 0-2 s). The
trials of all cases run two at a time (one's start-up overlaps the other's; the 10 s bound is
far above the ~1 s a stop takes, and stop times were measured under far more load than that).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from typing import Any

import pytest

from harness.jobs import result_of, run_calls, selected
from tests.balance.preempt_job import (
    EXCHANGE_THREAD,
    MODULE,
    RANKS,
    ROOT,
    SIGTERM_EXIT,
    TARGETS,
    exchange_thread_left,
    run_trial,
)

STOP_BOUND_S = 10.0
CAP_S = STOP_BOUND_S + 2.0  # then the trial's stacks are dumped and its processes killed
MAX_DELAY_S = 2.0
TRIALS = int(os.environ.get("VLMBALANCE_PREEMPT_TRIALS", "1"))


def signal_delays(seed: int, trials: int, max_delay_s: float = MAX_DELAY_S) -> list[float]:
    """``trials`` delays, one uniform draw in each of ``trials`` equal slices of [0, max)."""
    rng = random.Random(seed)
    return [(i + rng.random()) * max_delay_s / trials for i in range(trials)]


def _problems(res: dict[str, Any]) -> list[str]:
    """What a trial did wrong, each as one line (with the stacks of a hung rank). A trial of
    target ``"end"`` (no signal: the fit ends) must exit with status 0 and no exception."""
    ended = res["target"] == "end"
    event = "its fit ended" if ended else "SIGTERM"
    where = f"delay {res['delay_s']} s, batches at signal {res['batches_at_signal']}"
    problems = []
    for r in RANKS:
        stop = res["stop_s"][r]
        if stop is None:  # its stacks follow; no exception or exit file yet, of course
            problems.append(f"rank {r} hung: still alive {CAP_S} s after {event}")
            continue
        if stop > STOP_BOUND_S:
            problems.append(f"rank {r} exited {stop} s after {event} (bound {STOP_BOUND_S} s)")
        exception = res["exceptions"][r]
        if ended and exception is not None:
            problems.append(f"rank {r} left fit with {exception['type']}")
        if not ended and (exception is None or not exception["sigterm"]):
            kind = exception and f"{exception['type']} raised at {exception['raised_at'][-1]}"
            problems.append(f"rank {r} left fit with {kind}, expected SIGTERMException")
        if res["exits"][r] is None:
            problems.append(f"rank {r} wrote no exit file (killed?)")
        expected = 0 if ended else SIGTERM_EXIT
        if res["exit_status"][r] != expected:
            problems.append(f"rank {r} exited with status {res['exit_status'][r]}, not {expected}")
    if exchange_thread_left(res):
        problems.append(f"a {EXCHANGE_THREAD!r} thread was alive at exit: {res['exits']}")
    if res["left_in_group"]:
        problems.append(f"processes {res['left_in_group']} of the job outlived every rank")
    message = [f"  {p} ({where})" for p in problems]
    for r, stack in res.get("main_stacks", {}).items():
        message.append(f"  main thread of hung rank {r}:\n{stack}")
    return message


# a signal to the process group reaches the DataLoader workers too: the job runs with some
GROUP_WORKERS = 2


def _case(
    mode: str,
    target: str,
    strategy: str = "vlmbalance",
    persistent: bool = False,
    read_ahead: int = 0,
) -> tuple[str, dict[str, Any]]:
    """A case's name and its ``run_trial`` arguments (workers for a group signal or with
    persistent workers)."""
    workers = GROUP_WORKERS if target == "group" or persistent else 0
    name = "-".join(
        [mode, target]
        + ["fsdp"] * (strategy == "fsdp_vlmbalance")
        + ["persistent"] * persistent
        + [f"ahead{read_ahead}"] * bool(read_ahead)
    )
    kwargs = {
        "strategy": strategy,
        "mode": mode,
        "target": target,
        "num_workers": workers,
        "persistent_workers": persistent,
        "read_ahead": read_ahead,
    }
    return name, kwargs


# every mode and every target once, and the worker set-ups that once kept processes alive
# (persistent workers, the main job's read-ahead thread, fsdp_vlmbalance);
# VLMBALANCE_PREEMPT_ALL=1 runs every signal target in every mode and every worker set-up
_WORKER_SETUPS = [
    {"persistent": True},
    {"persistent": True, "read_ahead": 2},
    {"read_ahead": 2},
    {"strategy": "fsdp_vlmbalance"},
    {"strategy": "fsdp_vlmbalance", "persistent": True},
]
CASES = dict(
    [_case(m, t) for m in ("overlap", "sync", "off") for t in TARGETS if t != "end"]
    + [_case("overlap", t, **w) for t in ("group", "end") for w in _WORKER_SETUPS]
    if os.environ.get("VLMBALANCE_PREEMPT_ALL")
    else [
        _case("overlap", "both"),
        _case("overlap", "rank0"),
        _case("overlap", "group"),
        _case("sync", "both"),
        _case("off", "both"),
        _case("overlap", "group", persistent=True, read_ahead=2),
        _case("overlap", "group", strategy="fsdp_vlmbalance", persistent=True),
        _case("overlap", "end", persistent=True),
        _case("overlap", "end", strategy="fsdp_vlmbalance", persistent=True, read_ahead=2),
    ]
)


@pytest.fixture(scope="module")
def trials(request, tmp_path_factory) -> dict:
    """Every trial of every selected case (``@pytest.mark.jobs``), two at a time: ``{(case,
    i): run_trial's result, or the exception it raised}``."""
    root = tmp_path_factory.mktemp("preemption")
    calls = {}
    for name, kwargs in selected(request, CASES).items():
        for i, delay_s in enumerate(signal_delays(zlib.crc32(name.encode()), TRIALS)):
            calls[name, i] = functools.partial(
                run_trial, root / name / f"trial{i}", delay_s=delay_s, cap_s=CAP_S, **kwargs
            )
    return run_calls(calls)


# in `pytest -m suite` since the test job had to fit in 20 minutes: the agreed stop in the modes
# that share overlap's path (sync runs its code in line; off plans nothing), and overlap-group and
# overlap-end-persistent (their -persistent-ahead2 / -fsdp- variants cover both targets in CI)
SUITE_CASES = {"sync-both", "off-both", "overlap-group", "overlap-end-persistent"}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(n, marks=[pytest.mark.jobs(n)] + [pytest.mark.suite] * (n in SUITE_CASES))
        for n in CASES
    ],
)
def test_sigterm_stops_every_rank(trials, case: str) -> None:
    """SIGTERM (to both ranks, to rank 0 only, or to the job's process group with DataLoader
    workers) ends every rank via SIGTERMException in 10 s, with exit status 143; a fit that ends
    (persistent workers, read-ahead, fsdp_vlmbalance) leaves no process 10 s after ``fit``."""
    failures = []
    for i in range(len(signal_delays(zlib.crc32(case.encode()), TRIALS))):
        res = result_of(trials, (case, i))
        if problems := _problems(res):
            failures.append(f"trial {i}:\n" + "\n".join(problems))
    assert not failures, "\n".join(failures)


def test_sigterm_exit_status_one_process(tmp_path) -> None:
    """A 1-process ``strategy="vlmbalance"`` fit stopped by SIGTERM exits with status 143 too
    (there Lightning's own flag stops it after the batch)."""
    out = tmp_path / "one"
    out.mkdir()
    job = [sys.executable, "-m", MODULE, "--out", str(out), "--devices", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (out / "stderr").open("w") as stderr:
        proc = subprocess.Popen(job, cwd=ROOT, env=env, stderr=stderr)
    try:
        while not (out / "step0").exists() and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    tail = (out / "stderr").read_text()[-3000:]
    assert status == SIGTERM_EXIT, f"exit status {status}, not 143:\n{tail}"
