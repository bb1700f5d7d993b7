"""Runs a multi-process Lightning job as a subprocess of the test.

Lightning's ``"ddp"`` launcher re-executes ``sys.argv`` for the other ranks; inside pytest that
would be pytest itself, so each test launches its job module with ``python -m`` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module_raw(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs ``python -m module *args`` from the repository root and returns the process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs ``python -m module *args`` from the repository root; a non-zero exit fails the test."""
    proc = run_module_raw(module, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_modules(jobs: list[tuple[str, ...]], *, parallel: int = 2, timeout: int = 600) -> None:
    """Runs several ``python -m module *args`` jobs, ``parallel`` at a time (independent fits of
    a module fixture: their start-up, mostly imports, overlaps); any non-zero exit fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            module, *args = pending.pop(0)
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            running.append((proc, (module, *args)))
        proc, job = running.pop(0)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{' '.join(job)}: exit {proc.returncode}\n{out[-4000:]}")
    assert not failed, "\n\n".join(failed)


def run_nodes(module: str, *args: str, num_nodes: int = 2, timeout: int = 600) -> None:
    """Runs ``python -m module *args`` once per node, all on this machine, as Lightning's
    multi-node launch expects (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): each node's
    process starts its own local ranks. Any non-zero exit fails the test."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in range(num_nodes):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "NODE_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failed = []
    for node, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"node {node}: exit {proc.returncode}\n{out[-4000:]}")
    assert not failed, "\n\n".join(failed)
