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
