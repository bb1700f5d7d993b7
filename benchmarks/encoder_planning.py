"""Benchmark of encoder balancing's planner (``plan_images``) on global batches of real packs.

Encoder balancing leaves every pack on its rank and spreads only the images of each micro-step
over the ranks (``lightning_vlmbalance.balance.images``). This script measures, on the shared
length tables, how much of the step it recovers, how close it comes to the proven lower bound,
how many images it moves and what the planning costs.

What it does, per mix, data-parallel size ``dp`` and micro-steps per global batch ``ga``:

1. Resamples the mix at ``--text-share`` as ``benchmarks/packing.py`` does, replicating it with
   fresh shuffles until every rank holds ``--batches`` global batches (as
   ``benchmarks/planner.py``), and builds the real epoch plan (``build_epoch_plan``, packs of
   ``--seq-len`` tokens). Global batch ``b`` is packs ``b*ga .. b*ga+ga-1`` of every rank.
2. Splits each sample's image tokens evenly over its images (the remainder to the first ones,
   as the simulator does); each image's encoder cost and the encoder's per-call cost come from
   the default ``CostModel().image_cost_ms``, each pack's language-model cost from
   ``CostModel().llm_cost_ms``.
3. With ``ga > 1`` re-orders each rank's packs over the micro-steps (``order_micro_steps``, as
   the runtime does in ``"overlap"`` mode), then plans every micro-step with ``plan_images`` on
   the base load of the runtime: the per-call cost on every rank, the vision encoder alone
   (the embeddings' return synchronises the ranks between the encoder and the language
   model, so a micro-step lasts ``max llm_ms + max plan.load``).

Reported per configuration, means over the global batches (waste = 1 - ideal / step, both
summed over the micro-steps of a batch; ideal = the mean over ranks of ``llm + vision``, the
same with or without the plan):

* ``waste_off``: every image encoded at home and the packs in reading order; a micro-step lasts
  ``max_r (llm + load_home)`` (one synchronisation per micro-step, as under FSDP);
* ``waste_planned``: with the plan, ``max llm + max plan.load`` per micro-step;
* ``waste_bound``: ``max llm + plan.bound``, the least any assignment of the micro-step's
  images could give (for the micro-steps as ordered);
* ``waste_bound_lp``: the same with the configuration LP's tighter bound
  (:func:`benchmarks.image_lp.lp_bound`, for reports only: too slow for the
  planner's search); where it equals ``waste_planned`` the plan is proven optimal;
* ``moved_fraction`` (images encoded away from home / images) and ``images_per_rank`` (images
  per rank and micro-step);
* ``plan_ms``: median wall time of one ``plan_images`` call (single thread, after one untimed
  warm-up call per configuration, so numba's compilation or cache load is not counted);
  ``plan_ms_per_global_batch``: the sum of a batch's ``ga`` calls, median over batches;
  ``order_ms``: the ``order_micro_steps`` call of a batch (``ga > 1``), median over batches,
  not included in the former.

Checks on every plan (exit status 1 on failure): every image is assigned to exactly one rank
in ``[0, dp)`` and the plan's loads are those of its assignment; ``load.max() >= bound``;
``load.max() <= load_home.max()`` (never worse than not moving); with ``ga > 1`` each rank's
order is a permutation of its packs.

Data: without ``--data``, five mixes of the shared CSVs (``shared/data`` next to the checkout):
each omnibal set with ``multipack/openchat_text.csv`` (named ``ai2d``, ``chartqa``, ``docvqa``,
``synthdog``), and all five files together (``all5``); ``--mix`` picks some by name. With
``--data CSV`` (repeatable) the given files form one mix named after them.

Commands (from the repository root, virtualenv active)::

    python benchmarks/encoder_planning.py --text-share 0.4 --dp 8,64,512 --ga 1 --json
    python benchmarks/encoder_planning.py --text-share 0.3 --dp 8,64,512 --ga 1 --json
    python benchmarks/encoder_planning.py --text-share 0.4 --dp 512 --ga 8 --json
    python benchmarks/encoder_planning.py --text-share 0.3 --dp 4 --ga 1,2 --mix all5,docvqa

With ``--json`` the last line of stdout is one JSON object: ``rows`` (one per mix, ``dp`` and
``ga``) and the run's metadata.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import add_json_flag, print_json, stamp, timed
from image_lp import lp_bound
from packing import DEFAULT_FILES, SHARED_DATA, BenchmarkError, load
from planner import replicate

from lightning_vlmbalance.balance import CostModel, features_from_packs
from lightning_vlmbalance.balance.images import PackImages, order_micro_steps, plan_images
from lightning_vlmbalance.packing import PackingConfig, Packs, build_epoch_plan
from lightning_vlmbalance.sim.cli import comma_list
from lightning_vlmbalance.synthetic import LengthTable

TEXT_FILE = "multipack/openchat_text.csv"
ALL = "all5"


def default_mixes() -> dict[str, list[Path]]:
    """Each omnibal set with the text set, and all of them together; empty without the data."""
    files = [SHARED_DATA / name for name in DEFAULT_FILES]
    if not all(f.is_file() for f in files):
        return {}
    text = SHARED_DATA / TEXT_FILE
    mixes = {f.stem.split("_")[0]: [f, text] for f in files if f != text}
    mixes[ALL] = files
    return mixes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark encoder balancing's image planner on real packs."
    )
    parser.add_argument(
        "--data",
        action="append",
        type=Path,
        default=None,
        metavar="CSV",
        help="length table (total_tokens,image_tokens,images); repeatable: one mix of the"
        " files. Default: the five mixes of shared/data (see --mix).",
    )
    parser.add_argument(
        "--mix",
        type=comma_list(),
        default=None,
        metavar="NAME[,NAME...]",
        help="the default mixes to run (ai2d, chartqa, docvqa, synthdog, all5); default all",
    )
    parser.add_argument("--text-share", type=float, default=0.4, metavar="F")
    parser.add_argument("--seq-len", type=int, default=8192, metavar="N")
    parser.add_argument(
        "--dp", type=comma_list(int, minimum=1), default=[8, 64, 512], metavar="N[,N...]"
    )
    parser.add_argument("--ga", type=comma_list(int, minimum=1), default=[1], metavar="M[,M...]")
    parser.add_argument("--batches", type=int, default=8, metavar="B", help="global batches")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.batches < 1:
        parser.error("--seq-len and --batches must be >= 1")
    if not 0.0 <= args.text_share < 1.0:
        parser.error(f"--text-share {args.text_share} must be in [0, 1)")
    if args.data and args.mix:
        parser.error("--mix names default mixes; with --data the files are the one mix")
    return args


def mixes_of(args: argparse.Namespace) -> dict[str, list[Path] | None]:
    """The mixes to run, by name (``None``: synthetic data, where the shared data is absent)."""
    if args.data:
        return {"+".join(Path(f).stem for f in args.data): list(args.data)}
    found = default_mixes()
    if not found:
        if args.mix:
            raise BenchmarkError(f"--mix: the shared data is not at {SHARED_DATA}")
        return {"synthetic": None}
    chosen = args.mix or list(found)
    unknown = [name for name in chosen if name not in found]
    if unknown:
        raise BenchmarkError(f"--mix: unknown {', '.join(unknown)} (known: {', '.join(found)})")
    return {name: found[name] for name in chosen}


@dataclass(frozen=True)
class RankImages:
    """The first packs of every rank and their images: global pack ``p = r * P + k`` is rank
    ``r``'s ``k``-th pack (``images``: the package's ``PackImages`` of those packs)."""

    images: PackImages
    packs_per_rank: int
    efficiency: float
    samples: int


def rank_images(table: LengthTable, dp: int, packs_needed: int, args) -> RankImages:
    """Builds the epoch plan (replicating the table until each rank has ``packs_needed``
    packs, as ``benchmarks/planner.py``) and splits its first packs' samples into images."""
    total = np.asarray(table.total_tokens, dtype=np.int64)
    keep = total <= args.seq_len
    need_samples = dp * (packs_needed + 2) * args.seq_len * 0.99 / float(total[keep].mean())
    copies = max(1, math.ceil(need_samples / keep.sum()))
    for _ in range(4):
        big = replicate(table, copies, args.seed)
        t = np.asarray(big.total_tokens, dtype=np.int64)
        ok = t <= args.seq_len
        t = t[ok]
        i = np.asarray(big.image_tokens, dtype=np.int64)[ok]
        n = np.asarray(big.images, dtype=np.int64)[ok]
        plan = build_epoch_plan(
            t, i, PackingConfig(seq_len=args.seq_len, seed=args.seed), num_replicas=dp, epoch=0
        )
        if plan.packs_per_rank >= packs_needed:
            break
        copies *= 2
    else:  # pragma: no cover - the estimate is generous
        raise BenchmarkError(f"could not form {packs_needed} packs per rank at dp={dp}")
    flat = [p for r in range(dp) for p in plan.rank_packs[r][:packs_needed]]
    packs = Packs.from_lists(flat)
    pack_images = PackImages.of(packs, features_from_packs(packs, t, i, n), i, n, CostModel())
    return RankImages(
        images=pack_images,
        packs_per_rank=packs_needed,
        efficiency=plan.efficiency,
        samples=len(t),
    )


