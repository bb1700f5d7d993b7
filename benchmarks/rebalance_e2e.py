"""End-to-end throughput of rebalancing on emulated GPU-bound ranks, with the real exchange.

N processes on this machine each emulate one data-parallel rank whose compute is GPU-bound: a
micro-batch "computes" by sleeping for its pack's cost under the default ``CostModel`` (vision and
LLM, forward and backward) times ``--time-scale``, so 8 ranks fit on 2 cores. Everything else is
real: packs of the real sample mix (``benchmarks/packing.py`` data options; packed at 8,192
tokens by the real epoch plan, one contiguous shard per rank) as ``PackedBatch``-shaped dicts with
real pixel tensors (``image_tokens x --pixel-dim`` float16), the real ``RebalancingLoader`` (feature
all-gather, planner, exchange over a dedicated gloo group, background thread in ``overlap``), and
one all-reduce on the default group at the end of every global batch: DDP's gradient sync, where
every rank waits for the slowest (so the objective is ``"step"``). ``--sync-every microstep``
all-reduces after every micro-batch instead, as FSDP's per-micro-batch reduce-scatter makes the
ranks meet under ``"fsdp_vlmbalance"``, and plans with the ``"microstep"`` objective.

Reading is the same in every mode: a reader thread builds the packs ``--read-ahead`` global
batches ahead (real training reads and collates in DataLoader workers while the GPU computes), so
the modes differ only in what the loader does per global batch: the feature all-gather (every
mode: the loss needs the global batch's token count), then planning and exchange (``sync``: in
line; ``overlap``: in the loader's background thread, which also moves the all-gather out of
line). ``--read-ahead 0`` reads in line, as this benchmark did before 2026-11-30, when ``off``
and ``sync`` paid the reading of every global batch and ``overlap`` hid it.

Per mode it prints ``steps_per_s`` (optimizer steps per second after ``--warmup`` steps),
``waste_measured`` (1 - mean busy time / step time, over ranks), ``exposed_exchange_ms`` (median
time a rank waited for the loader's next global batch), ``predicted_gain`` (the planner's step time
without over with rebalancing, minus 1, summed over the measured steps) and ``measured_gain``
(``steps_per_s`` over that of ``off`` in the same invocation, minus 1). ``--mode`` takes a comma
list; ``off`` is always run first as the reference.

Commands (from the repository root, virtualenv active)::

    python benchmarks/rebalance_e2e.py --ranks 8 --ga 8 --steps 30 --mode sync,overlap \\
        --text-share 0.4 --json
    python benchmarks/rebalance_e2e.py --ranks 4 --ga 4 --steps 20 --mode overlap --text-share 0.2
    python benchmarks/rebalance_e2e.py --ranks 8 --ga 8 --steps 30 --mode overlap \\
        --text-share 0.4 --sync-every microstep --json

With ``--json`` the last line of stdout is one JSON object: ``{"modes": {mode: {...}}, ...}``
plus the top-level fields of the last mode requested.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from common import add_json_flag, print_json, stamp, timed
from packing import BenchmarkError, load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness.ranks

from harness.ranks import run_ranks
from lightning_vlmbalance.sim.cli import comma_list
from lightning_vlmbalance.timing import COMPUTE_PHASES

MODES = ("off", "sync", "overlap", "source")
EXCHANGE_TIMEOUT_S = 120.0
GRACE_S = 15.0  # after a rank failed: how much longer than EXCHANGE_TIMEOUT_S the others get
_END = object()  # the reader thread's end of the source


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="End-to-end rebalancing throughput, emulated ranks.")
    p.add_argument("--data", action="append", type=Path, default=None, metavar="CSV")
    p.add_argument("--text-share", type=float, required=True, metavar="F")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--ga", type=int, default=8, help="micro-batches per rank per optimizer step")
    p.add_argument("--steps", type=int, default=30, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before the clock")
    p.add_argument(
        "--mode",
        type=comma_list(choices=MODES),
        default=["overlap"],
        metavar="M[,M...]",
        help="comma list of off, sync, overlap, source (off always runs first; source: the"
        " source-balanced sampler's plan, no exchange)",
    )
    p.add_argument(
        "--read-ahead",
        type=int,
        default=2,
        metavar="B",
        help="global batches read and built ahead by a reader thread, in every mode"
        " (0: in line, as before 2026-11-30)",
    )
    p.add_argument(
        "--sync-every",
        choices=("step", "microstep"),
        default="step",
        help="step: one all-reduce per optimizer step (DDP under 'vlmbalance'); microstep: one"
        " after every micro-batch (FSDP, 'fsdp_vlmbalance'); the planner's objective follows",
    )
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
    add_json_flag(p)
    args = p.parse_args(argv)
    args.modes = ["off"] + [m for m in dict.fromkeys(args.mode) if m != "off"]
    if args.ranks < 2 or args.ga < 1 or args.steps < 1 or args.warmup < 0 or args.read_ahead < 0:
        p.error("need --ranks >= 2, --ga >= 1, --steps >= 1, --warmup >= 0, --read-ahead >= 0")
    args.window = 4096
    return args


class ReadAhead:
    """Iterates ``source`` in a reader thread that keeps up to ``depth`` batches ready.

    Stands for the DataLoader workers of real training, which read and collate the next batches
    while the GPU computes the current one. Every mode gets the same read-ahead, so what differs
    between modes is the rebalancing alone. ``depth`` 0: ``source`` is read in line.
    """

    def __init__(self, source: EmulatedPacks, depth: int) -> None:
        self.source, self.depth = source, depth

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.depth == 0:
            yield from self.source
            return
        ready: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def read() -> None:
            try:
                for batch in self.source:
                    if not put(batch):
                        return
                put(_END)
            except BaseException as err:  # raised in the consumer
                put(err)

        reader = threading.Thread(target=read, name="e2e-read-ahead", daemon=True)
        reader.start()
        try:
            while (item := ready.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            reader.join()


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


# -- one rank ---------------------------------------------------------------------------------


def _rank_packs(
    rank: int, world: int, args: argparse.Namespace, mode: str = "off"
) -> EmulatedPacks:
    """This rank's first ``(--warmup + --steps) * --ga`` packs of the real epoch plan (mode
    ``source``: of the source-balanced plan, ``PackingSampler(balance=True)``'s)."""
    from lightning_vlmbalance.balance import CostModel
    from lightning_vlmbalance.balance.source import SourceBalance, build_balanced_epoch_plan
    from lightning_vlmbalance.packing import PackingConfig, build_epoch_plan

    table, _ = load(args)
    total = np.asarray(table.total_tokens, dtype=np.int64)
    keep = total <= args.seq_len
    total = total[keep]
    image = np.asarray(table.image_tokens, dtype=np.int64)[keep]
    images = np.asarray(table.images, dtype=np.int64)[keep]
    config = PackingConfig(seq_len=args.seq_len, seed=args.seed)
    if mode == "source":
        balance = SourceBalance(micro_steps=args.ga, objective=args.sync_every)
        plan = build_balanced_epoch_plan(
            total,
            image,
            images,
            config,
            num_replicas=world,
            epoch=0,
            balance=balance,
            cost_model=CostModel(),
        )
    else:
        plan = build_epoch_plan(total, image, config, num_replicas=world, epoch=0)
    need = (args.steps + args.warmup) * args.ga
    if plan.packs_per_rank < need:
        raise BenchmarkError(
            f"the data gives {plan.packs_per_rank} packs per rank, {need} needed: lower"
            " --steps or --ranks"
        )
    return EmulatedPacks(plan.rank_packs[rank][:need], total, image, images, args.pixel_dim)


