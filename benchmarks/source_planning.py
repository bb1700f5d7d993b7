"""Planning time of balancing at the source (``PackingSampler(balance=...)``), per global batch.

For each text share and global-batch size ``P = dp x ga``: the shared mixes (as
``benchmarks/packing.py`` loads them, resampled to ``--text-share``), repeated until they hold
``--batches`` global batches, and shuffled; then, on one thread,

- ``form_ms``: forming the epoch's global batches (window, balance, fill: the compiled former),
  divided by the number of global batches;
- ``place_ms``: median over the global batches of placing one batch's packs on ranks and
  micro-steps as ``build_balanced_epoch_plan`` does (pack tokens; with ``ga > 1`` pack features,
  the cost model and ``plan_rebalance``; with ``ga == 1`` every placement is as good);
- ``plan_ms = form_ms + place_ms`` against the goal (``--goal-ms``, 20 ms at 4,096 packs);
- ``packing``: packing efficiency of the full global batches (the epoch's last one excluded),
  and the free tokens per pack at its 50th, 75th and 90th percentiles (``gap_p50`` ...).

The first call compiles the former (numba, cached on disk afterwards; ``NUMBA_CACHE_DIR`` set to
an empty folder shows the cold compile); it is reported as ``first_call_s`` and never counted in
the times. Run it alone: timings share the machine.

    python benchmarks/source_planning.py --text-share 0.4,0 --dp 512,4096 --ga 1,8 --json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np
from common import add_json_flag, print_json, stamp, timed
from packing import BenchmarkError, load

from lightning_vlmbalance.balance import CostModel
from lightning_vlmbalance.balance.source import (
    SourceBalance,
    _place,
    form_balanced_batches,
    sample_costs,
)
from lightning_vlmbalance.sim.cli import comma_list


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Planning time of balancing at the source.")
    parser.add_argument("--data", action="append", type=Path, default=None, metavar="CSV")
    parser.add_argument("--text-share", type=comma_list(float), default=[0.4], metavar="F[,F]")
    parser.add_argument("--seq-len", type=int, default=8192, metavar="N")
    parser.add_argument("--dp", type=comma_list(int, minimum=1), default=[512, 4096])
    parser.add_argument("--ga", type=comma_list(int, minimum=1), default=[1])
    parser.add_argument("--objective", choices=("step", "microstep"), default="step")
    parser.add_argument("--batches", type=int, default=6, metavar="B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goal-ms", type=float, default=20.0)
    add_json_flag(parser)
    return parser.parse_args(argv)


def measure(
    total: np.ndarray,
    image: np.ndarray,
    images: np.ndarray,
    *,
    P: int,
    R: int,
    G: int,
    seq_len: int,
    objective: str,
    batches: int,
    seed: int,
) -> dict[str, float]:
    fits = total <= seq_len
    reps = max(1, -(-(batches + 1) * P * seq_len // int(total[fits].sum())))
    total, image, images = (np.tile(x[fits], reps) for x in (total, image, images))
    model = CostModel()
    cost, fixed = sample_costs(model, total, image, images)
    order = np.random.default_rng(seed).permutation(len(total))
    settings = SourceBalance(micro_steps=G, objective=objective)
    kwargs = dict(
        packs_per_batch=P, seq_len=seq_len, pack_fixed_image_cost=fixed, settings=settings
    )
    # the first call compiles the former, or loads it from numba's cache
    _, first_call_s = timed(form_balanced_batches, order[: 4 * P], total, image, cost, **kwargs)
    formed, form_s = timed(form_balanced_batches, order, total, image, cost, **kwargs)
    form_ms = form_s * 1000 / len(formed)

    def place_one(batch) -> None:
        batch.tokens(total)
        _place(batch, total, image, images, model, R, G, objective)

    place = [timed(place_one, batch)[1] * 1000 for batch in formed]
    full = [b for b in formed if len(b) == P][:-1] or formed[:1]
    packing = float(sum(int(b.tokens(total).sum()) for b in full) / (len(full) * P * seq_len))
    place_ms = statistics.median(place)
    gaps = np.concatenate([seq_len - b.tokens(total) for b in full])
    return {
        "global_batches": len(formed),
        "first_call_s": round(first_call_s, 2),
        "form_ms": round(form_ms, 2),
        "place_ms": round(place_ms, 2),
        "plan_ms": round(form_ms + place_ms, 2),
        "packing": round(packing, 4),
        # free tokens left per pack: what the short samples that close gaps did not fill
        "gap_p50": int(np.percentile(gaps, 50)),
        "gap_p75": int(np.percentile(gaps, 75)),
        "gap_p90": int(np.percentile(gaps, 90)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    try:
        for share in args.text_share:
            table, source = load(argparse.Namespace(**{**vars(args), "text_share": share}))
            cols = (
                np.asarray(x, dtype=np.int64)
                for x in (table.total_tokens, table.image_tokens, table.images)
            )
            total, image, images = cols
            for R in args.dp:
                for G in args.ga:
                    row = {"text_share": share, "dp": R, "ga": G, "packs": R * G}
                    row.update(
                        measure(
                            total,
                            image,
                            images,
                            P=R * G,
                            R=R,
                            G=G,
                            seq_len=args.seq_len,
                            objective=args.objective,
                            batches=args.batches,
                            seed=args.seed,
                        )
                    )
                    row["goal_met"] = row["plan_ms"] <= args.goal_ms if R * G >= 4096 else None
                    rows.append(row)
                    if not args.json:
                        print(row, flush=True)
    except BenchmarkError as err:
        print(f"source_planning: error: {err}", file=sys.stderr)
        return 2
    print("| text share | dp | ga | packs | form ms | place ms | plan ms | packing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['text_share']} | {r['dp']} | {r['ga']} | {r['packs']:,} | {r['form_ms']} |"
            f" {r['place_ms']} | **{r['plan_ms']}** | {r['packing']:.4f} |"
        )
    if args.json:
        print_json(
            {
                "benchmark": "source_planning",
                **stamp("numpy", "numba"),
                "source": source,
                "seq_len": args.seq_len,
                "objective": args.objective,
                "goal_ms": args.goal_ms,
                "rows": rows,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
