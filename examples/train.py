"""The main job: a real multi-process training of the example VLM on the CPU.

    python -m examples.train                      # 2 processes (gloo), strategy "vlmbalance"
    python -m examples.train --balance-mode off   # same run, packs not moved (same math)
    python -m examples.train --strategy ddp       # plain DDP
    python -m examples.train --data a.csv --length-scale 0.0625 --seq-len 512

Lightning's DDP launcher re-runs this module for the other ranks. Logs go to TensorBoard under
``--root`` (default ``runs/``); the summary at the end says where.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM


class VLMDataModule(L.LightningDataModule):
    """Synthetic (or CSV-shaped) multimodal data, packed by ``PackingSampler``."""

    def __init__(
        self,
        table: vb.LengthTable,
        *,
        seq_len: int,
        patch_dim: int,
        vocab_size: int,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.table, self.seq_len, self.seed, self.num_workers = table, seq_len, seed, num_workers
        self.dataset = vb.SyntheticVLMDataset(
            table, vocab_size=vocab_size, patch_dim=patch_dim, seed=seed
        )
        self.patch_dim = patch_dim
        self.loader: vb.PackedDataLoader | None = None

    def train_dataloader(self) -> vb.PackedDataLoader:
        # rank and world size come from the process group Lightning has initialised
        sampler = vb.PackingSampler(
            self.table.total_tokens, self.table.image_tokens, seq_len=self.seq_len, seed=self.seed
        )
        collate = vb.PackCollator(self.seq_len, image_feature_shape=(self.patch_dim,))
        self.loader = vb.PackedDataLoader(
            self.dataset,
            sampler,
            collate,
            trainer=self.trainer,  # loss weights per optimizer step (strategy "ddp" needs it)
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        return self.loader


class RunSummary(L.Callback):
    """Times the fit and counts the tokens every rank computed (known from the shared plan)."""

    def __init__(self, monitor: vb.StragglerMonitor | None = None) -> None:
        self.monitor = monitor
        self.start = 0.0
        self.summary: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()
        self.start_step = trainer.global_step
        self.tokens = 0

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.datamodule.loader
        plan = loader.sampler.plan()
        # tokens of the packs every rank trained on in this run (padding packs hold none)
        self.tokens += sum(
            int(plan.pack_tokens[[i for i in ids[loader.start : loader.consumed] if i >= 0]].sum())
            for ids in plan.rank_pack_ids
        )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plan = trainer.datamodule.loader.sampler.plan()
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(
                {"packing/efficiency": plan.efficiency}, step=trainer.global_step
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self.start
        plan = trainer.datamodule.loader.sampler.plan()
        steps = trainer.global_step - self.start_step
        self.summary = {
            "ranks": trainer.world_size,
            "optimizer_steps": steps,
            "seconds": round(elapsed, 2),
            "steps_per_s": round(steps / elapsed, 3),
            "tokens_per_s": round(self.tokens / elapsed, 1),
            "packing_efficiency": round(plan.efficiency, 4),
            "packs_per_rank": plan.packs_per_rank,
            "padding_packs": plan.padding_packs,
            "final_loss": round(float(trainer.callback_metrics.get("train/loss", float("nan"))), 4),
            "log_dir": trainer.logger.log_dir if trainer.logger else None,
        }
        loader = getattr(trainer.strategy, "rebalancing_loader", None)
        if loader is not None and loader.stats:
            stats = loader.stats
            self.summary["balance_mode"] = loader.mode
            self.summary["moved_packs"] = loader.moved_packs_total
            planned = [b for b in stats if "planned_waste_frac" in b]
            if planned:  # the planner's prediction, with the cost model in use
                self.summary["planned_waste_before"] = round(
                    float(np.mean([b["baseline_waste_frac"] for b in planned])), 4
                )
                self.summary["planned_waste_after"] = round(
                    float(np.mean([b["planned_waste_frac"] for b in planned])), 4
                )
            self.summary["exposed_exchange_ms"] = round(
                float(np.median([b["exposed_exchange_ms"] for b in stats])), 2
            )
        if self.monitor is not None:  # complete on rank 0 after the monitor's last gather
            straggler = self.monitor.summary()
            self.summary["slowest_rank"] = straggler["slowest_rank"]
            self.summary["waste_frac"] = round(straggler["waste_frac"], 4)
        self._print()

    @rank_zero_only
    def _print(self) -> None:
        s = self.summary
        lines = [
            f"\nSummary: {s['ranks']} ranks, {s['optimizer_steps']} optimizer steps in"
            f" {s['seconds']} s = {s['steps_per_s']} steps/s, {s['tokens_per_s']} tokens/s (all"
            f" ranks), packing efficiency {s['packing_efficiency']:.2%}, final loss"
            f" {s['final_loss']}."
        ]
        if "waste_frac" in s:
            lines.append(
                f"Stragglers: slowest rank {s['slowest_rank']}; {s['waste_frac']:.1%} of rank-time"
                " was spent waiting at synchronisation points."
            )
        if "planned_waste_after" in s:
            lines.append(
                f"Rebalancing ({s['balance_mode']}): {s['moved_packs']} packs moved; planned"
                f" waste per global batch {s['planned_waste_before']:.1%} ->"
                f" {s['planned_waste_after']:.1%} (default cost model); median wait for a"
                f" rebalanced global batch {s['exposed_exchange_ms']} ms."
            )
        elif "balance_mode" in s:
            lines.append(f"Rebalancing ({s['balance_mode']}): no packs moved.")
        lines.append(f"TensorBoard logs: {s['log_dir']}  (tensorboard --logdir {s['log_dir']})")
        print("\n".join(lines))
        print("SUMMARY_JSON " + json.dumps(s))


def build_table(args: argparse.Namespace) -> vb.LengthTable:
    if not args.data:
        return vb.synthetic_length_table(
            args.num_samples,
            text_share=args.text_share,
            tile_tokens=args.tile_tokens,
            max_text_tokens=args.seq_len // 2,
            seed=args.seed,
        )
    table = vb.read_length_csv(*args.data)
    scale = args.length_scale
    image = np.ceil(table.image_tokens * scale).astype(np.int64)
    text = np.maximum(np.ceil((table.total_tokens - table.image_tokens) * scale), 1).astype(
        np.int64
    )
    n = min(args.num_samples, len(table))
    pick = np.random.default_rng(args.seed).permutation(len(table))[:n]
    return vb.LengthTable(
        total_tokens=(image + text)[pick], image_tokens=image[pick], images=table.images[pick]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-samples", type=int, default=4000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--text-share", type=float, default=0.2)
    p.add_argument(
        "--tile-tokens", type=int, default=16, help="image tokens per tile (synthetic data)"
    )
    p.add_argument(
        "--data", action="append", help="length CSV(s) in the shared format (repeatable)"
    )
    p.add_argument("--length-scale", type=float, default=1.0, help="scale CSV lengths (e.g. 1/16)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--moe-experts", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs")
    p.add_argument(
        "--strategy", default="vlmbalance", choices=("vlmbalance", "ddp"), help="with --devices > 1"
    )
    p.add_argument("--balance-mode", default="overlap", choices=("overlap", "sync", "off"))
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # one core per rank: two ranks must not fight over two cores
    L.seed_everything(args.seed, verbose=False)
    table = build_table(args)
    data = VLMDataModule(
        table,
        seq_len=args.seq_len,
        patch_dim=32,
        vocab_size=256,
        seed=args.seed,
        num_workers=args.num_workers,
    )
    model = ToyVLM(
        max_positions=args.seq_len, moe_experts=args.moe_experts, patch_dim=32, vocab_size=256
    )
    monitor = vb.StragglerMonitor(log_every_n_steps=10)
    summary = RunSummary(monitor)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=(
            vb.VLMBalanceStrategy(mode=args.balance_mode)
            if args.strategy == "vlmbalance" and args.devices > 1
            else "ddp"
            if args.devices > 1
            else "auto"
        ),
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(Path(args.root), name="vlm"),
        log_every_n_steps=5,
        callbacks=[monitor, summary],
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    return summary.summary


if __name__ == "__main__":
    main()