def _compute(batch: dict[str, Any], model: Any, time_scale: float) -> dict[str, Any]:
    """Emulates the GPU-bound compute of one micro-batch: sleeps for its predicted phases.

    Returns the features StragglerMonitor records for the micro-batch, in its schema, with the
    slept ``<phase>_ms``.
    """
    from lightning_vlmbalance.balance import FEATURES, features_from_meta

    record = {"pack_id": batch["meta"]["pack_id"], **features_from_meta(batch["meta"])}
    phases = {k: float(v[0]) for k, v in model.predict({k: [record[k]] for k in FEATURES}).items()}
    sleeps = {
        "vision_fwd": phases["vision_fwd"],
        "llm_fwd": phases["llm_fwd"],
        "backward": phases["vision_bwd"] + phases["llm_bwd"],
    }
    for phase, ms in sleeps.items():
        record[f"{phase}_ms"] = timed(time.sleep, ms * time_scale / 1e3)[1] * 1e3
    return record


def _busy_s(record: dict[str, Any]) -> float:
    return sum(record[f"{phase}_ms"] for phase in COMPUTE_PHASES) / 1e3


def _step_line(
    rank: int, world: int, step: int, step_ms: float, micro: list[dict[str, Any]]
) -> str:
    """One optimizer step in StragglerMonitor's JSON-lines schema."""
    return json.dumps(
        {
            "v": 1,
            "rank": rank,
            "world_size": world,
            "global_step": step,
            "micro_batches": len(micro),
            "step_ms": step_ms,
            "micro": micro,
        }
    )


