"""Runs a multi-process Lightning job as a subprocess of the test.

Lightning's ``"ddp"`` launcher re-executes ``sys.argv`` for the other ranks; inside pytest that
would be pytest itself, so each test launches its job module with ``python -m`` instead. These
are the one-job forms of :func:`harness.jobs.run_jobs`, the one runner: each job runs in a session
of its own, and one past its timeout is killed with every rank it started.
"""

from __future__ import annotations

import socket

from harness.jobs import ROOT, JobResult, check, run_jobs

__all__ = [
    "ROOT",
    "THEN",
    "fit_arg_lists",
    "run_module",
    "run_module_raw",
    "run_modules",
    "run_nodes",
]


THEN = "--then"  # separates the argument lists of the fits of one launch of a job script


def fit_arg_lists(argv: list[str]) -> list[list[str]]:
    """A job script's argument lists, one per fit of the launch (separated by ``--then``): the
    fits run one after the other in the same processes (Lightning starts the ranks for the
    first; the later Trainers find them started and the process group up)."""
    fits: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            fits.append([])
        else:
            fits[-1].append(arg)
    return fits


def run_module_raw(module: str, *args: str, timeout: int = 300) -> JobResult:
    """Runs ``python -m module *args`` from the repository root and returns the finished job
    (``returncode``, ``stdout``, ``stderr``; ``timed_out`` if it was killed at ``timeout``)."""
    return run_jobs({"job": (module, *args)}, timeout=timeout)["job"]


def run_module(module: str, *args: str, timeout: int = 300) -> JobResult:
    """Runs ``python -m module *args`` from the repository root; a non-zero exit fails the test."""
    return check(run_module_raw(module, *args, timeout=timeout))


def run_modules(jobs: list[tuple[str, ...]], *, parallel: int = 2, timeout: int = 600) -> None:
    """Runs several ``python -m module *args`` jobs, ``parallel`` at a time (independent fits of
    a module fixture: their start-up, mostly imports, overlaps); any non-zero exit fails."""
    results = run_jobs(
        {str(i): job for i, job in enumerate(jobs)}, parallel=parallel, timeout=timeout
    )
    failed = [
        f"{' '.join(jobs[int(i)])}: exit {r.returncode}\n{(r.stdout + r.stderr)[-4000:]}"
        for i, r in results.items()
        if r.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)


def run_nodes(module: str, *args: str, num_nodes: int = 2, timeout: int = 600) -> None:
    """Runs ``python -m module *args`` once per node, all on this machine, as Lightning's
    multi-node launch expects (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): each node's
    process starts its own local ranks. Any non-zero exit fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = {f"node {n}": (module, *args) for n in range(num_nodes)}
    envs = {
        f"node {n}": {"NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for n in range(num_nodes)
    }
    results = run_jobs(nodes, parallel=num_nodes, timeout=timeout, envs=envs)
    failed = [
        f"{name}: exit {r.returncode}\n{(r.stdout + r.stderr)[-4000:]}"
        for name, r in results.items()
        if r.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
