"""What one online refit of the cost model costs (``OnlineCalibrator.refit``), against a step.

The refit runs on rank 0, in a background thread, every ``every_n_steps`` optimizer steps, on a
window of ``window_steps`` steps x ranks x micro-batches records. Here the records are
synthetic (packs of the shared mixes' shape: 0-3 images of 64-1,280 tokens, 2-8k tokens, 1-5
documents; times from a cost model plus 2% noise), which is all the fit sees. Reported per
window size: the median wall time of ``refit()`` (single thread), and that time as a share of a
step of ``--step-ms`` spread over the ``every_n_steps`` steps between refits (the thread's load
on rank 0's cores).

    python benchmarks/calibration_cost.py --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import add_json_flag, print_json, stamp  # noqa: E402

from lightning_vlmbalance.balance.calibration import Calibration, OnlineCalibrator  # noqa: E402
from lightning_vlmbalance.balance.cost import CostModel  # noqa: E402


def records(truth: CostModel, n: int, rng: np.random.Generator) -> list[dict]:
    images = rng.integers(0, 4, size=n)
    out = []
    for k in range(n):
        sizes = rng.integers(64, 1281, size=int(images[k])).astype(np.int64)
        docs = rng.integers(64, 2048, size=int(rng.integers(1, 6))).astype(np.int64)
        feats = {
            "total_tokens": int(rng.integers(2048, 8193)),
            "image_tokens": int(sizes.sum()),
            "images": int(images[k]),
            "doc_sq_tokens": int((docs**2).sum()),
            "image_sq_tokens": int((sizes**2).sum()),
        }
        pred = truth.predict({f: [v] for f, v in feats.items()})
        noise = rng.normal(1.0, 0.02, size=3)
        out.append(
            {
                **feats,
                "vision_fwd_ms": float(pred["vision_fwd"][0] * noise[0]),
                "llm_fwd_ms": float(pred["llm_fwd"][0] * noise[1]),
                "backward_ms": float((pred["vision_bwd"][0] + pred["llm_bwd"][0]) * noise[2]),
            }
        )
    return out


def measure(window_steps: int, ranks: int, micro: int, every: int, step_ms: float, reps: int):
    rng = np.random.default_rng(0)
    truth = CostModel()
    config = Calibration(every_n_steps=every, window_steps=window_steps, min_records=8)
    cal = OnlineCalibrator(CostModel(), config)
    for step in range(window_steps):
        cal.add(step, records(truth, ranks * micro, rng))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        cal.refit(adopt=False)
        times.append((time.perf_counter() - start) * 1e3)
    refit_ms = statistics.median(times)
    return {
        "window_steps": window_steps,
        "ranks": ranks,
        "micro_batches": micro,
        "records": cal.records,
        "refit_ms": round(refit_ms, 3),
        "every_n_steps": every,
        "step_ms": step_ms,
        "share_of_steps": round(refit_ms / (every * step_ms), 6),
        "share_of_one_step": round(refit_ms / step_ms, 6),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", default="100,400", help="window_steps values (comma list)")
    p.add_argument("--ranks", default="2,8,64", help="ranks whose records fill the window")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--step-ms", type=float, default=410.0, help="the main job's step, 2 CPU ranks")
    p.add_argument("--reps", type=int, default=5)
    add_json_flag(p)
    args = p.parse_args(argv)
    rows = [
        measure(int(w), int(r), args.micro, args.every, args.step_ms, args.reps)
        for w in args.windows.split(",")
        for r in args.ranks.split(",")
    ]
    for row in rows:
        print(
            f"window {row['window_steps']} steps x {row['ranks']} ranks x"
            f" {row['micro_batches']} micro = {row['records']} records: refit"
            f" {row['refit_ms']:.1f} ms = {row['share_of_steps']:.3%} of the"
            f" {row['every_n_steps']} steps between refits ({row['share_of_one_step']:.1%} of one"
            f" {row['step_ms']:.0f} ms step)"
        )
    if args.json:
        print_json({**stamp("numpy"), "rows": rows})


if __name__ == "__main__":
    main()
