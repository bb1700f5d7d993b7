"""Validates ``vlmbalance-sim`` against measured step times of the emulated multi-rank benchmark.

    python benchmarks/sim_validate.py --ranks 2,4,8 --ga 8 --steps 20 --text-share 0.4 --json

For each rank count it runs ``benchmarks/rebalance_e2e.py --mode overlap`` (which runs ``off``
first) with ``--timings-dir``, so every emulated rank writes StragglerMonitor-schema JSON lines
(per micro-batch: pack features and the measured vision forward, LLM forward and backward times).
It then calibrates one :class:`CostModel` from all of those logs (``CostModel.fit``, as
``vlmbalance-sim calibrate`` does), replays the same packs through
:func:`lightning_vlmbalance.sim.simulate` (``replay=True``: the sampler's deal, the real
planner), and compares the predicted with the measured mean step time of every (ranks, mode).
The step overhead (all-reduce latency and wake-up jitter, ``a + b log2(ranks)``) is fitted from
the logs of the *other* rank counts (leave one out, :class:`StepOverhead`), so a configuration's
own measurements never enter its prediction's overhead; the rows are printed with and without
it. It prints the mean absolute percentage error with the overhead (goal: <= 5%) and without.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import add_json_flag, print_json, stamp  # noqa: E402
from packing import load  # noqa: E402

from lightning_vlmbalance.balance.cost import CostModel  # noqa: E402
from lightning_vlmbalance.sim import ExchangeModel, StepOverhead, simulate  # noqa: E402
from lightning_vlmbalance.synthetic import take_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--ga", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--text-share", type=float, default=0.4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--time-scale", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    measured: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = []
        for R in ranks:
            folder = Path(tmp) / f"r{R}"
            cmd = [
                sys.executable,
                str(ROOT / "benchmarks" / "rebalance_e2e.py"),
                *("--ranks", str(R), "--ga", str(args.ga), "--steps", str(args.steps)),
                *("--warmup", str(args.warmup), "--mode", "overlap"),
                *("--text-share", str(args.text_share), "--seq-len", str(args.seq_len)),
                *("--time-scale", str(args.time_scale), "--seed", str(args.seed)),
                *("--timings-dir", str(folder), "--json"),
                *("--read-ahead", "0"),  # as recorded: reading in line in every mode
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            report = json.loads(out.stdout.strip().splitlines()[-1])
            for mode in ("off", "overlap"):
                measured[(R, mode)] = report["modes"][mode]["step_ms"]
                logs += sorted((folder / mode).glob("rank_*.jsonl"))
        model = CostModel()
        records, steps = [], []
        for f in logs:
            for line in f.read_text().splitlines():
                step = json.loads(line)
                records += step["micro"]
                steps.append({**step, "run": str(f.parent)})
        fit = model.fit(records)
        overhead = StepOverhead.fit(steps)
    # the same mix the benchmark packed (its loader, its overlong filter)
    table, _ = load(argparse.Namespace(data=None, text_share=args.text_share, seed=args.seed))
    table = take_rows(table, np.flatnonzero(table.total_tokens <= args.seq_len))
    rows = []
    for R in ranks:
        for with_overhead in (False, True):
            sims = simulate(
                table,
                seq_len=args.seq_len,
                cost_model=model,
                dp=[R],
                ga=[args.ga],
                modes=["off", "overlap"],
                exchange=ExchangeModel(plan_ms=0.0),
                batches=args.steps,
                seed=args.seed,
                replay=True,
                replay_skip=args.warmup,
                # fitted on the other rank counts only: R's own steps never inform R's prediction
                step_overhead=(
                    StepOverhead.fit([st for st in steps if st["world_size"] != R])
                    if with_overhead
                    else None
                ),
            )
            for s in sims:
                m = measured[(R, s["mode"])]
                rows.append(
                    {
                        "ranks": R,
                        "mode": s["mode"],
                        "step_overhead": with_overhead,
                        "measured_step_ms": round(m, 2),
                        "predicted_step_ms": round(s["step_ms"], 2),
                        "ape": round(abs(s["step_ms"] - m) / m, 4),
                    }
                )
    mape = float(np.mean([r["ape"] for r in rows if r["step_overhead"]]))
    mape_compute_only = float(np.mean([r["ape"] for r in rows if not r["step_overhead"]]))
    out = {
        "ga": args.ga,
        "steps": args.steps,
        "text_share": args.text_share,
        "time_scale": args.time_scale,
        "fit": str(fit),
        "step_overhead": {
            "base_ms": overhead.base_ms,
            "per_log2_rank_ms": overhead.per_log2_rank_ms,
        },
        "rows": rows,
        "mape": round(mape, 4),
        "mape_compute_only": round(mape_compute_only, 4),
        **stamp("numpy", "torch"),
    }
    if args.json:
        print_json(out)
        return
    print(f"cost model fit on {len(records)} micro-batches: {fit}")
    print(f"step overhead: {overhead}")
    for r in rows:
        print(
            f"ranks {r['ranks']:>2} {r['mode']:>8} overhead {r['step_overhead']!s:>5}: measured"
            f" {r['measured_step_ms']:8.2f} ms, predicted {r['predicted_step_ms']:8.2f} ms"
            f" ({r['ape']:.1%})"
        )
    print(f"MAPE {mape:.2%} (compute only, no step overhead: {mape_compute_only:.2%})")


if __name__ == "__main__":
    main()
