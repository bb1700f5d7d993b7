"""A streamed dataset balanced by the exchange path, against the map-style sampler's, in the
simulator; and how fast the streaming loader measures and packs records.

    python benchmarks/stream_balance.py --json [--seq-len 8192] [--dp 8 64] [--ga 4 8]

Balance: the shared mixes (as ``stream_packing.py`` reads them, ``--text-share`` text) priced
by the default :class:`~lightning_vlmbalance.CostModel`, global batches replayed as the loaders
deal them: the map-style ``PackingSampler`` (one global plan, window 4,096) and a stream (each
rank packs its own shard of the shuffled mix with ``pack_stream``, ``--buffers``), each with
the packs where they fall (``off``) and rebalanced by the planner (``overlap``). The goal: the
stream's ``overlap`` waste within 1.5x of the map-style one's. ``stream_tail_frac``: padding
packs' share of the epoch's packs (ranks whose streams end first pad until the last one ends).

Speed: ``PackedStreamLoader``'s per-worker work before decoding, one process: each record's
lengths (``lightning_vlmbalance.streams.record_tokens``: PNG headers read, no pixel decoded; and a
precomputed column) and the windowed packing; records per second, median of ``--repeat``.
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
from stream_packing import tables

from lightning_vlmbalance import streams as stream_data
from lightning_vlmbalance.packing.stream import pack_stream_windows
from lightning_vlmbalance.sim.simulate import simulate


def balance(args: argparse.Namespace) -> list[dict]:
    table, _, source = tables(args)
    rows = []
    for buffer in [None, *args.buffers]:
        result = simulate(
            table,
            seq_len=args.seq_len,
            dp=args.dp,
            ga=args.ga,
            modes=("off", "overlap"),
            batches=args.batches,
            seed=args.seed,
            replay=True,
            stream_buffer=buffer,
        )
        for r in result:
            rows.append(
                {
                    "packer": "map" if buffer is None else f"stream{buffer}",
                    "strategy": r["mode"],
                    "dp": r["dp"],
                    "ga": r["ga"],
                    "waste_frac": round(r["waste_frac"], 4),
                    "packing_efficiency": round(r["packing_efficiency"], 4),
                    "stream_tail_frac": round(r.get("stream_tail_frac", 0.0), 4),
                    "data": source,
                }
            )
    maps = {
        (r["strategy"], r["dp"], r["ga"]): r["waste_frac"] for r in rows if r["packer"] == "map"
    }
    for r in rows:
        base = maps[(r["strategy"], r["dp"], r["ga"])]
        r["waste_vs_map"] = round(r["waste_frac"] / base, 3) if base > 0 else None
    return rows


def speed(args: argparse.Namespace) -> dict:
    records = stream_data.synthetic_records(args.records, seed=args.seed)
    column = [stream_data.record_tokens(r)[0] for r in records]

    def run(lengths) -> float:
        start = time.perf_counter()
        packs = 0
        for _, window in pack_stream_windows(map(lengths, range(len(records))), 256, buffer=4096):
            packs += len(window)
        return len(records) / (time.perf_counter() - start)

    def headers(i: int) -> int:
        return stream_data.record_tokens(records[i])[0]

    def precomputed(i: int) -> int:
        return column[i]

    out = {}
    for name, fn in (("png_headers", headers), ("precomputed", precomputed)):
        rates = [run(fn) for _ in range(args.repeat)]
        out[f"{name}_records_per_s"] = round(float(np.median(rates)))
    out["records"] = len(records)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--text-share", type=float, default=0.2)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64])
    p.add_argument("--ga", type=int, nargs="+", default=[4, 8])
    p.add_argument("--buffers", type=int, nargs="+", default=[4096, 1024])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--records", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    add_json_flag(p)
    args = p.parse_args()
    rows = balance(args)
    result = {**stamp(), "balance": rows, "speed": speed(args)}
    if args.json:
        print_json(result)
        return
    for r in rows:
        print(
            f"{r['packer']:>10} {r['strategy']:>8} dp={r['dp']:<3} ga={r['ga']}"
            f" waste={r['waste_frac']:.3f} x{r['waste_vs_map']} eff={r['packing_efficiency']:.4f}"
            f" tail={r['stream_tail_frac']:.2f}"
        )
    print(result["speed"])


if __name__ == "__main__":
    main()