def _check(plan, base: np.ndarray, cost: np.ndarray, dp: int) -> list[str]:
    """What a plan of one micro-step must satisfy (empty when it does)."""
    bad = []
    if plan.encoder.shape != cost.shape or (
        len(cost) and (plan.encoder.min() < 0 or plan.encoder.max() >= dp)
    ):
        bad.append(
            f"{plan.encoder.shape} encoders for {len(cost)} images, or one outside [0, {dp})"
        )
    else:
        load = base + np.bincount(plan.encoder, weights=cost, minlength=dp)
        if not np.allclose(load, plan.load, rtol=1e-12, atol=1e-6):
            bad.append("the plan's loads are not those of its assignment")
    if plan.load.max() < plan.bound - 1e-6:
        bad.append(f"largest load {plan.load.max():.6f} below the bound {plan.bound:.6f}")
    if plan.load.max() > plan.load_home.max() + 1e-6:
        bad.append(f"largest load {plan.load.max():.6f} over home's {plan.load_home.max():.6f}")
    return bad


def _waste(ideal: float, step: float) -> float:
    return 0.0 if step <= 0 else 1.0 - ideal / step


def run_config(data: RankImages, dp: int, ga: int, args: argparse.Namespace) -> dict:
    P, pack_images = data.packs_per_rank, data.images
    base = np.full(dp, pack_images.per_call_ms)
    sums = dict.fromkeys(("off", "planned", "bound", "bound_lp", "moved", "images"), 0.0)
    call_ms: list[float] = []
    batch_ms: list[float] = []
    order_ms: list[float] = []
    failures: list[str] = []
    warm = False
    for b in range(args.batches):
        read = (np.arange(dp, dtype=np.int64) * P)[:, None] + b * ga + np.arange(ga)  # (dp, ga)
        placed = read
        if ga > 1:
            steps, seconds = timed(order_micro_steps, pack_images.vision_ms[read])
            order_ms.append(seconds * 1e3)
            if not np.array_equal(
                np.sort(steps, axis=1), np.broadcast_to(np.arange(ga), steps.shape)
            ):
                failures.append(f"batch {b}: order_micro_steps is not a permutation per rank")
            placed = np.take_along_axis(read, steps, axis=1)
        ideal = step_off = step_planned = step_bound = step_lp = 0.0
        moved = images = 0
        spent = 0.0
        for m in range(ga):
            llm = pack_images.llm_ms[read[:, m]]
            load_home = pack_images.per_call_ms + pack_images.vision_ms[read[:, m]]
            step_off += float((llm + load_home).max())
            ideal += float((llm + load_home).mean())
            packs = placed[:, m]
            index, home = pack_images.of_micro_step(packs)
            cost = pack_images.cost_ms[index]
            if not warm:  # numba's compilation (or cache load) and first-touch costs
                plan_images(base, cost, home)
                warm = True
            plan, seconds = timed(plan_images, base, cost, home)
            call_ms.append(seconds * 1e3)
            spent += seconds * 1e3
            failures += [f"batch {b} micro-step {m}: {bad}" for bad in _check(plan, base, cost, dp)]
            llm = pack_images.llm_ms[packs]
            step_planned += float(llm.max() + plan.load.max())
            step_bound += float(llm.max() + plan.bound)
            tight = lp_bound(
                pack_images.per_call_ms, cost, dp, upper=float(plan.load.max()), lower=plan.bound
            )
            if tight > plan.load.max() + 1e-6:
                failures.append(f"batch {b} micro-step {m}: LP bound {tight} above the plan")
            step_lp += float(llm.max() + tight)
            moved += plan.moved_images
            images += len(cost)
        batch_ms.append(spent)
        sums["off"] += _waste(ideal, step_off)
        sums["planned"] += _waste(ideal, step_planned)
        sums["bound"] += _waste(ideal, step_bound)
        sums["bound_lp"] += _waste(ideal, step_lp)
        sums["moved"] += moved / images if images else 0.0
        sums["images"] += images / (dp * ga)
    n = args.batches
    return {
        "dp": dp,
        "ga": ga,
        "waste_off": round(sums["off"] / n, 6),
        "waste_planned": round(sums["planned"] / n, 6),
        "waste_bound": round(sums["bound"] / n, 6),
        "waste_bound_lp": round(sums["bound_lp"] / n, 6),
        "moved_fraction": round(sums["moved"] / n, 6),
        "images_per_rank": round(sums["images"] / n, 4),
        "plan_ms": round(float(np.median(call_ms)), 4),
        "plan_ms_per_global_batch": round(float(np.median(batch_ms)), 4),
        "order_ms": round(float(np.median(order_ms)), 4) if order_ms else 0.0,
        "failures": failures,
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    rows: list[dict[str, object]] = []
    sources: dict[str, list[str] | str] = {}
    most_ga = max(args.ga)
    for mix, files in mixes_of(args).items():
        table, sources[mix] = load(argparse.Namespace(**{**vars(args), "data": files}))
        for dp in args.dp:
            data = rank_images(table, dp, args.batches * most_ga, args)
            for ga in args.ga:
                row = run_config(data, dp, ga, args)
                rows.append(
                    {
                        "mix": mix,
                        **row,
                        "packing_efficiency": round(data.efficiency, 6),
                        "per_call_ms": round(data.images.per_call_ms, 4),
                    }
                )
    return {
        "rows": rows,
        "text_share": args.text_share,
        "seq_len": args.seq_len,
        "batches": args.batches,
        "seed": args.seed,
        "cost_model": "default",
        "base": "per-call cost (vision alone)",
        "sources": sources,
        "threads": 1,
        **stamp("numpy", "numba"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = result["rows"]
    width = max(len("mix"), *(len(r["mix"]) for r in rows))
    print(f"text_share={args.text_share} seq_len={args.seq_len} batches={args.batches}")
    print(
        f"{'mix':<{width}} {'dp':>5} {'ga':>3} {'img/rank':>8} {'waste off':>9} {'planned':>8}"
        f" {'bound':>8} {'LP bound':>8} {'moved':>7} {'plan ms':>8} {'ms/batch':>9}"
        f" {'order ms':>8}"
    )
    ok = True
    for r in rows:
        print(
            f"{r['mix']:<{width}} {r['dp']:>5} {r['ga']:>3} {r['images_per_rank']:>8.2f}"
            f" {r['waste_off']:>9.4f} {r['waste_planned']:>8.4f} {r['waste_bound']:>8.4f}"
            f" {r['waste_bound_lp']:>8.4f}"
            f" {r['moved_fraction']:>7.3f} {r['plan_ms']:>8.3f}"
            f" {r['plan_ms_per_global_batch']:>9.3f} {r['order_ms']:>8.3f}"
        )
        for failure in r["failures"]:
            ok = False
            print(f"error: {r['mix']} dp={r['dp']} ga={r['ga']}: {failure}", file=sys.stderr)
    if args.json:
        print_json(result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
