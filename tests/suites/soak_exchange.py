"""Soak test of the pack exchange and ``RebalancingLoader``: memory and threads over a long pass.

No model: ``--ranks`` spawned processes joined by gloo on 127.0.0.1 (one thread each) each wrap
an in-memory source of packed batches in a ``RebalancingLoader`` (its own gloo group, as the
strategy uses) and iterate it once: ``--global-batches`` global batches of ``--micro-steps``
packs per rank. The batches are ``PackedBatch``-like dicts built fresh per pack (``input_ids``,
``labels`` ``(1, --seq-len)``; ``pixel_values`` ``(image_tokens, --pixel-dim)`` float32, image
tokens 0..384 in multiples of 64; 1-4 documents; ``meta`` with a unique ``pack_id``), sizes drawn
from a numpy generator seeded with ``(--seed, rank)``, so pack costs differ and packs move.

Measured on every rank, every ``--sample-every`` global batches (and at ``--warmup``): resident
memory (``VmRSS`` of ``/proc/self/status``, MiB), Python threads (``threading.active_count()``),
OS threads (``Threads`` of ``/proc/self/status``) and the packs moved so far (sum of the plans'
``moved_packs``, identical on all ranks), and glibc malloc's bytes in use and free-but-kept
(``mallinfo2``: in-use growth is a leak, free growth with flat in-use is heap fragmentation;
``--malloc-mmap-threshold`` fixes glibc's dynamic mmap threshold to tell the two apart). Thread
counts are also read after every global batch past the warm-up. The last sample is taken after
the pass has ended (the loader's exchange thread joined), with the threads then alive.

Checks (exit status 1, each failure named on stderr):

- every rank yields exactly ``global_batches * micro_steps`` batches, and over all ranks every
  ``pack_id`` exactly once, each intact (``input_ids[0, 0] == pack_id``, shapes match ``meta``);
  the packs that arrive from other ranks add up to the plans' ``moved_packs``;
- ``rss_growth_frac = (RSS after the pass - RSS at --warmup) / RSS at --warmup`` < 2% on every
  rank (``--max-rss-growth``);
- the Python and OS thread counts are the same after every global batch from ``--warmup`` to the
  last but one (``threads_constant``; in the last one the exchange thread may already be done);
- after the pass no ``vlmbalance-exchange`` thread is alive and the Python thread count is back to
  what it was before the pass (``threads_after_pass``);
- some packs moved (else the soak exercises no exchange).

A rank that dies or fails is reported (``missing`` / ``error``) within ``--timeout-s`` overall, or
within ``--exchange-timeout-s`` plus a grace period after the first rank failed; never a hang.

Commands (from the repository root, virtualenv active)::

    python -m tests.suites.soak_exchange --ranks 2 --global-batches 5000 --micro-steps 4 \\
        --mode overlap --sample-every 250 --json
    python -m tests.suites.soak_exchange --ranks 2 --global-batches 5000 --micro-steps 4 \\
        --mode sync --sample-every 250 --json
    # the same with large blocks mmapped (tells heap fragmentation from a leak)
    python -m tests.suites.soak_exchange --global-batches 5000 --malloc-mmap-threshold 32768 \\
        --json
    # smoke run (seconds)
    python -m tests.suites.soak_exchange --ranks 2 --global-batches 300 --warmup 50 \\
        --sample-every 50 --json

The last line of stdout is one JSON object with ``--json``; stdout before it is rank 0's curve.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from harness.ranks import run_ranks  # the spawn harness the tests use

EXCHANGE_THREAD = "vlmbalance-exchange"
IMAGE_CHUNK = 64  # image tokens per image-size unit
GRACE_S = 15.0  # after a rank failed: how much longer than --exchange-timeout-s the others get


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Soak the pack exchange and RebalancingLoader (no model): memory, threads."
    )
    parser.add_argument("--ranks", type=int, default=2, metavar="N")
    parser.add_argument("--global-batches", type=int, default=5000, metavar="B")
    parser.add_argument("--micro-steps", type=int, default=4, metavar="M")
    parser.add_argument("--mode", choices=("overlap", "sync"), default="overlap")
    parser.add_argument("--sample-every", type=int, default=250, metavar="K")
    parser.add_argument(
        "--warmup", type=int, default=500, metavar="W", help="global batches before the baseline"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--seq-len", type=int, default=512, metavar="T")
    parser.add_argument("--pixel-dim", type=int, default=64, metavar="D")
    parser.add_argument("--exchange-timeout-s", type=float, default=60.0, metavar="S")
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, metavar="S", help="deadline of the whole run"
    )
    parser.add_argument("--max-rss-growth", type=float, default=0.02, metavar="F")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set MALLOC_MMAP_THRESHOLD_ in the ranks (default: glibc's dynamic threshold)",
    )
    parser.add_argument(
        "--die-rank",
        type=int,
        default=None,
        metavar="R",
        help="testing the failure path: rank R exits abruptly at global batch --die-at",
    )
    parser.add_argument("--die-at", type=int, default=1, metavar="G")
    parser.add_argument("--json", action="store_true", help="print a JSON line last")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks must be >= 2 (nothing is exchanged on one rank)")
    if min(args.global_batches, args.micro_steps, args.sample_every, args.pixel_dim) < 1:
        parser.error("--global-batches, --micro-steps, --sample-every, --pixel-dim must be >= 1")
    if not 1 <= args.warmup < args.global_batches:
        parser.error(f"--warmup {args.warmup} must be in [1, --global-batches)")
    if args.seq_len < 6 * IMAGE_CHUNK + 8:
        parser.error(f"--seq-len must be >= {6 * IMAGE_CHUNK + 8} (room for 384 image tokens)")
    if not args.exchange_timeout_s > 0 or not args.timeout_s > 0:
        parser.error("--exchange-timeout-s and --timeout-s must be > 0")
    if args.die_rank is not None and not 0 <= args.die_rank < args.ranks:
        parser.error(f"--die-rank must be in [0, {args.ranks})")
    return args


# -- one rank ---------------------------------------------------------------------------------


class PackSource:
    """``count`` packed batches of this rank, built one at a time when iterated.

    Pack ids ``rank * count + i`` are unique over the ranks; ``input_ids[0, 0]`` holds the id
    so a pack that arrives from another rank can be checked.
    """

    def __init__(self, rank: int, count: int, args: argparse.Namespace) -> None:
        self.rank, self.count = rank, count
        self.seq_len, self.pixel_dim, self.seed = args.seq_len, args.pixel_dim, args.seed

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng = np.random.default_rng([self.seed, self.rank])
        for i in range(self.count):
            yield self._pack(rng, self.rank * self.count + i)

    def _pack(self, rng: np.random.Generator, pack_id: int) -> dict[str, Any]:
        T = self.seq_len
        chunks = int(rng.integers(0, 7))  # 0..384 image tokens
        image_sizes: list[int] = []
        while sum(image_sizes) < chunks:  # images of 1 or 2 chunks
            image_sizes.append(min(int(rng.integers(1, 3)), chunks - sum(image_sizes)))
        image_sizes = [n * IMAGE_CHUNK for n in image_sizes]
        image_tokens = sum(image_sizes)
        total = int(rng.integers(max(image_tokens, 1) + 8, T + 1))
        docs = int(rng.integers(1, 5))
        cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False))
        doc_lens = np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()
        segments = doc_lens + ([T - total] if total < T else [])
        cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
        input_ids = torch.from_numpy(rng.integers(0, 32000, size=(1, T), dtype=np.int64))
        input_ids[0, 0] = pack_id
        labels = input_ids.clone()
        labels[0, cu_seqlens[:-1].long()] = -100  # first token of each segment
        labels[0, total:] = -100
        pixel_values = torch.from_numpy(
            rng.standard_normal((image_tokens, self.pixel_dim), dtype=np.float32)
        )
        loss_tokens = total - docs - image_tokens
        return {
            "input_ids": input_ids,
            "labels": labels,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max(segments),
            "pixel_values": pixel_values,
            "loss_tokens": loss_tokens,
            "global_loss_tokens": loss_tokens,
            "meta": {
                "pack_id": pack_id,
                "sample_ids": [pack_id * 4 + d for d in range(docs)],
                "total_tokens": total,
                "image_tokens": image_tokens,
                "doc_lens": doc_lens,
                "images": len(image_sizes),
                "image_sizes": image_sizes,
            },
        }


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_mib() -> tuple[float | None, float | None]:
    """``(in use, free but kept)`` MiB of glibc malloc (``mallinfo2``, all arenas), or ``None``s.

    In-use growth is a leak; free-but-kept growth with flat in-use is heap fragmentation.
    """
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None, None
    fn.restype = _MallInfo2
    info = fn()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def _proc_status() -> tuple[float, int, float]:
    """``(VmRSS MiB, OS threads, VmHWM MiB)`` of this process."""
    fields: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return (
        int(fields["VmRSS"].split()[0]) / 1024,
        int(fields["Threads"]),
        int(fields["VmHWM"].split()[0]) / 1024,
    )


def soak(rank: int, world: int, group: Any, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader

    B, M = args.global_batches, args.micro_steps
    source = PackSource(rank, B * M, args)
    loader = RebalancingLoader(
        source,
        micro_steps=M,
        num_replicas=world,
        rank=rank,
        group=group,
        mode=args.mode,
        exchange_timeout_s=args.exchange_timeout_s,
    )
    points = set(range(args.sample_every, B, args.sample_every)) | {args.warmup}
    seen = np.full(B * M, -1, dtype=np.int64)  # preallocated and touched: no growth while soaking
    samples: list[dict[str, Any]] = []
    bad: list[str] = []
    moved = arrived = yielded = 0
    py_range = [sys.maxsize, 0]  # min/max Python threads, warm-up .. last but one global batch
    os_range = [sys.maxsize, 0]
    checksum = 0.0

    def sample(g: int, after_pass: bool = False) -> None:
        rss, os_threads, _ = _proc_status()
        used, free = _malloc_mib()
        entry = {
            "global_batch": g,
            "rss_mib": round(rss, 2),
            "threads": threading.active_count(),
            "os_threads": os_threads,
            "moved": moved,
            "malloc_used_mib": None if used is None else round(used, 2),
            "malloc_free_mib": None if free is None else round(free, 2),
        }
        if after_pass:
            entry["after_pass"] = True
        samples.append(entry)

    threads_before = threading.active_count()
    sample(0)
    start = time.perf_counter()
    for batch in loader:
        meta = batch["meta"]
        pid = int(meta["pack_id"])
        if yielded < len(seen):
            seen[yielded] = pid
        yielded += 1
        if pid // (B * M) != rank:
            arrived += 1
        if len(bad) < 5 and (
            int(batch["input_ids"][0, 0]) != pid
            or tuple(batch["input_ids"].shape) != (1, args.seq_len)
            or tuple(batch["pixel_values"].shape) != (meta["image_tokens"], args.pixel_dim)
            or sum(meta["doc_lens"]) != meta["total_tokens"]
        ):
            bad.append(f"pack {pid} is damaged (arrived at rank {rank})")
        checksum += float(batch["pixel_values"].sum())
        del batch, meta
        if yielded % M:
            continue
        g = yielded // M
        moved = loader.moved_packs_total
        if args.die_rank == rank and g == args.die_at:
            os._exit(3)  # testing the failure path: no report, no cleanup
        if args.warmup <= g < B:
            py, ost = threading.active_count(), _proc_status()[1]
            py_range[:] = [min(py_range[0], py), max(py_range[1], py)]
            os_range[:] = [min(os_range[0], ost), max(os_range[1], ost)]
        if g in points:
            sample(g)
    seconds = time.perf_counter() - start
    moved = loader.moved_packs_total
    sample(B, after_pass=True)
    alive = [t.name for t in threading.enumerate() if t.name == EXCHANGE_THREAD]
    stats = loader.stats
    return {
        "rank": rank,
        "yielded": yielded,
        "pack_ids": seen[: min(yielded, len(seen))].tobytes(),
        "arrived": arrived,
        "moved": moved,
        "stats_entries": len(stats),
        "global_batches_counted": loader.global_batches,
        "samples": samples,
        "threads_before_pass": threads_before,
        "threads_range": py_range,
        "os_threads_range": os_range,
        "exchange_threads_alive": len(alive),
        "damaged": bad,
        "seconds": seconds,
        "rss_peak_mib": round(_proc_status()[2], 2),
        "exchange_ms_mean": float(np.mean([s["exchange_ms"] for s in stats])) if stats else 0.0,
        "exposed_exchange_ms_mean": (
            float(np.mean([s["exposed_exchange_ms"] for s in stats])) if stats else 0.0
        ),
        "checksum": checksum,
    }


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.exchange_timeout_s))
    return soak(rank, world, group, args)


# -- the parent -------------------------------------------------------------------------------


def run_soak(args: argparse.Namespace) -> dict[int, tuple[str, Any]]:
    """``{rank: ("ok", result) | ("error", message) | ("missing", exit code)}``."""
    env: dict[str, str] = {}
    if args.malloc_mmap_threshold is not None:  # read by glibc when a rank starts
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    return run_ranks(
        _rank_main,
        args.ranks,
        args,
        timeout=args.timeout_s,
        env=env,
        pg_timeout_s=max(args.exchange_timeout_s, 120.0),
        grace_s=args.exchange_timeout_s + GRACE_S,
        daemon=True,
    )


def _growth(samples: list[dict[str, Any]], warmup: int) -> float:
    base = next(s["rss_mib"] for s in samples if s["global_batch"] == warmup)
    return (samples[-1]["rss_mib"] - base) / base


def summarize(args: argparse.Namespace, res: dict[int, dict[str, Any]]) -> dict[str, Any]:
    B, M, W = args.global_batches, args.micro_steps, args.ranks
    per = [res[r] for r in range(W)]
    failures: list[str] = []
    for r in per:
        if r["yielded"] != B * M:
            failures.append(f"rank {r['rank']} yielded {r['yielded']} batches, not {B * M}")
        failures += r["damaged"]
    ids = np.sort(np.concatenate([np.frombuffer(r["pack_ids"], dtype=np.int64) for r in per]))
    if not np.array_equal(ids, np.arange(W * B * M)):
        dup = int(np.sum(ids[1:] == ids[:-1])) if len(ids) else 0
        failures.append(
            f"pack ids are not each seen once: {len(ids)} seen, {dup} duplicates,"
            f" {W * B * M} expected"
        )
    moved = per[0]["moved"]
    if any(r["moved"] != moved for r in per):
        failures.append(f"ranks disagree on moved packs: {[r['moved'] for r in per]}")
    arrived = sum(r["arrived"] for r in per)
    if arrived != moved:
        failures.append(f"{arrived} packs arrived from other ranks, plans moved {moved}")
    if moved == 0:
        failures.append("no pack moved: the soak exercised no exchange")
    growth = [_growth(r["samples"], args.warmup) for r in per]
    for r, g in zip(per, growth):
        if not g < args.max_rss_growth:
            failures.append(
                f"rank {r['rank']}: RSS grew {g:+.2%} after warm-up"
                f" (limit {args.max_rss_growth:.0%})"
            )
    constant = []
    for r in per:
        in_pass = [s for s in r["samples"] if s["global_batch"] >= args.warmup]
        in_pass = [s for s in in_pass if not s.get("after_pass")]
        py, ost = r["threads_range"], r["os_threads_range"]
        same = (
            len({s["threads"] for s in in_pass}) <= 1
            and len({s["os_threads"] for s in in_pass}) <= 1
            and py[0] >= py[1]  # equal, or (min > max) no global batch checked
            and ost[0] >= ost[1]
        )
        constant.append(same)
        if not same:
            failures.append(
                f"rank {r['rank']}: thread count changed after warm-up (Python {py[0]}..{py[1]},"
                f" OS {ost[0]}..{ost[1]})"
            )
    after = [r["samples"][-1]["threads"] for r in per]
    for r, n in zip(per, after):
        if r["exchange_threads_alive"]:
            failures.append(f"rank {r['rank']}: a {EXCHANGE_THREAD} thread is alive after the pass")
        if n != r["threads_before_pass"]:
            failures.append(
                f"rank {r['rank']}: {n} Python threads after the pass,"
                f" {r['threads_before_pass']} before"
            )
    return {
        "ranks": W,
        "global_batches": B,
        "micro_steps": M,
        "mode": args.mode,
        "warmup": args.warmup,
        "sample_every": args.sample_every,
        "seq_len": args.seq_len,
        "pixel_dim": args.pixel_dim,
        "seed": args.seed,
        "exchange_timeout_s": args.exchange_timeout_s,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "samples": [r["samples"] for r in per],
        "rss_growth_frac": [round(g, 6) for g in growth],
        "rss_peak_mib": [r["rss_peak_mib"] for r in per],
        "threads_constant": constant,
        "threads_after_pass": after,
        "threads_before_pass": [r["threads_before_pass"] for r in per],
        "moved_packs": moved,
        "moved_fraction": round(moved / (W * B * M), 6),
        "exchange_ms_mean": [round(r["exchange_ms_mean"], 4) for r in per],
        "exposed_exchange_ms_mean": [round(r["exposed_exchange_ms_mean"], 4) for r in per],
        "pass_seconds": [round(r["seconds"], 2) for r in per],
        "failures": failures,
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    results = run_soak(args)
    seconds = time.perf_counter() - start
    if seconds >= args.timeout_s:
        print(f"error: --timeout-s {args.timeout_s:g} passed", file=sys.stderr)
    versions = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    broken = {r: v for r, v in results.items() if v[0] != "ok"}
    if broken:
        failures = []
        for r, (status, detail) in sorted(broken.items()):
            if status == "missing":
                failures.append(f"rank {r} died or hung without reporting (exit code {detail})")
            else:
                failures.append(f"rank {r} failed: {detail}")
        for f in failures:
            print(f"error: {f}", file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    {
                        "ranks": args.ranks,
                        "global_batches": args.global_batches,
                        "micro_steps": args.micro_steps,
                        "mode": args.mode,
                        "missing_ranks": sorted(r for r, v in broken.items() if v[0] == "missing"),
                        "failed_ranks": sorted(r for r, v in broken.items() if v[0] == "error"),
                        "failures": failures,
                        "seconds": round(seconds, 2),
                        "ok": False,
                        **versions,
                    }
                )
            )
        return 1
    result = summarize(args, {r: v[1] for r, v in results.items()})
    result["seconds"] = round(seconds, 2)
    result["ok"] = not result["failures"]
    result.update(versions)

    print(
        f"soak: {args.ranks} ranks, {args.global_batches} global batches x {args.micro_steps}"
        f" micro-steps, mode={args.mode}, {result['moved_packs']} packs moved"
        f" ({result['moved_fraction']:.1%}), {seconds:.1f} s"
    )
    print("rank 0:")
    print(
        f"{'global batch':>12} {'RSS MiB':>9} {'vs warm-up':>10} {'threads':>7} {'OS':>4}"
        f" {'moved':>8} {'malloc used':>11} {'free':>7}"
    )
    base = next(s["rss_mib"] for s in result["samples"][0] if s["global_batch"] == args.warmup)
    for s in result["samples"][0]:
        label = f"{s['global_batch']}{' end' if s.get('after_pass') else ''}"
        rel = (s["rss_mib"] - base) / base
        print(
            f"{label:>12} {s['rss_mib']:>9.1f} {rel:>+10.2%} {s['threads']:>7}"
            f" {s['os_threads']:>4} {s['moved']:>8} {_mib(s['malloc_used_mib']):>11}"
            f" {_mib(s['malloc_free_mib']):>7}"
        )
    print(
        "rss_growth_frac "
        + " ".join(f"{g:+.3%}" for g in result["rss_growth_frac"])
        + f"; threads_constant {result['threads_constant']};"
        f" threads_after_pass {result['threads_after_pass']}"
    )
    for f in result["failures"]:
        print(f"error: {f}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
