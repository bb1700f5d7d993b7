"""A Lightning Fabric loop on 2 CPU ranks (``fabric.launch()`` re-runs this module for rank 1):
the example VLM on packed batches of the package's loader, timed by ``FabricStragglerMonitor``;
``--slow-rank R --sleep-ms S`` makes rank R's forward S ms slower. Writes ``result.json`` (rank 0)
and the TensorBoard logs under ``--out``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import TensorBoardLogger

import lightning_vlmbalance as vb
from examples.vlm import SMALL_VLM, ToyVLM
from lightning_vlmbalance.fabric import FabricStragglerMonitor
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table

SEQ_LEN = 128


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--balance", action="store_true", help="balance at the source")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    fabric = L.Fabric(
        accelerator="cpu", devices=2, strategy="ddp", loggers=TensorBoardLogger(out, name="fabric")
    )
    fabric.launch()
    fabric.seed_everything(0)
    table = synthetic_length_table(160, tile_tokens=8, max_text_tokens=64, seed=5)
    dataset = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
    sampler = vb.PackingSampler(
        table.total_tokens,
        table.image_tokens,
        seq_len=SEQ_LEN,
        num_replicas=fabric.world_size,
        rank=fabric.global_rank,
        balance=True if args.balance else None,
    )
    # two packs per rank per optimizer step: the loader weighs each step over both ranks
    loader = vb.PackedDataLoader(
        dataset, sampler, vb.PackCollator(SEQ_LEN, image_feature_shape=(8,)), micro_steps=2
    )
    model = ToyVLM(**SMALL_VLM)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    monitor = FabricStragglerMonitor(
        fabric, log_every_n_steps=args.every, jsonl_dir=out / "straggler"
    )
    monitor.watch(model)
    seen, step, weights = [], 0, []
    for i, batch in enumerate(loader):
        seen += batch["meta"]["sample_ids"]
        last = i % 2 == 1
        with fabric.no_backward_sync(model, enabled=not last):
            with monitor.phase("llm_fwd"):
                if fabric.global_rank == args.slow_rank:
                    time.sleep(args.sleep_ms / 1000)
                loss = vb.packed_cross_entropy(model(batch), batch).loss
            monitor.backward(loss / 2)  # divided by the micro-steps, as Lightning's loop does
        # the step's weights times its loss tokens, over both ranks: R x A (the loss contract,
        # docs/loss.md: divided by A here and averaged over R by DDP, the token mean)
        weights.append(float(batch["loss_weight"]) * int(batch["loss_tokens"]))
        if not last:
            monitor.end_micro(batch)
            continue
        step += 1
        with monitor.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        monitor.end_step(step, batch=batch)
    share = torch.tensor([sum(weights[k : k + 2]) for k in range(0, len(weights), 2)])
    share = fabric.all_reduce(share, reduce_op="sum")
    summary = monitor.close()
    everyone = [None] * fabric.world_size
    torch.distributed.all_gather_object(everyone, seen)
    if fabric.global_rank == 0:
        result = {
            "steps": step,
            "summary": summary,
            "seen": everyone,
            "step_share": share.tolist(),
            "formed": sampler.plan().balanced_batches,
        }
        (out / "result.json").write_text(json.dumps(result))
    fabric.barrier()


if __name__ == "__main__":
    main()
