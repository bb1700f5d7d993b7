"""Benchmark of the rebalance planner on global batches of real packs.

What it does, per configuration (data-parallel size ``dp``, micro-steps ``ga``, objective):

1. Resamples the sample mix at ``--text-share`` as ``benchmarks/packing.py`` does (same data
   options), replicating it with fresh shuffles until every rank's shard holds ``--batches``
   global batches, and builds the real epoch plan (``build_epoch_plan``: contiguous shard per
   rank, greedy packing at ``--seq-len``).
2. Forms global batches in reading order: batch ``b`` is packs ``b*ga .. b*ga+ga-1`` of every
   rank. Pack costs come from the default ``CostModel`` (integer microseconds).
3. Plans each batch with ``plan_rebalance`` and reports means over the batches:
   ``waste_baseline`` (no rebalancing), ``waste_planned``, ``waste_lower_bound`` (waste =
   1 - mean-rank time / slowest-rank time under the objective's synchronisation model),
   ``moved_fraction`` (packs that change rank / packs), ``moved_fraction_naive`` (the sorted-runs
   plan where a pack stays whenever its rank's slot in that micro-step is free), and
   ``plan_ms`` (median wall time of one ``plan_rebalance`` call, single thread, over
   ``--repeat`` timed calls of every batch).

Checks on every run (exit status 1 on failure): each plan is a permutation of the batch's packs
within the tolerance budget; ``microstep``/``both`` plans never move more packs than the naive
plan; at tolerance 0 the ``microstep`` value equals the lower bound.

Commands (from the repository root, virtualenv active)::

    python benchmarks/planner.py --text-share 0.2 --dp 64 --ga 8 --objective microstep --json
    python benchmarks/planner.py --text-share 0.4 --dp 8,64,512,4096 --ga 1,4,8,16 \\
        --objective microstep,step --tolerance 0 --json

With several values in ``--dp``, ``--ga`` or ``--objective`` the JSON object has one entry per
configuration in ``rows``; with one of each, the configuration's fields are at the top level.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from common import add_json_flag, print_json, stamp, timed
from packing import BenchmarkError, load

from lightning_vlmbalance.balance import (
    OBJECTIVES,
    CostModel,
    features_from_packs,
    naive_moved_packs,
    plan_rebalance,
)
from lightning_vlmbalance.packing import PackingConfig, Packs, build_epoch_plan
from lightning_vlmbalance.sim.cli import comma_list
from lightning_vlmbalance.synthetic import LengthTable


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark the rebalance planner on real packs.")
    parser.add_argument("--data", action="append", type=Path, default=None, metavar="CSV")
    parser.add_argument("--text-share", type=float, required=True, metavar="F")
    parser.add_argument("--seq-len", type=int, default=8192, metavar="N")
    parser.add_argument("--dp", type=comma_list(int, minimum=1), required=True, metavar="N[,N...]")
    parser.add_argument("--ga", type=comma_list(int, minimum=1), required=True, metavar="M[,M...]")
    parser.add_argument(
        "--objective",
        type=comma_list(choices=OBJECTIVES),
        default=["microstep"],
        metavar="O[,O...]",
    )
    parser.add_argument("--tolerance", type=float, default=0.0, metavar="T")
    parser.add_argument("--batches", type=int, default=4, metavar="B", help="global batches")
    parser.add_argument("--repeat", type=int, default=3, metavar="R", help="timed plan calls")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.batches < 1 or args.repeat < 1:
        parser.error("--seq-len, --batches and --repeat must be >= 1")
    if not 0.0 <= args.text_share < 1.0:
        parser.error(f"--text-share {args.text_share} must be in [0, 1)")
    if not (args.tolerance >= 0.0 and math.isfinite(args.tolerance)):
        parser.error(f"--tolerance {args.tolerance} must be >= 0")
    args.window = 4096  # as benchmarks/packing.py; used by load() only for its signature
    return args


def replicate(table: LengthTable, copies: int, seed: int) -> LengthTable:
    """``copies`` independently shuffled copies of the rows, one after the other."""
    rng = np.random.default_rng([seed, 1])
    rows = np.concatenate(
        [np.arange(len(table.total_tokens))]
        + [rng.permutation(len(table.total_tokens)) for _ in range(copies - 1)]
    )
    return LengthTable(
        total_tokens=np.asarray(table.total_tokens)[rows],
        image_tokens=np.asarray(table.image_tokens)[rows],
        images=np.asarray(table.images)[rows],
    )


def rank_costs(
    table: LengthTable, dp: int, packs_needed: int, args: argparse.Namespace
) -> tuple[np.ndarray, float, int]:
    """``(dp, packs_needed)`` integer pack costs in reading order, packing efficiency, samples."""
    total = np.asarray(table.total_tokens, dtype=np.int64)
    keep = total <= args.seq_len
    tokens_per_pack = args.seq_len * 0.99
    per_sample = float(total[keep].mean())
    need_samples = dp * (packs_needed + 2) * tokens_per_pack / per_sample
    copies = max(1, math.ceil(need_samples / keep.sum()))
    for _ in range(4):
        big = replicate(table, copies, args.seed)
        t = np.asarray(big.total_tokens, dtype=np.int64)
        ok = t <= args.seq_len
        t, i, n = t[ok], np.asarray(big.image_tokens)[ok], np.asarray(big.images)[ok]
        plan = build_epoch_plan(
            t, i, PackingConfig(seq_len=args.seq_len, seed=args.seed), num_replicas=dp, epoch=0
        )
        if plan.packs_per_rank >= packs_needed:
            break
        copies *= 2
    else:  # pragma: no cover - the estimate is generous
        raise BenchmarkError(f"could not form {packs_needed} packs per rank at dp={dp}")
    chosen = [plan.rank_packs[r][:packs_needed] for r in range(dp)]
    flat = [p for packs in chosen for p in packs]
    sizes = np.array([len(p) for p in flat], dtype=np.int64)
    packs = Packs(
        positions=np.concatenate(flat).astype(np.int64),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
    )
    cost = CostModel().pack_cost_us(features_from_packs(packs, t, i, n))
    return cost.reshape(dp, packs_needed), plan.efficiency, len(t)


def run_config(
    cost_RP: np.ndarray, dp: int, ga: int, objective: str, args: argparse.Namespace
) -> dict[str, object]:
    keys = ("waste_baseline", "waste_planned", "waste_lower_bound", "moved", "naive")
    sums = dict.fromkeys(keys, 0.0)
    times: list[float] = []
    failures: list[str] = []
    origin = np.repeat(np.arange(dp, dtype=np.int64), ga)
    for b in range(args.batches):
        cost = np.ascontiguousarray(cost_RP[:, b * ga : (b + 1) * ga]).reshape(-1)
        for _ in range(args.repeat):
            plan, seconds = timed(
                plan_rebalance, cost, origin, dp, ga, objective=objective, tolerance=args.tolerance
            )
            times.append(seconds)
        naive = naive_moved_packs(cost, origin, dp)
        sums["waste_baseline"] += plan.waste_before
        sums["waste_planned"] += plan.waste_after
        sums["waste_lower_bound"] += plan.waste_lower_bound
        sums["moved"] += plan.moved_packs / len(cost)
        sums["naive"] += naive / len(cost)
        if not np.array_equal(np.sort(plan.assignment.reshape(-1)), np.arange(len(cost))):
            failures.append(f"batch {b}: the plan is not a permutation of the packs")
        if objective != "step" and plan.moved_packs > naive:
            failures.append(f"batch {b}: {plan.moved_packs} moves > naive {naive}")
        extra = args.tolerance * plan.optimal_value
        if extra < 2**62 and plan.value > plan.optimal_value + int(extra):
            failures.append(f"batch {b}: value {plan.value} over the tolerance budget")
        if objective == "microstep" and args.tolerance == 0 and plan.value != plan.lower_bound:
            failures.append(f"batch {b}: value {plan.value} != lower bound {plan.lower_bound}")
    n = args.batches
    return {
        "dp": dp,
        "ga": ga,
        "objective": objective,
        "packs_per_batch": dp * ga,
        "waste_baseline": round(sums["waste_baseline"] / n, 6),
        "waste_planned": round(sums["waste_planned"] / n, 6),
        "waste_lower_bound": round(sums["waste_lower_bound"] / n, 6),
        "moved_fraction": round(sums["moved"] / n, 6),
        "moved_fraction_naive": round(sums["naive"] / n, 6),
        "plan_ms": round(float(np.median(times)) * 1e3, 3),
        "failures": failures,
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    table, source = load(args)
    rows: list[dict[str, object]] = []
    packing: dict[int, dict[str, object]] = {}
    most_ga = max(args.ga)
    for dp in args.dp:
        cost_RP, efficiency, samples = rank_costs(table, dp, args.batches * most_ga, args)
        packing[dp] = {"efficiency": round(efficiency, 6), "samples": samples}
        for ga in args.ga:
            for objective in args.objective:
                row = run_config(cost_RP, dp, ga, objective, args)
                row["packing_efficiency"] = packing[dp]["efficiency"]
                rows.append(row)
    common = {
        "text_share": args.text_share,
        "seq_len": args.seq_len,
        "tolerance": args.tolerance,
        "batches": args.batches,
        "repeat": args.repeat,
        "seed": args.seed,
        "cost_model": "default",
        "source": source,
        **stamp("numpy"),
    }
    if len(rows) == 1:
        return {**rows[0], **common}
    return {"rows": rows, **common}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = result.get("rows", [result])
    print(f"text_share={args.text_share} tolerance={args.tolerance} batches={args.batches}")
    print(
        f"{'dp':>5} {'ga':>3} {'objective':>9} {'waste base':>10} {'planned':>8} {'bound':>8}"
        f" {'moved':>7} {'naive':>7} {'ratio':>6} {'plan ms':>8}"
    )
    ok = True
    for r in rows:
        ratio = r["moved_fraction"] / r["moved_fraction_naive"] if r["moved_fraction_naive"] else 0
        print(
            f"{r['dp']:>5} {r['ga']:>3} {r['objective']:>9} {r['waste_baseline']:>10.4f}"
            f" {r['waste_planned']:>8.4f} {r['waste_lower_bound']:>8.4f}"
            f" {r['moved_fraction']:>7.3f} {r['moved_fraction_naive']:>7.3f} {ratio:>6.2f}"
            f" {r['plan_ms']:>8.2f}"
        )
        for failure in r["failures"]:
            ok = False
            print(f"error: dp={r['dp']} ga={r['ga']} {r['objective']}: {failure}", file=sys.stderr)
    if args.json:
        print_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
