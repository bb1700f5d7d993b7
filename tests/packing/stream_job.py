"""A 2-process CPU Lightning fit from a streamed source, recording what every rank trained.

    python -m tests.packing.stream_job --data DIR --out DIR --format {generic,hf,litdata}
        [--strategy vlmbalance|ddp] [--mode overlap] [--encoder] [--num-workers 2]
        [--max-steps N] [--checkpoint-every N] [--resume CKPT] [--shares 0.7 0.3]

The data (``lightning_vlmbalance/streams.py`` records) is written to ``--data`` by the first process
that finds it missing (rank 0 runs ``main`` before Lightning starts rank 1). Each rank writes
``OUT/rank{r}.json``: per micro-batch ``[epoch, global_step, keys, padding, loss_weight]``, and
the loader's report (padding packs, bad samples). Several fits per launch: ``--then``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_vlmbalance as vb
from examples.vlm import SMALL_VLM, ToyVLM
from lightning_vlmbalance import streams as stream_data
from tests.launch import fit_arg_lists
from tests.packing.lightning_job import step_checkpoints

SEQ_LEN = 256
SAMPLES = 360


class StreamRecordingVLM(ToyVLM):
    def __init__(self, out: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.seen: list[list[Any]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        meta = batch["meta"]
        self.seen.append(
            [
                self.current_epoch,
                self.trainer.global_step,
                list(meta.get("keys", [])),
                bool(meta["padding"]),
                float(batch["loss_weight"]),
            ]
        )
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        loader = self.trainer.fit_loop._combined_loader.flattened[0]
        inner = getattr(loader, "loader", loader)
        report = {
            "padding_packs": inner.padding_packs,
            "bad_samples": inner.bad_samples,
            "left_over": inner.left_over,
            "lent_packs": inner.lent_packs,
        }
        path = Path(self.out) / f"rank{self.global_rank}.json"
        path.write_text(json.dumps({"seen": self.seen, "report": report}))


class StreamData(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def train_dataloader(self) -> vb.PackedStreamLoader:
        args, trainer = self.args, self.trainer
        rank, world = trainer.global_rank, trainer.world_size
        data = Path(args.data)
        if args.format == "hf":
            source = stream_data.hf_stream(sorted(map(str, data.glob("pq/*.parquet"))), rank, world)
        elif args.format == "litdata":
            source = stream_data.litdata_stream(str(data / "ld"))
        else:
            records = stream_data.synthetic_records(SAMPLES, seed=1)
            source = stream_data.ShardedRecords(records, rank, world, shares=args.shares)
        return stream_data.stream_loader(
            source,
            SEQ_LEN,
            buffer=args.buffer,
            trainer=trainer,
            num_workers=args.num_workers,
            timeout_s=60,  # a failing peer fails the test within a minute
        )


def write_data(data: Path) -> None:
    """The records as 8 parquet shards and a LitData directory, once."""
    done = data / "done"
    if done.exists():
        return
    records = stream_data.synthetic_records(SAMPLES, seed=1)
    stream_data.write_parquet(records, data / "pq", shards=8)
    stream_data.write_litdata(records, data / "ld")
    done.write_text("ok")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="generic", choices=("generic", "hf", "litdata"))
    p.add_argument("--strategy", default="vlmbalance")
    p.add_argument("--mode", default="overlap")
    p.add_argument("--encoder", action="store_true")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--buffer", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--shares", type=float, nargs="+", default=None)
    return p


def _fit(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    callbacks = []
    if args.checkpoint_every:
        callbacks.append(step_checkpoints(args.out, args.checkpoint_every, filename="{step}"))
    if args.strategy == "vlmbalance":
        strategy: Any = vb.VLMBalanceStrategy(mode=args.mode, encoder=args.encoder)
    elif args.strategy == "fsdp_vlmbalance":
        strategy = vb.FSDPVLMBalanceStrategy(mode=args.mode, encoder=args.encoder)
    else:
        strategy = args.strategy
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = StreamRecordingVLM(args.out, **SMALL_VLM, max_positions=SEQ_LEN)
    trainer.fit(model, datamodule=StreamData(args), ckpt_path=args.resume)


def main() -> None:
    parsed = [_parser().parse_args(f) for f in fit_arg_lists(sys.argv[1:])]
    torch.set_num_threads(1)
    for args in parsed:
        if args.format != "generic":
            write_data(Path(args.data))
        _fit(args)


if __name__ == "__main__":
    main()
