"""The one runner of multi-process test jobs (``harness/jobs.py``, with ``tests/launch.py`` its
one-job forms): a job past its timeout is killed with every process it started."""

from __future__ import annotations

import os
import time

from tests.launch import run_module_raw


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its reaper counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_a_job_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    proc = run_module_raw("tests.sleep_job", str(pid_file), timeout=5)
    assert proc.timed_out and proc.returncode == -9
    assert "killed at its timeout" in proc.stderr
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the job's child outlived the job"
