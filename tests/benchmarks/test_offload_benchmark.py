"""benchmarks/offload_gpu.py: its --tiny CPU run goes through the same code and prints JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_offload_benchmark_tiny_run() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/offload_gpu.py", "--tiny", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    assert set(report["results"]) == {"none", "ours_min0mib"}
    ours = report["results"]["ours_min0mib"]
    assert ours["offloaded_mib_per_step"] > 0 and ours["step_ms"] > 0
