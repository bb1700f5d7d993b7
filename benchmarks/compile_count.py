"""Graph breaks and compilations of the compiled example VLM over real packs (CPU).

    python benchmarks/compile_count.py --packs 100 --json

The packs are built as ``examples/train.py`` builds them (synthetic data, 512-token packs). The
model is compiled as a user would, ``torch.compile(model)`` (no ``fullgraph``, so that breaks are
counted instead of raised), with a counting backend that also runs backward (``aot_eager``), and
trained over the packs twice: plainly, and with
:func:`~lightning_vlmbalance.attention.mark_pack_dynamic` on each batch (what the example's
``on_after_batch_transfer`` does under a Trainer). Prints one JSON object last with ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from common import add_json_flag, print_json, stamp, timed
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.attention import mark_pack_dynamic
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


def packs(n: int, seed: int, seq_len: int = 512, patch_dim: int = 32) -> list[dict[str, Any]]:
    table = synthetic_length_table(
        4000, text_share=0.2, tile_tokens=16, max_text_tokens=seq_len // 2, seed=seed
    )
    dataset = SyntheticVLMDataset(table, vocab_size=256, patch_dim=patch_dim, seed=seed)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=seq_len, seed=seed)
    collate = vb.PackCollator(seq_len, image_feature_shape=(patch_dim,))
    return list(itertools.islice(vb.PackedDataLoader(dataset, sampler, collate), n))


def count(batches: list[dict[str, Any]], *, mark: bool, dim: int) -> dict[str, Any]:
    """Compilations and graph breaks of one compiled training pass over ``batches``."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = ToyVLM(max_positions=512, patch_dim=32, vocab_size=256, dim=dim, heads=4)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=backend)

    def train() -> None:
        for batch in batches:
            if mark:
                mark_pack_dynamic(batch)
            vb.packed_cross_entropy(compiled(batch), batch).loss.backward()

    _, seconds = timed(train)
    breaks = counters["graph_break"]
    return {
        "compilations": backend.frame_count,
        "graph_breaks": sum(breaks.values()),
        "break_reasons": sorted({reason.splitlines()[0] for reason in breaks}),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--packs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="data and packing seed")
    p.add_argument("--dim", type=int, default=64)
    add_json_flag(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    batches = packs(args.packs, args.seed)
    result = {
        "packs": len(batches),
        "seed": args.seed,
        "packs_with_images": sum(b["meta"]["images"] > 0 for b in batches),
        **stamp("torch"),
        "plain": count(batches, mark=False, dim=args.dim),
        "marked": count(batches, mark=True, dim=args.dim),
    }
    torch._dynamo.reset()
    if args.json:
        print_json(result)
    else:
        for mode in ("plain", "marked"):
            r = result[mode]
            print(
                f"{mode}: {r['compilations']} compilations, {r['graph_breaks']} graph breaks"
                f" over {result['packs']} packs ({r['seconds']} s)"
            )
    return result


if __name__ == "__main__":
    main()
