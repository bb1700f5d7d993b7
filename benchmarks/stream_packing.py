"""Packing a stream with a bounded buffer, against the map-style sampler, on the shared mixes.

    python benchmarks/stream_packing.py --json [--seq-len 8192] [--text-share 0.2]

The shared mixes (the four omnibal sets and the text set of ``shared/data``; without them a
synthetic table of their shape) resampled to ``--text-share`` text samples. The map-style
sampler (``PackingSampler``, window 4,096, its own shuffle) is the reference. The stream is
packed by :func:`~lightning_vlmbalance.packing.stream.pack_stream` at each ``--buffers`` size,
in two orders: ``shuffled`` (a source that shuffles, as a streaming loader's shard and buffer
shuffle does) and ``file`` (the files one after the other, every image set before the text:
the worst order a source can give). Speed: lengths from per-sample records (text and image
tokens: the cheap function a streaming loader calls on each decoded sample's metadata) and
packing, one process (one worker), decoding excluded; median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_json_flag, print_json, stamp
from packing import DEFAULT_FILES, SHARED_DATA

import lightning_vlmbalance as vb
from lightning_vlmbalance.packing.binpack import packing_efficiency
from lightning_vlmbalance.packing.stream import pack_stream
from lightning_vlmbalance.synthetic import (
    LengthTable,
    read_length_csv,
    resample_text_share,
    synthetic_length_table,
)


def tables(args: argparse.Namespace) -> tuple[LengthTable, LengthTable, str]:
    """The mix in file order and resampled-and-shuffled, and where it came from."""
    files = [SHARED_DATA / f for f in DEFAULT_FILES]
    if all(f.is_file() for f in files):
        in_files = read_length_csv(*files)
        source = ", ".join(f.name for f in files)
    else:
        in_files = synthetic_length_table(70_000, text_share=args.text_share, seed=args.seed)
        source = "synthetic"
    shuffled = resample_text_share(in_files, args.text_share, args.seed)
    # the file order keeps the resampled rows but puts every image row before the text rows
    text = shuffled.image_tokens == 0
    order = np.concatenate([np.flatnonzero(~text), np.flatnonzero(text)])
    file_order = LengthTable(
        total_tokens=shuffled.total_tokens[order],
        image_tokens=shuffled.image_tokens[order],
        images=shuffled.images[order],
    )
    return shuffled, file_order, source


def stream_efficiency(lengths: np.ndarray, seq_len: int, buffer: int) -> tuple[float, int]:
    packs = list(pack_stream(iter(lengths.tolist()), seq_len, buffer=buffer))
    tokens = np.array([int(lengths[p].sum()) for p in packs])
    return packing_efficiency(tokens, seq_len), len(packs)


def run(args: argparse.Namespace) -> dict:
    shuffled, file_order, source = tables(args)
    keep = shuffled.total_tokens <= args.seq_len
    lengths = shuffled.total_tokens[keep]
    file_lengths = file_order.total_tokens[file_order.total_tokens <= args.seq_len]
    sampler = vb.PackingSampler(
        lengths, shuffled.image_tokens[keep], seq_len=args.seq_len, num_replicas=1, rank=0
    )
    map_style = sampler.plan().efficiency
    curve = []
    for buffer in args.buffers:
        eff, packs = stream_efficiency(lengths, args.seq_len, buffer)
        file_eff, _ = stream_efficiency(file_lengths, args.seq_len, buffer)
        curve.append(
            {
                "buffer": buffer,
                "shuffled": round(eff, 5),
                "vs_map_style_pp": round(100 * (eff - map_style), 3),
                "file_order": round(file_eff, 5),
                "packs": packs,
            }
        )
    # lengths from per-sample records, then packing: what a streaming loader does per sample
    records = [
        {"text_tokens": int(t - i), "image_tokens": int(i)}
        for t, i in zip(lengths.tolist(), shuffled.image_tokens[keep].tolist())
    ]

    def length_of(sample: dict) -> int:
        return sample["text_tokens"] + sample["image_tokens"]

    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        n = sum(len(p) for p in pack_stream(map(length_of, records), args.seq_len, buffer=4096))
        times.append(time.perf_counter() - start)
    assert n == len(records)
    seconds = float(np.median(times))
    return {
        **stamp("numpy"),
        "benchmark": "stream_packing",
        "source": source,
        "samples": len(lengths),
        "skipped_overlong": int((~keep).sum()),
        "seq_len": args.seq_len,
        "text_share": args.text_share,
        "map_style_efficiency": round(map_style, 5),
        "curve": curve,
        "samples_per_s_per_worker": round(len(records) / seconds, 1),
        "pack_seconds": round(seconds, 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_json_flag(p)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--text-share", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--buffers", type=lambda s: [int(x) for x in s.split(",")],
        default=[128, 256, 512, 1024, 2048, 4096, 8192],
    )  # fmt: skip
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print_json(out)
        return
    print(f"{out['source']}: {out['samples']} samples, map-style {out['map_style_efficiency']:.4f}")
    print("| buffer | shuffled stream | vs map-style (pp) | file order | packs |")
    print("|---:|---:|---:|---:|---:|")
    for r in out["curve"]:
        print(
            f"| {r['buffer']} | {r['shuffled']:.4f} | {r['vs_map_style_pp']:+.3f} |"
            f" {r['file_order']:.4f} | {r['packs']} |"
        )
    print(f"lengths + packing: {out['samples_per_s_per_worker']:,.0f} samples/s per worker")


if __name__ == "__main__":
    main()
