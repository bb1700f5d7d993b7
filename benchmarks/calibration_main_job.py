"""A wrong cost model hurts, and online calibration repairs it: the main job on 2 CPU ranks.

    python -m benchmarks.calibration_main_job [--json] [--num-samples 3600] [--rounds 1]

Every run is ``python -m examples.train`` (2 processes, gloo) on the same samples (the example
data: images of 16 to 768 tokens, 1-3 per sample; ``--text-share`` text samples, 0.5 by
default), one epoch, balanced at the source (``--balance-mode source``: the sampler forms each
global batch by cost):

1. ``off`` with calibration off: the baseline, and the monitor logs the offline fit is fitted to
   (``CostModel.fit``, the flow before online calibration);
2. two wrong models derived from that fit, as the issue defines them:
   ``count`` weighs image *count* instead of image tokens (each vision phase's per-token and
   per-squared-token cost moved onto the image count at the data's mean image) with the LLM's
   attention term x1000; ``scale`` is vision x0.1 and LLM x10;
3. ``source`` from the offline fit, from each wrong model with calibration off, and from each
   wrong model with calibration on (``--calibrate-every`` steps between refits).

Reported per run: the waiting (the share of rank-time spent at synchronisation points, from the
StragglerMonitor's JSON lines), the optimizer step whose result was first adopted, and the
waiting over the steps after the first adopted model took over the plan (the sampler re-plans
the rest of its epoch from the first global batch no rank has read, one global batch later).
Timings on this machine are noisy: ``--rounds N`` repeats every run N times (ABBA order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import lightning_vlmbalance as vb
from lightning_vlmbalance.timing import WAIT_PHASES

ROOT = Path(__file__).resolve().parents[1]


def main_job(root: Path, name: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One ``examples.train`` run; its SUMMARY_JSON's mode entry and its per-step waiting."""
    out = root / name
    cmd = [
        sys.executable,
        "-m",
        "examples.train",
        "--root",
        str(out),
        "--no-progress-bar",
        "--num-samples",
        str(args.num_samples),
        "--calibrate-every",
        str(args.calibrate_every),
        "--text-share",
        str(args.text_share),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLMBALANCE_MAIN_JOB_DIR", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    summary = json.loads(line.removeprefix("SUMMARY_JSON "))
    run = next(iter(summary["modes"].values()))
    run["waits_by_step"] = waits_by_step(Path(run["log_dir"]) / "straggler")
    return run


def waits_by_step(folder: Path) -> dict[int, tuple[float, float]]:
    """Per optimizer step: (wait ms, step ms), summed over the ranks."""
    steps: dict[int, list[float]] = {}
    for path in sorted(folder.glob("rank_*.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            wait = sum(row["phases_ms"].get(p, 0.0) for p in WAIT_PHASES)
            acc = steps.setdefault(int(row["global_step"]), [0.0, 0.0])
            acc[0] += wait
            acc[1] += row["step_ms"]
    return {k: (v[0], v[1]) for k, v in sorted(steps.items())}


def waiting(waits: dict[int, tuple[float, float]], after: int = 0) -> float:
    """The share of rank-time spent waiting over the steps after ``after``."""
    rows = [v for k, v in waits.items() if k > after]
    total = sum(t for _, t in rows)
    return sum(w for w, _ in rows) / total if total > 0 else float("nan")


def micro_records(folder: Path) -> list[dict[str, Any]]:
    return [
        m
        for path in sorted(folder.glob("rank_*.jsonl"))
        for row in map(json.loads, path.read_text().splitlines())
        for m in row["micro"]
    ]


def wrong_models(fitted: vb.CostModel, records: list[dict[str, Any]]) -> dict[str, vb.CostModel]:
    """The issue's two wrong models, derived from the offline fit."""
    images = sum(r["images"] for r in records)
    per_image = sum(r["image_tokens"] for r in records) / max(images, 1)
    sq_per_image = sum(r["image_sq_tokens"] for r in records) / max(images, 1)
    count = fitted.to_dict()
    for phase, terms in count["coefficients"].items():
        if phase.startswith("vision"):  # the same mean cost, all of it on the image count
            terms["images"] += terms["image_tokens"] * per_image
            terms["images"] += terms["image_sq_tokens"] * sq_per_image
            terms["image_tokens"] = terms["image_sq_tokens"] = 0.0
        else:
            terms["doc_sq_tokens"] *= 1000.0
    scale = fitted.to_dict()
    for phase, terms in scale["coefficients"].items():
        for term in terms:
            terms[term] *= 0.1 if phase.startswith("vision") else 10.0
    return {"count": vb.CostModel.from_dict(count), "scale": vb.CostModel.from_dict(scale)}


def steps_to_reach(waits: dict[int, tuple[float, float]], target: float, window: int) -> int | None:
    """The first step from which every later ``window``-step span waits at most ``target``
    on average (``None``: never)."""
    keys = list(waits)
    spans = [
        (keys[i], waiting({k: waits[k] for k in keys[i : i + window]}))
        for i in range(0, max(len(keys) - window + 1, 0))
    ]
    for i, (start, _) in enumerate(spans):
        if all(w <= target for _, w in spans[i:]):
            return start
    return None


def planned_waste(args: argparse.Namespace, models: dict[str, vb.CostModel]) -> dict[str, float]:
    """The waste the offline fit predicts for the source plan each model forms on this job's
    samples (``examples.train.plan_waste``: per optimizer step, 1 - mean rank cost / slowest),
    and for the unbalanced plan (``none``)."""
    from examples.train import build_table, plan_waste

    job = argparse.Namespace(
        data=None,
        num_samples=args.num_samples,
        text_share=args.text_share,
        tile_tokens=16,
        seq_len=1024,
        seed=0,
        image_sizes=None,
    )
    table = build_table(job)
    out = {}
    for name, model in [("none", None), *models.items()]:
        sampler = vb.PackingSampler(
            table.total_tokens,
            table.image_tokens,
            images=table.images,
            seq_len=job.seq_len,
            num_replicas=2,
            rank=0,
            seed=job.seed,
            balance=None
            if model is None
            else vb.SourceBalance(cost_model=model, micro_steps=2, objective="step"),
        )
        out[name] = round(plan_waste(sampler.plan(), sampler, models["fit"], 2), 4)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root or tempfile.mkdtemp(prefix="calibration_main_job_"))
    if args.plan_only:  # the planned waste alone, from a saved offline fit and its records
        fitted = vb.CostModel.load(args.plan_only[0])
        models = {"fit": fitted, **wrong_models(fitted, micro_records(Path(args.plan_only[1])))}
        return {"text_share": args.text_share, "planned_waste": planned_waste(args, models)}
    base = main_job(root, "off", args, "--balance-mode", "off", "--no-calibration")
    straggler = Path(base["log_dir"]) / "straggler"
    fitted = vb.CostModel()
    report = fitted.fit(straggler)
    models = {"fit": fitted, **wrong_models(fitted, micro_records(straggler))}
    paths = {}
    for name, model in models.items():
        paths[name] = root / f"{name}.json"
        model.save(paths[name])
    plan = [("fit", False), ("count", False), ("count", True), ("scale", False), ("scale", True)]
    if args.with_fit_calibrated:
        plan.append(("fit", True))
    order = [p for k in range(args.rounds) for p in (plan if k % 2 == 0 else plan[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {}
    for k, (name, calibrate) in enumerate(order):
        label = f"{name}{'+calibration' if calibrate else ''}"
        extra = ["--balance-mode", "source", "--cost-model", str(paths[name])]
        if not calibrate:
            extra.append("--no-calibration")
        run = main_job(root, f"{label}_{k}", args, *extra)
        runs.setdefault(label, []).append(run)
        print(f"# {label}: waiting {run['waste_frac']:.1%}", file=sys.stderr, flush=True)
    reference = float(np.mean([waiting(r["waits_by_step"]) for r in runs["fit"]]))
    rows = {}
    for label, rs in runs.items():
        whole = [waiting(r["waits_by_step"]) for r in rs]
        adopted = [(r.get("calibration") or {}).get("adopted_at_steps", []) for r in rs]
        # the first adopted model plans from the first global batch no rank has read (at most
        # the packs read ahead: 2 more global batches at accumulation 2) plus one
        after = [waiting(r["waits_by_step"], a[0] + 3) if a else None for r, a in zip(rs, adopted)]
        reach = [steps_to_reach(r["waits_by_step"], 1.2 * reference, args.window) for r in rs]
        rows[label] = {
            "waiting": [round(w, 4) for w in whole],
            "waiting_mean": round(float(np.mean(whole)), 4),
            "vs_fit": round(float(np.mean(whole)) / reference, 3),
            "first_adopted_step": [a[0] if a else None for a in adopted],
            "adopted_steps": adopted,
            "waiting_after_first_adoption": [None if x is None else round(x, 4) for x in after],
            "after_vs_fit": [None if x is None else round(x / reference, 3) for x in after],
            f"steps_until_{args.window}_step_windows_within_1.2x": reach,
            "steps": rs[0]["optimizer_steps"],
            "tokens_per_s": [r["tokens_per_s"] for r in rs],
            "final_model": rs[-1].get("final_model"),
        }
    return {
        "num_samples": args.num_samples,
        "text_share": args.text_share,
        "calibrate_every": args.calibrate_every,
        "rounds": args.rounds,
        "off_waiting": round(waiting(base["waits_by_step"]), 4),
        "offline_fit": str(report),
        "models": {k: v.to_dict() for k, v in models.items()},
        "reference_waiting": round(reference, 4),
        "planned_waste_under_the_fit": planned_waste(args, models),
        "off_records": str(straggler),
        "runs": rows,
        "root": str(root),
    }


def calibration_errors(log_dir: str) -> dict[int, float]:
    """``calibration/mape_total_ms`` by optimizer step: the model in use's error on the newest
    records at each calibration point (rank 0's TensorBoard scalars)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {int(e.step): float(e.value) for e in acc.Scalars("calibration/mape_total_ms")}


def stage_change(args: argparse.Namespace, root: Path, model: Path | None) -> dict[str, Any]:
    """The vision tower frozen until ``--unfreeze-at`` (its backward appears then), balanced at
    the source with calibration on: the in-use model's error at each calibration point, its
    level before the change (the mean over the points from the first adopted refit to the
    change), and the refit periods after the change until it is back under that level; found
    by calibration itself, and told (``strategy.cost_changed()``)."""
    out: dict[str, Any] = {"unfreeze_at": args.unfreeze_at}
    for told in (False, True):
        label = "told" if told else "detected"
        extra = ["--balance-mode", "source", "--unfreeze-vision-at", str(args.unfreeze_at)]
        if model is not None:
            extra += ["--cost-model", str(model)]
        if told:
            extra.append("--tell-cost-change")
        run = main_job(root, f"stage_{label}", args, *extra)
        errors = calibration_errors(run["log_dir"])
        k = args.unfreeze_at
        adopted = (run.get("calibration") or {}).get("adopted_at_steps") or [0]
        # the level of the frozen stage: every point after the first adopted refit (the
        # defaults' error before it says nothing of calibration) up to the change
        before = [e for step, e in errors.items() if adopted[0] < step <= k]
        level = float(np.mean(before)) if before else float("nan")
        after = [(step, e) for step, e in errors.items() if step > k]
        back = next((n for n, (_, e) in enumerate(after, start=1) if e <= level), None)
        out[label] = {
            "errors_by_step": {str(s): round(e, 4) for s, e in errors.items()},
            "pre_change_level": round(level, 4),
            "after_change": [[s, round(e, 4)] for s, e in after[:4]],
            "refit_periods_until_back_under": back,
            "adopted_steps": (run.get("calibration") or {}).get("adopted_at_steps"),
        }
        print(f"# stage change ({label}): back after {back} periods", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--num-samples", type=int, default=3600)
    p.add_argument("--calibrate-every", type=int, default=5)
    p.add_argument(
        "--text-share",
        type=float,
        default=0.5,
        help="text-only samples (the main job's default is 0.7; at 0.5 the offline fit balances"
        " to ~1% planned waste, so a wrong model's cost shows above the timing noise)",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--window", type=int, default=10, help="steps per span (steps to reach)")
    p.add_argument("--with-fit-calibrated", action="store_true", help="also: fit + calibration")
    p.add_argument("--root", help="where the runs write (default: a temporary folder)")
    p.add_argument(
        "--stage-change",
        action="store_true",
        help="only the stage change: the vision tower unfrozen at --unfreeze-at",
    )
    p.add_argument("--unfreeze-at", type=int, default=40)
    p.add_argument(
        "--plan-only",
        nargs=2,
        metavar=("FIT_JSON", "OFF_RECORDS"),
        help="no training: the planned waste of each model's source plan under a saved offline"
        " fit (FIT_JSON), the wrong models derived with the off run's records (a folder)",
    )
    args = p.parse_args(argv)
    if args.stage_change:
        root = Path(args.root or tempfile.mkdtemp(prefix="calibration_stage_change_"))
        out = stage_change(args, root, None)
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return
    out = run(args)
    if args.json or args.plan_only:
        print(json.dumps(out))
        return
    print(f"off (baseline) waits {out['off_waiting']:.1%}; offline fit: {out['offline_fit']}")
    print("| run | waiting | vs fit | first adopted at step | waiting after it | vs fit |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in out["runs"].items():
        after = [x for x in r["waiting_after_first_adoption"] if x is not None]
        tail = (
            f"{r['first_adopted_step']} | {np.mean(after):.1%} |"
            f" {np.mean(after) / out['reference_waiting']:.2f}x |"
            if after
            else "- | - | - |"
        )
        print(f"| {label} | {r['waiting_mean']:.1%} | {r['vs_fit']:.2f}x | {tail}")


if __name__ == "__main__":
    main()