def _train(
    loader: Iterable[dict[str, Any]],
    model: Any,
    args: argparse.Namespace,
    rank: int,
    world: int,
    timings: IO[str] | None,
) -> tuple[float, float]:
    """The emulated training loop: compute every micro-batch, all-reduce after each optimizer
    step (DDP's gradient sync: every rank waits for the slowest). Returns ``(wall, busy)``
    seconds of the measured steps (after a barrier at ``--warmup``)."""
    import torch
    import torch.distributed as dist

    sync = torch.zeros(1)
    busy, t0, last_step_end = 0.0, 0.0, 0.0
    micro_records: list[dict[str, Any]] = []
    for i, batch in enumerate(loader):
        step, micro = divmod(i, args.ga)
        measured = step >= args.warmup
        if micro == 0 and step == args.warmup:
            dist.barrier()
            t0 = last_step_end = time.perf_counter()
        record = _compute(batch, model, args.time_scale)
        if measured:
            busy += _busy_s(record)
            micro_records.append(record)
        if args.sync_every == "microstep" and micro < args.ga - 1:
            dist.all_reduce(sync)  # FSDP: every micro-batch's backward reduce-scatters
        if micro == args.ga - 1:
            dist.all_reduce(sync)
            if measured and timings is not None:
                now = time.perf_counter()
                step_ms = (now - last_step_end) * 1e3
                timings.write(_step_line(rank, world, step, step_ms, micro_records) + "\n")
                last_step_end = now
            micro_records = []
    return time.perf_counter() - t0, busy


def _timings_file(args: argparse.Namespace, mode: str, rank: int) -> IO[str] | None:
    if args.timings_dir is None:
        return None
    folder = args.timings_dir / mode
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"rank_{rank}.jsonl", "w")


def _rank_main(rank: int, world: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One emulated rank of one mode (run by ``harness.ranks.run_ranks``)."""
    import torch.distributed as dist

    from lightning_vlmbalance.balance import CostModel
    from lightning_vlmbalance.loaders import RebalancingLoader

    model = CostModel()
    loader = RebalancingLoader(
        ReadAhead(_rank_packs(rank, world, args, mode), depth=args.read_ahead * args.ga),
        micro_steps=args.ga,
        num_replicas=world,
        rank=rank,
        group=dist.new_group(backend="gloo"),
        objective=args.sync_every,
        mode="off" if mode == "source" else mode,  # balanced by the sampler: nothing moves
        cost_model=model,
        exchange_timeout_s=EXCHANGE_TIMEOUT_S,
    )
    timings = _timings_file(args, mode, rank)
    try:
        wall, busy = _train(loader, model, args, rank, world, timings)
    finally:
        if timings is not None:
            timings.close()
    stats = list(loader.stats)[args.warmup :]
    return {
        "wall_s": wall,
        "busy_s": busy,
        "exposed_ms": [s["exposed_exchange_ms"] for s in stats],
        "exchange_ms": [s["exchange_ms"] for s in stats],
        "moved": sum(s["moved_packs"] for s in stats),
        "baseline_value": sum(s.get("baseline_value", 0.0) for s in stats),
        "planned_value": sum(s.get("planned_value", 0.0) for s in stats),
    }


# -- the parent -------------------------------------------------------------------------------


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    res = run_ranks(
        _rank_main,
        args.ranks,
        mode,
        args,
        timeout=args.timeout,
        grace_s=EXCHANGE_TIMEOUT_S + GRACE_S,
    )
    for rank, (status, payload) in sorted(res.items()):
        if status == "error":
            raise BenchmarkError(f"mode {mode}: rank {rank} failed: {payload}")
    missing = sorted(r for r, (status, _) in res.items() if status != "ok")
    if missing:
        raise BenchmarkError(
            f"mode {mode}: ranks {missing} did not report within the timeout (exit codes"
            f" {[res[r][1] for r in missing]})"
        )
    out = {r: payload for r, (_, payload) in res.items()}
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
        f" time_scale={args.time_scale} read_ahead={args.read_ahead}"
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
        last = results[args.modes[-1]]
        print_json(
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
                "read_ahead": args.read_ahead,
                "sync_every": args.sync_every,
                **stamp("torch", "numpy"),
            }
        )
    return 0 if all(math.isfinite(r["steps_per_s"]) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
