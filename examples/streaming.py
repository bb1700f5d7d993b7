"""The streaming main job: the example VLM trained on 2 CPU ranks from a streamed dataset.

    python -m examples.streaming                      # both formats, 3,000 records
    python -m examples.streaming --formats hf --samples 1000

It writes a small synthetic VLM dataset (``lightning_vlmbalance/streams.py``: token ids and PNG-
encoded images) as Hugging Face parquet shards and as a LitData ``optimize()`` directory, then
for each format trains one epoch under ``strategy="vlmbalance"`` (overlapped pack exchange) with
the ``StragglerMonitor``, reading the records through ``PackedStreamLoader`` (2 workers per
rank: the records are measured from their PNG headers, packed in bounded windows, decoded only
when packed), saving a checkpoint mid-epoch. A second run resumes from that checkpoint; the job
checks that it trains exactly the packs the uninterrupted run trained after it. It prints, per
format, the packing efficiency, the padding packs, the share of time the ranks spent waiting,
steps/s, and one ``SUMMARY_JSON`` line. TensorBoard logs and checkpoints go under ``--root``.
Lightning's DDP launcher re-runs this module for rank 1; the runs follow each other in the same
processes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance import streams as stream_data

FORMATS = ("hf", "litdata")
_ROOT_ENV = "VLMBALANCE_STREAMING_ROOT"


class Record(L.Callback):
    """What every rank trained (per micro-batch: step, record keys, padding) and the run's
    time and tokens."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []
        self.tokens = 0
        self.real_packs = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()
        self.start_step = trainer.global_step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        meta = batch["meta"]
        self.seen.append([trainer.global_step, list(meta.get("keys", [])), bool(meta["padding"])])
        if not meta["padding"]:
            self.tokens += int(meta["total_tokens"])
            self.real_packs += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.start_step


def _gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Streams(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace, fmt: str, data: Path) -> None:
        super().__init__()
        self.args, self.fmt, self.data = args, fmt, data

    def train_dataloader(self) -> vb.PackedStreamLoader:
        trainer = self.trainer
        if self.fmt == "hf":
            paths = sorted(str(p) for p in (self.data / "pq").glob("*.parquet"))
            source = stream_data.hf_stream(paths, trainer.global_rank, trainer.world_size)
        else:
            source = stream_data.litdata_stream(str(self.data / "ld"))
        self.loader = stream_data.stream_loader(
            source,
            self.args.seq_len,
            buffer=self.args.buffer,
            trainer=trainer,
            num_workers=self.args.num_workers,
        )
        return self.loader


def fit(
    args: argparse.Namespace, fmt: str, data: Path, folder: Path, resume: str | None = None
) -> tuple[Record, vb.StragglerMonitor, Any]:
    L.seed_everything(args.seed, verbose=False)
    record = Record()
    monitor = vb.StragglerMonitor(log_every_n_steps=5)
    checkpoints = ModelCheckpoint(
        dirpath=folder / fmt / "ckpt",
        every_n_train_steps=args.checkpoint_at,
        save_top_k=-1,
        filename="{step}",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=vb.VLMBalanceStrategy(mode=args.mode),
        max_epochs=1,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(folder, name=fmt, version="resumed" if resume else "full"),
        log_every_n_steps=5,
        callbacks=[monitor, record, checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ToyVLM(max_positions=args.seq_len, vocab_size=64, patch_dim=8)
    streams = Streams(args, fmt, data)
    trainer.fit(model, datamodule=streams, ckpt_path=resume)
    return record, monitor, streams.loader


def run_format(args: argparse.Namespace, fmt: str, data: Path, folder: Path) -> dict[str, Any]:
    full, monitor, loader = fit(args, fmt, data, folder)
    ckpt = folder / fmt / "ckpt" / f"step={args.checkpoint_at}.ckpt"
    resumed, _, _ = fit(args, fmt, data, folder, resume=str(ckpt))
    trained_keys = [k for s in full.seen for k in s[1]]
    ranks_keys = _gather(trained_keys)
    tokens, real = sum(_gather(full.tokens)), sum(_gather(full.real_packs))
    padding = sum(_gather(loader.padding_packs))
    bad = sum(_gather(len(loader.bad_samples)))
    # the resumed run: exactly the uninterrupted run's micro-batches from the checkpoint on
    tail = full.seen[len(full.seen) - len(resumed.seen) :]
    same = all(_gather(bool(resumed.seen) and tail == resumed.seen))
    all_keys = [int(k) for keys in ranks_keys for k in keys]
    straggler = monitor.summary()
    return {
        "format": fmt,
        "optimizer_steps": full.steps,
        "seconds": round(full.seconds, 2),
        "steps_per_s": round(full.steps / full.seconds, 3),
        "tokens_per_s": round(tokens / full.seconds, 1),
        "packing_efficiency": round(tokens / (real * args.seq_len), 4),
        "packs": real,
        "padding_packs": padding,
        "bad_samples": bad,
        "waste_frac": round(straggler["waste_frac"], 4),
        "every_record_once": sorted(all_keys) == list(range(args.samples)),
        "resumed_at_step": args.checkpoint_at,
        "resume_reproduced": same,
        "resumed_micro_batches": len(resumed.seen),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--buffer", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--mode", default="overlap", choices=("off", "sync", "overlap"))
    p.add_argument("--checkpoint-at", type=int, default=10, help="the mid-epoch checkpoint")
    p.add_argument("--root", default="runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # rank 0 runs this before Lightning starts rank 1 (with this environment): one folder
    if _ROOT_ENV not in os.environ:
        base = Path(args.root) / "streaming"
        base.mkdir(parents=True, exist_ok=True)
        k = 0
        while (base / f"run_{k}").exists():
            k += 1
        (base / f"run_{k}").mkdir()
        os.environ[_ROOT_ENV] = str(base / f"run_{k}")
    folder = Path(os.environ[_ROOT_ENV])
    data = folder / "data"
    if not (data / "done").exists():  # rank 0, before rank 1 exists: the formats it trains
        records = stream_data.synthetic_records(args.samples, seed=args.seed)
        if "hf" in args.formats:
            stream_data.write_parquet(records, data / "pq", shards=8)
        if "litdata" in args.formats:
            stream_data.write_litdata(records, data / "ld")
        (data / "done").write_text("ok")
    runs = [run_format(args, fmt, data, folder) for fmt in args.formats]
    summary = {"samples": args.samples, "seq_len": args.seq_len, "runs": runs, "dir": str(folder)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        _print(summary)
    return summary


def _print(summary: dict[str, Any]) -> None:
    print()
    print("| format | steps | steps/s | tokens/s | packing | padding packs | waiting | resume |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in summary["runs"]:
        print(
            f"| {r['format']} | {r['optimizer_steps']} | {r['steps_per_s']:.2f} |"
            f" {r['tokens_per_s']:,.0f} | {r['packing_efficiency']:.2%} | {r['padding_packs']} |"
            f" {r['waste_frac']:.1%} |"
            f" {'same packs' if r['resume_reproduced'] else 'DIFFERENT'} |"
        )
    print("SUMMARY_JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
