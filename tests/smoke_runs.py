"""Smoke runs: scripts (benchmarks, correctness suites) on tiny arguments, two at a time.

Each smoke run is one subprocess that spends most of its time starting up: importing, spawning
ranks that import, or sleeping out a timeout. A test marks the run it checks with
``@pytest.mark.smoke_run(name, argv=..., ...)`` and takes the ``smoke_runs`` fixture; the first
such test of the session starts the runs of every selected test, whatever its folder, two at a
time, longest first, and each test then checks only its own::

    @pytest.mark.smoke_run("planner", argv=_argv)  # _argv(tmp: Path) -> ["benchmarks/...", ...]
    def test_planner(smoke_runs) -> None:
        run = result_of(smoke_runs, "planner")  # .out: its folder, .proc: the CompletedProcess

(``harness.jobs.result_of`` raises again what the run raised: a timeout, or a failed ``check``.)

Keyword arguments of the mark: ``argv`` (required: given the run's own empty folder, which it
may fill with inputs, it returns the arguments after ``python``), ``timeout`` (seconds, default
600: an error of the test), ``env`` (extra environment variables), ``check`` (a non-zero exit is
an error of the test, as ``subprocess.run(check=True)``), ``seconds`` (about how long the run
takes alone: the longest start first).

A folder whose tests use it imports the fixture into its ``conftest.py``
(``from tests.smoke_runs import smoke_runs``). Each such conftest defines a fixture of its own
(pytest caches a session fixture per definition), so the runs are kept in the session's stash:
whichever folder's test asks first runs them all, in one pool, and the others get the same
results.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.jobs import run_calls

ROOT = Path(__file__).resolve().parents[1]
_RESULTS = pytest.StashKey[dict]()


@dataclass(frozen=True)
class SmokeRun:
    out: Path  # the run's folder (its inputs, and whatever it was told to write there)
    proc: subprocess.CompletedProcess


def _run(out: Path, argv: Any, timeout: float = 600, env: dict | None = None, check=False, **_):
    proc = subprocess.run(
        [sys.executable, *argv(out)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )
    return SmokeRun(out, proc)


def _run_all(session: pytest.Session, tmp_path_factory: pytest.TempPathFactory) -> dict:
    specs: dict[str, dict[str, Any]] = {}
    for item in session.items:
        for mark in item.iter_markers("smoke_run"):
            (name,) = mark.args
            assert specs.get(name, mark.kwargs) == mark.kwargs, f"two smoke runs named {name}"
            specs[name] = mark.kwargs
    longest_first = sorted(specs, key=lambda name: -specs[name].get("seconds", 0))
    return run_calls(
        {
            name: functools.partial(_run, tmp_path_factory.mktemp(name), **specs[name])
            for name in longest_first
        }
    )


@pytest.fixture(scope="session")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{name: ("ok", SmokeRun) or ("error", exception)}`` for every smoke run selected."""
    stash = request.session.stash
    if _RESULTS not in stash:
        stash[_RESULTS] = _run_all(request.session, tmp_path_factory)
    return stash[_RESULTS]
