"""Runs the independent subprocess jobs of a test module a few at a time, each with its result.

A 2-process job spends most of its wall time importing (rank 0, then rank 1, which Lightning's
launcher starts only once rank 0 is in ``fit``), with one core idle: two such jobs side by side
take about as long as one on 2 cores. :func:`run_jobs` runs named jobs ``parallel`` at a time,
starting each as soon as a slot is free and the jobs it comes ``after`` have succeeded, and
returns every job's result; a test asserts on its own job's, so a failing job fails only the
tests that use it (``check`` fails as ``tests.launch.run_module`` does).

For the same reason :func:`run_calls` runs independent blocking calls (preemption trials, the
benchmark scripts' smoke runs) on threads, ``parallel`` at a time, and returns each call's result
or exception (:func:`result_of` raises it again in the test that uses it).

A module fixture runs only the jobs of the tests this session runs: each test names the jobs it
checks with ``@pytest.mark.jobs(name, ...)`` and the fixture passes :func:`selected` to
``run_jobs`` (a job named in ``after`` comes with the jobs that need it).

Only jobs whose tests judge no timing share the machine this way; what compares times between
ranks (``tests/callbacks/test_straggler_monitor.py``'s slow rank) runs alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the job's session: the job and the ranks it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class JobResult(subprocess.CompletedProcess):
    """A finished job: ``returncode``, ``stdout``, ``stderr``, whether it was ``timed_out``
    (killed at its timeout: an error of the test whatever the job printed), and ``span``: when
    it started and ended, in seconds after ``run_jobs`` began (what the schedule was, for
    whoever tunes the order; never for a test to judge)."""

    def __init__(
        self,
        args: Any,
        returncode: int | None,
        stdout: str,
        stderr: str,
        *,
        timed_out: bool = False,
        span: tuple[float, float] = (0.0, 0.0),
    ):
        super().__init__(args, returncode, stdout, stderr)
        self.timed_out = timed_out
        self.span = span


def run_jobs(
    jobs: Mapping[str, Sequence[str]],
    *,
    after: Mapping[str, Sequence[str]] | None = None,
    parallel: int = 2,
    timeout: float = 600,
    timeouts: Mapping[str, float] | None = None,
    envs: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, JobResult]:
    """Runs ``python -m module *args`` for every ``name: (module, *args)`` of ``jobs`` from the
    repository root, ``parallel`` at a time, in the given order as far as ``after`` (``name:
    names it needs``) allows. Returns ``{name: JobResult}`` (stdout and stderr as text).

    A job past its timeout (``timeouts[name]``, else ``timeout`` seconds) is killed with the
    processes it started: return code -9, ``timed_out``, a note at the end of its stderr. A job
    whose prerequisite failed is not run: its return code is ``None`` and its stderr names the
    failed job. ``envs[name]``: environment variables of that job on top of this process's.
    """
    after = {name: tuple(needs) for name, needs in (after or {}).items() if name in jobs}
    unknown = {n for needs in after.values() for n in needs} - set(jobs)
    assert not unknown, f"`after` names jobs that do not exist: {sorted(unknown)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pending, began = list(jobs), time.monotonic()
    running: dict[str, tuple[subprocess.Popen, Any, Any, float, float]] = {}
    done: dict[str, JobResult] = {}

    def failed(name: str) -> bool:
        return name in done and done[name].returncode != 0

    def ready(name: str) -> bool:
        return all(n in done for n in after.get(name, ()))

    try:
        while pending or running:
            for name in [n for n in pending if ready(n)]:
                if len(running) >= parallel:
                    break
                pending.remove(name)
                args = list(jobs[name])
                if bad := [n for n in after.get(name, ()) if failed(n)]:
                    done[name] = JobResult(
                        args, None, "", f"not run: the job it needs, {bad}, failed"
                    )
                    continue
                out = tempfile.TemporaryFile("w+", errors="replace")
                err = tempfile.TemporaryFile("w+", errors="replace")
                proc = subprocess.Popen(
                    [sys.executable, "-m", *args],
                    cwd=ROOT,
                    env={**env, **(envs or {}).get(name, {})},
                    stdout=out,
                    stderr=err,
                    text=True,
                    start_new_session=True,  # one killpg stops the ranks it started too
                )
                limit = (timeouts or {}).get(name, timeout)
                started = time.monotonic()
                running[name] = (proc, out, err, started + limit, started - began)
            if not running and pending and not any(ready(n) for n in pending):
                raise AssertionError(f"jobs waiting on each other: {pending}")  # pragma: no cover
            time.sleep(0.05)
            for name, (proc, out, err, deadline, started) in list(running.items()):
                timed_out = proc.poll() is None and time.monotonic() > deadline
                if timed_out:
                    _kill_session(proc)
                    proc.wait()
                if proc.returncode is None:
                    continue
                del running[name]
                out.seek(0), err.seek(0)
                stdout, stderr = out.read(), err.read()
                out.close(), err.close()
                if timed_out:
                    stderr += f"\n[harness.jobs] {name}: killed at its timeout, still running"
                span = (round(started, 1), round(time.monotonic() - began, 1))
                done[name] = JobResult(
                    proc.args, proc.returncode, stdout, stderr, timed_out=timed_out, span=span
                )
    finally:  # interrupted (or failed) while jobs ran: they and their ranks stop too
        for proc, out, err, *_ in running.values():
            _kill_session(proc)
            proc.wait()
            out.close(), err.close()
    return {name: done[name] for name in jobs}


def selected(
    request: Any, jobs: Mapping[str, Any], after: Mapping[str, Sequence[str]] | None = None
) -> dict[str, Any]:
    """The entries of ``jobs`` that the selected tests of the requesting fixture's module name in
    their ``@pytest.mark.jobs(...)``, with the jobs those come ``after``, in ``jobs``' order."""
    names: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            for mark in item.iter_markers("jobs"):
                names.update(mark.args)
    unknown = names - set(jobs)
    assert not unknown, f"@pytest.mark.jobs names jobs that do not exist: {sorted(unknown)}"
    todo = list(names)
    while todo:
        for need in (after or {}).get(todo.pop(), ()):
            if need not in names:
                names.add(need)
                todo.append(need)
    return {name: value for name, value in jobs.items() if name in names}


def result(results: Mapping[str, Any], name: str) -> Any:
    """Job ``name``'s entry of ``results``; the test must name it in ``@pytest.mark.jobs``."""
    assert name in results, f"job {name!r} did not run: name it in the test's @pytest.mark.jobs"
    return results[name]


def check(proc: JobResult) -> JobResult:
    """Fails the test unless the job exited with 0 (its output's tail in the message)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_calls(
    calls: Mapping[str, Callable[[], Any]], *, parallel: int = 2
) -> dict[str, tuple[str, Any]]:
    """Runs every ``name: call`` on a thread, ``parallel`` at a time, in the given order.
    Returns ``{name: ("ok", result)}`` or ``{name: ("error", exception)}``."""

    def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
        try:
            return "ok", call()
        except Exception as err:  # reported to the test that asked for this call
            return "error", err

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {name: pool.submit(outcome, call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def result_of(results: Mapping[str, tuple[str, Any]], name: str) -> Any:
    """The result of call ``name``; its exception is raised again in the test that uses it."""
    status, payload = results[name]
    if status == "error":
        raise payload
    return payload
