"""A 2-process CPU Lightning fit that records which pack every rank trained on, for the tests.

    python -m tests.packing.lightning_job --out DIR [--resume CKPT] [--checkpoint-every N]

Each rank writes ``DIR/rank{r}.json``: the ``(epoch, pack_id, sample_ids)`` of every micro-batch
passed to ``training_step``, in order. Several fits in one launch: argument lists separated by
``--then``, one after the other in the same processes. Run as a subprocess: Lightning's DDP
launcher re-executes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_vlmbalance as vb
from examples.vlm import SMALL_VLM, ToyVLM
from lightning_vlmbalance.synthetic import LengthTable, SyntheticVLMDataset, synthetic_length_table
from tests.launch import fit_arg_lists

__all__ = ["SMALL_VLM", "Data", "RecordingVLM", "step_checkpoints"]


def step_checkpoints(out: str, every: int, filename: str = "{epoch}-{step}") -> ModelCheckpoint:
    """A checkpoint every ``every`` optimizer steps in ``out/ckpt``, every one kept."""
    return ModelCheckpoint(
        dirpath=Path(out) / "ckpt", every_n_train_steps=every, save_top_k=-1, filename=filename
    )


class RecordingVLM(ToyVLM):
    def __init__(self, out: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        meta = batch["meta"]
        self.seen.append((self.current_epoch, meta["pack_id"], meta["sample_ids"]))
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        path = Path(self.out) / f"rank{self.global_rank}.json"
        path.write_text(json.dumps({"seen": self.seen, "world_size": self.trainer.world_size}))


class Data(L.LightningDataModule):
    def __init__(self, table: LengthTable, seq_len: int, num_workers: int) -> None:
        super().__init__()
        self.table, self.seq_len, self.num_workers = table, seq_len, num_workers

    def train_dataloader(self) -> vb.PackedDataLoader:
        ds = SyntheticVLMDataset(self.table, vocab_size=64, patch_dim=8)
        sampler = vb.PackingSampler(
            self.table.total_tokens,
            self.table.image_tokens,
            seq_len=self.seq_len,
            seed=3,
            window=64,
        )
        return vb.PackedDataLoader(
            ds,
            sampler,
            vb.PackCollator(self.seq_len, image_feature_shape=(8,)),
            trainer=self.trainer,  # weighs each optimizer step's loss (any strategy)
            num_workers=self.num_workers,
        )


def main() -> None:
    """One fit, or several one after the other in the same processes: argument lists separated
    by ``--then`` (Lightning starts the ranks for the first fit; the later Trainers find them)."""
    parsed = [_parser().parse_args(f) for f in fit_arg_lists(sys.argv[1:])]
    torch.set_num_threads(1)
    for args in parsed:
        _fit(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--resume")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--epoch-checkpoint", action="store_true", help="also save at epoch ends")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--text-only-second-half", action="store_true")
    return p


def _fit(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    seq_len = 128
    table = synthetic_length_table(
        args.samples, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1
    )
    if args.text_only_second_half:  # rank 1's shard has no image at all
        half = args.samples // 2
        image = table.image_tokens.copy()
        total = table.total_tokens - np.where(np.arange(args.samples) >= half, image, 0)
        image[half:] = 0
        images = np.where(image > 0, table.images, 0)
        table = LengthTable(total_tokens=total, image_tokens=image, images=images)
    callbacks = []
    if args.checkpoint_every:
        callbacks.append(step_checkpoints(args.out, args.checkpoint_every))
    if args.epoch_checkpoint:  # Lightning's default: save when a training epoch ends
        callbacks.append(
            ModelCheckpoint(dirpath=Path(args.out) / "ckpt", save_top_k=-1, filename="end-{epoch}")
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = RecordingVLM(args.out, **SMALL_VLM, max_positions=seq_len)
    trainer.fit(model, datamodule=Data(table, seq_len, args.num_workers), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
