"""End-to-end throughput of rebalancing on emulated GPU-bound ranks, with the real exchange.

N processes on this machine each emulate one data-parallel rank whose compute is GPU-bound: a
micro-batch "computes" by sleeping for its pack's cost under the default ``CostModel`` (vision and
LLM, forward and backward) times ``--time-scale``, so 8 ranks fit on 2 cores. Everything else is
real: packs of the real sample mix (``benchmarks/packing.py`` data options; packed at 8,192
tokens by the real epoch plan, one contiguous shard per rank) as ``PackedBatch``-shaped dicts with
real pixel tensors (``image_tokens x --pixel-dim`` float16), the real ``RebalancingLoader`` (feature
all-gather, planner, exchange over a dedicated gloo group, background thread in ``overlap``), and
one all-reduce on the default group at the end of every global batch: DDP's gradient sync, where
every rank waits for the slowest (so the objective is ``"step"``).

Per mode it prints ``steps_per_s`` (optimizer steps per second after ``--warmup`` steps),
``waste_measured`` (1 - mean busy time / step time, over ranks), ``exposed_exchange_ms`` (median
time a rank waited for a rebalanced global batch), ``predicted_gain`` (the planner's step time
without over with rebalancing, minus 1, summed over the measured steps) and ``measured_gain``
(``steps_per_s`` over that of ``off`` in the same invocation, minus 1). ``--mode`` takes a comma
list; ``off`` is always run first as the reference.

Commands (from the repository root, virtualenv active)::

    python benchmarks/rebalance_e2e.py --ranks 8 --ga 8 --steps 30 --mode sync,overlap \\
        --text-share 0.4 --json
    python benchmarks/rebalance_e2e.py --ranks 4 --ga 4 --steps 20 --mode overlap --text-share 0.2

With ``--json`` the last line of stdout is one JSON object: ``{"modes": {mode: {...}}, ...}``
plus the top-level fields of the last mode requested.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import platform
import queue as queue_mod
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from packing import BenchmarkError, load


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="End-to-end rebalancing throughput, emulated ranks.")
    p.add_argument("--data", action="append", type=Path, default=None, metavar="CSV")
    p.add_argument("--text-share", type=float, required=True, metavar="F")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--ga", type=int, default=8, help="micro-batches per rank per optimizer step")
    p.add_argument("--steps", type=int, default=30, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the clock")
    p.add_argument("--mode", default="overlap", help="comma list of off, sync, overlap")
    p.add_argument("--time-scale", type=float, default=0.01, help="sleep = cost x this")
    p.add_argument("--pixel-dim", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per mode, seconds")
    p.add_argument(
        "--timings-dir",
        type=Path,
        default=None,
        help="write StragglerMonitor-schema JSON lines per rank (DIR/<mode>/rank_<r>.jsonl)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    modes = [m for m in args.mode.split(",") if m]
    bad = [m for m in modes if m not in ("off", "sync", "overlap")]
    if bad or not modes:
        p.error(f"--mode {args.mode!r}: modes are off, sync, overlap")
    args.modes = ["off"] + [m for m in modes if m != "off"]
    if args.ranks < 2 or args.ga < 1 or args.steps < 1 or args.warmup < 0:
        p.error("need --ranks >= 2, --ga >= 1, --steps >= 1, --warmup >= 0")
    args.window = 4096
    return args


class EmulatedPacks:
    """This rank's packs as PackedBatch-shaped dicts, built fresh when iterated."""

    def __init__(self, packs: list[np.ndarray], total, image, images, pixel_dim: int) -> None:
        self.packs, self.total, self.image, self.images = packs, total, image, images
        self.pixel_dim = pixel_dim

    def __len__(self) -> int:
        return len(self.packs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        for pid, ids in enumerate(self.packs):
            tot, img, n_img = self.total[ids], self.image[ids], self.images[ids]
            T = int(tot.sum())
            image_sizes = [
                int(v) for i, k in zip(img, n_img) for v in np.full(int(k), i // max(k, 1))
            ]
            text = int((tot - img).sum())
            yield {
                "input_ids": torch.zeros(1, T, dtype=torch.int64),
                "pixel_values": torch.randn(int(img.sum()), self.pixel_dim).to(torch.float16),
                "loss_tokens": max(text - len(ids), 0),
                "global_loss_tokens": 0,
                "meta": {
                    "pack_id": pid,
                    "total_tokens": T,
                    "image_tokens": int(img.sum()),
                    "images": int(n_img.sum()),
                    "doc_lens": [int(t) for t in tot],
                    "image_sizes": image_sizes,
                    "sample_ids": [int(i) for i in ids],
                },
            }


def _rank_main(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    from lightning_vlmbalance.balance import CostModel, RebalancingLoader
    from lightning_vlmbalance.balance.cost import FEATURES
    from lightning_vlmbalance.callbacks.straggler_monitor import pack_features
    from lightning_vlmbalance.packing import PackingConfig, build_epoch_plan

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        table, _ = load(args)
        total = np.asarray(table.total_tokens, dtype=np.int64)
        keep = total <= args.seq_len
        total = total[keep]
        image = np.asarray(table.image_tokens, dtype=np.int64)[keep]
        images = np.asarray(table.images, dtype=np.int64)[keep]
        plan = build_epoch_plan(
            total,
            image,
            PackingConfig(seq_len=args.seq_len, seed=args.seed),
            world_size=world,
            epoch=0,
        )
        need = (args.steps + args.warmup) * args.ga
        if plan.packs_per_rank < need:
            raise BenchmarkError(
                f"the data gives {plan.packs_per_rank} packs per rank, {need} needed: lower"
                " --steps or --ranks"
            )
        packs = plan.rank_packs[rank][:need]
        source = EmulatedPacks(packs, total, image, images, args.pixel_dim)
        model = CostModel()
        group = dist.new_group(backend="gloo")
        loader = RebalancingLoader(
            source,
            micro_steps=args.ga,
            world_size=world,
            rank=rank,
            group=group,
            objective="step",
            mode=mode,
            cost_model=model,
            exchange_timeout_s=120,
        )
        sync = torch.zeros(1)
        micro_records: list[dict[str, Any]] = []
        timings = None
        if args.timings_dir is not None:
            folder = args.timings_dir / mode
            folder.mkdir(parents=True, exist_ok=True)
            timings = open(folder / f"rank_{rank}.jsonl", "w")
        busy = 0.0
        step_start = None
        t0 = 0.0
        for i, batch in enumerate(loader):
            step, micro = divmod(i, args.ga)
            if micro == 0 and step == args.warmup:
                dist.barrier()
                t0 = time.perf_counter()
                last_step_end = t0
                busy = 0.0
                step_start = step
            # the features StragglerMonitor records for this micro-batch, in its schema
            record = pack_features(batch["meta"])
            feats = {k: [record[k]] for k in FEATURES}
            phases = {k: float(v[0]) for k, v in model.predict(feats).items()}
            sleeps = {  # the GPU-bound compute of this micro-batch, phase by phase
                "vision_fwd": phases["vision_fwd"],
                "llm_fwd": phases["llm_fwd"],
                "backward": phases["vision_bwd"] + phases["llm_bwd"],
            }
            for phase, ms in sleeps.items():
                start = time.perf_counter()
                time.sleep(ms * args.time_scale / 1e3)
                record[f"{phase}_ms"] = (time.perf_counter() - start) * 1e3
            seconds = sum(record[f"{phase}_ms"] for phase in sleeps) / 1e3
            if step_start is not None:
                busy += seconds
                micro_records.append(record)
            if micro == args.ga - 1:
                dist.all_reduce(sync)  # DDP's gradient all-reduce: wait for the slowest rank
                if timings is not None and step_start is not None:
                    now = time.perf_counter()
                    timings.write(
                        json.dumps(
                            {
                                "v": 1,
                                "rank": rank,
                                "world_size": world,
                                "global_step": step,
                                "micro_batches": args.ga,
                                "step_ms": (now - last_step_end) * 1e3,
                                "micro": micro_records,
                            }
                        )
                        + "\n"
                    )
                    last_step_end = now
                micro_records = []
        wall = time.perf_counter() - t0
        if timings is not None:
            timings.close()
        stats = list(loader.stats)[args.warmup :]
        q.put(
            (
                rank,
                "ok",
                {
                    "wall_s": wall,
                    "busy_s": busy,
                    "steps": args.steps,
                    "exposed_ms": [s["exposed_exchange_ms"] for s in stats],
                    "exchange_ms": [s["exchange_ms"] for s in stats],
                    "moved": sum(s["moved_packs"] for s in stats),
                    "baseline_value": sum(s.get("baseline_value", 0.0) for s in stats),
                    "planned_value": sum(s.get("planned_value", 0.0) for s in stats),
                },
            )
        )
    except BaseException as err:  # reported, never swallowed
        q.put((rank, "error", f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.ranks, port, mode, args, q))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + args.timeout
    while len(out) < args.ranks and time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=1.0)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if status != "ok":
            raise BenchmarkError(f"mode {mode}: rank {rank} failed: {payload}")
        out[rank] = payload
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if len(out) < args.ranks:
        missing = sorted(set(range(args.ranks)) - set(out))
        raise BenchmarkError(f"mode {mode}: ranks {missing} did not report within the timeout")
    wall = max(o["wall_s"] for o in out.values())
    busy = np.array([o["busy_s"] for o in out.values()])
    exposed = [x for o in out.values() for x in o["exposed_ms"]]
    exchange = [x for o in out.values() for x in o["exchange_ms"]]
    base, planned = out[0]["baseline_value"], out[0]["planned_value"]
    return {
        "mode": mode,
        "steps_per_s": round(args.steps / wall, 4),
        "step_ms": round(wall / args.steps * 1e3, 2),
        "ideal_step_ms": round(float(busy.mean()) / args.steps * 1e3, 2),
        "waste_measured": round(1.0 - float(busy.mean()) / wall, 4),
        "exposed_exchange_ms": round(float(np.median(exposed)), 3) if exposed else 0.0,
        "exchange_ms": round(float(np.median(exchange)), 3) if exchange else 0.0,
        "moved_packs": int(out[0]["moved"]),
        "predicted_gain": round(base / planned - 1.0, 4) if planned else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in args.modes:
            results[mode] = run_mode(mode, args)
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    off = results["off"]["steps_per_s"]
    for r in results.values():
        r["measured_gain"] = round(r["steps_per_s"] / off - 1.0, 4)
        if r["mode"] != "off" and r["predicted_gain"] > 0:
            r["gain_realised"] = round(r["measured_gain"] / r["predicted_gain"], 3)
    print(
        f"ranks={args.ranks} ga={args.ga} steps={args.steps} text_share={args.text_share}"
        f" time_scale={args.time_scale}"
    )
    print(
        f"{'mode':>8} {'steps/s':>8} {'step ms':>8} {'ideal':>8} {'waste':>7} {'exposed':>8}"
        f" {'exch ms':>8} {'moved':>6} {'pred':>7} {'measured':>8}"
    )
    for r in results.values():
        print(
            f"{r['mode']:>8} {r['steps_per_s']:>8.3f} {r['step_ms']:>8.1f}"
            f" {r['ideal_step_ms']:>8.1f} {r['waste_measured']:>7.3f}"
            f" {r['exposed_exchange_ms']:>8.2f}"
            f" {r['exchange_ms']:>8.2f} {r['moved_packs']:>6} {r['predicted_gain']:>7.3f}"
            f" {r['measured_gain']:>8.3f}"
        )
    if args.json:
        import torch

        last = results[args.modes[-1]]
        print(
            json.dumps(
                {
                    **last,
                    "modes": results,
                    "ranks": args.ranks,
                    "ga": args.ga,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "text_share": args.text_share,
                    "time_scale": args.time_scale,
                    "pixel_dim": args.pixel_dim,
                    "date": datetime.date.today().isoformat(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "numpy": np.__version__,
                }
            )
        )
    return 0 if all(math.isfinite(r["steps_per_s"]) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
