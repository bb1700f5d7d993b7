"""The wait one straggler causes, as the StragglerMonitor measures it, under DDP-style
``"vlmbalance"`` and under FSDP2 (``"fsdp_vlmbalance"``), 2 CPU ranks.

Rank 1 sleeps ``--delay-ms`` in every vision forward (the Lightning job of the monitor's tests,
``python -m tests.callbacks.straggler_job``, run as a subprocess, balancing off). Per
micro-batch, from the monitor's JSON lines after the first two steps:

- ``wait_ms``: rank 0's wait. Under ``"vlmbalance"`` its ``sync_wait`` + ``lightning_sync``;
  under ``"fsdp_vlmbalance"`` its ``collective_wait`` beyond rank 1's (the least time a rank
  spent in FSDP's collectives is their own cost, not waiting: ``timing.summary.collective_waits``).
- ``wait_over_delay``: that over the injected delay (goal: within 20% of 1).
- ``slow_vision_minus_delay_ms``: rank 1's ``vision_fwd`` less the delay (its own encoder;
  no wait inside), and rank 0's ``vision_fwd`` beside it.

    python benchmarks/fsdp_waits.py --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import add_json_flag, print_json, stamp  # noqa: E402

WAITS = {
    "vlmbalance": ("sync_wait", "lightning_sync"),
    "fsdp_vlmbalance": ("collective_wait",),
}


def _micro(path: Path, skip: int) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()][skip:]
    return [m for row in rows for m in row["micro"]]


def run(strategy: str, accumulate: int, delay_ms: float, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tests.callbacks.straggler_job", "--out", str(out),
           "--strategy", strategy, "--accumulate", str(accumulate),
           "--delay-ms", str(delay_ms), "--max-steps", str(steps)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    folder = out / "tb" / "run" / "version_0" / "straggler"
    micro = {r: _micro(folder / f"rank_{r}.jsonl", skip=2) for r in (0, 1)}
    waits = WAITS[strategy]

    def per_micro(r: int) -> np.ndarray:
        return np.array([sum(m[f"{p}_ms"] for p in waits) for m in micro[r]])

    wait = per_micro(0) - (per_micro(1) if strategy == "fsdp_vlmbalance" else 0.0)
    vision = {r: np.array([m["vision_fwd_ms"] for m in micro[r]]) for r in (0, 1)}
    return {
        "strategy": strategy,
        "accumulate": accumulate,
        "delay_ms": delay_ms,
        "micro_batches": len(wait),
        "wait_ms": float(np.median(wait)),
        "wait_over_delay": float(np.median(wait) / delay_ms),
        "in_collectives_ms": [float(np.median(per_micro(r))) for r in (0, 1)]
        if strategy == "fsdp_vlmbalance"
        else None,
        "slow_vision_minus_delay_ms": float(np.median(vision[1]) - delay_ms),
        "fast_vision_ms": float(np.median(vision[0])),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay-ms", type=float, default=40.0)
    p.add_argument("--accumulate", default="1,2", help="comma list")
    p.add_argument("--steps", type=int, default=12)
    add_json_flag(p)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ga in (int(x) for x in args.accumulate.split(",")):
            for strategy in WAITS:
                out = Path(tmp) / f"{strategy}_{ga}"
                rows.append(run(strategy, ga, args.delay_ms, args.steps, out))
    for r in rows:
        print(
            f"{r['strategy']:16s} ga {r['accumulate']}: rank 0 waits {r['wait_ms']:.1f} ms per"
            f" micro-batch for a {r['delay_ms']:.0f} ms delay ({r['wait_over_delay']:.2f}x);"
            f" rank 1 vision - delay {r['slow_vision_minus_delay_ms']:.1f} ms, rank 0 vision"
            f" {r['fast_vision_ms']:.1f} ms"
            + (f"; in collectives {r['in_collectives_ms']}" if r["in_collectives_ms"] else "")
        )
    if args.json:
        print_json({**stamp("torch", "lightning"), "rows": rows})


if __name__ == "__main__":
    main()
