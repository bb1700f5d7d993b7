"""benchmarks/moe_routing.py runs end to end at a tiny size and prints the promised JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_benchmark_tiny_run() -> None:
    args = "--tokens 64 --experts 4 --topk 2 --hidden 16 --warmup 1 --reps 1 --threads 1"
    args += " --backend aot_eager --json"  # the same graph capture, without inductor's codegen
    out = subprocess.run(
        [sys.executable, "benchmarks/moe_routing.py", *args.split()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("loop_ms", "sorted_eager_ms", "sorted_compiled_ms", "speedup_vs_loop"):
        assert report[key] > 0
    assert "hf_grouped_ms" in report
    assert max(report["max_rel_err"].values()) < 1e-5
