"""CPU Lightning fits of the example VLM, 2 or 4 ranks, recording every micro-batch each rank
trained: the job of ``tests/packing/test_resume_matrix.py`` (resume from any position, any
loader, any strategy).

    python -m tests.packing.resume_job --data DIR --out DIR
        [--loader {mapstyle,generic,hf,hf_shuffled,litdata}]
        [--strategy {ddp,vlmbalance,fsdp_vlmbalance}] [--mode {off,sync,overlap}] [--encoder]
        [--devices 2] [--shares 0.7 0.3] [--buffer 16] [--num-workers 2] [--accumulate 2]
        [--epochs 1] [--checkpoint-every N] [--val-every N] [--fail-at-step K] [--resume CKPT]

The records are ``lightning_vlmbalance/streams.py``'s (``SAMPLES`` of them, record ``uid`` = index),
written once to ``--data`` as 8 parquet shards and a LitData directory (under a file lock: jobs
running side by side may share ``--data``). Loaders:

==============  ===============================================================================
``mapstyle``    ``vb.PackedDataLoader`` over the decoded records (a map-style dataset and its
                length table from the PNG headers), ``vb.PackingSampler(window=--buffer)``
``generic``     ``stream_data.ShardedRecords`` (``--shares``: uneven shards, one per rank)
``hf``          ``stream_data.hf_stream``: Hugging Face parquet in streaming mode, split by node
``hf_shuffled`` the same stream ``.shuffle(seed=, buffer_size=)`` before ``split_dataset_by_node``,
                as users write it (the shuffle is seeded: every rank and every run alike)
``litdata``     ``stream_data.litdata_stream``: a LitData ``StreamingDataset``
==============  ===============================================================================

The streamed ones are ``stream_data.stream_loader`` (``vb.PackedStreamLoader``) with ``buffer``
records per packing window. The rebalancing strategies plan with a fixed cost model (no online
calibration: where a pack trains depends on the data alone, so two runs can be compared rank by
rank).

Checkpoints, all in ``OUT/ckpt``: ``step=N.ckpt`` every ``--checkpoint-every`` optimizer steps
(every one kept); ``val-step=N.ckpt`` at the end of every mid-epoch validation (a validation every
``--val-every`` micro-batches: ``val_check_interval``, 2 batches of a tiny map-style loader); and
``on_exception.ckpt`` (``OnExceptionCheckpoint``) when the fit fails. ``--fail-at-step K`` raises
a ``RuntimeError`` in ``training_step`` on every rank at the first micro-batch of optimizer step
``K`` (before it is recorded); the job catches it and goes on.

Each rank writes ``OUT/rank{r}.json`` when the fit ends, normally or by an exception: ``seen``,
per micro-batch ``[epoch, global_step, keys, padding, loss_weight, loss_tokens]`` (``keys``: the
``uid`` of every record in the pack, ``global_step``: the optimizer steps done before it),
``error`` (``None``, or the exception's repr), ``world_size`` and the streamed loader's
``report`` (padding and lent packs). An exception other than the injected one is raised again
after the file is written (the job fails). Several fits per launch, one after the other in the
same processes: argument lists separated by ``--then``.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import Dataset

import lightning_vlmbalance as vb
from examples.vlm import SMALL_VLM, ToyVLM
from lightning_vlmbalance import streams as stream_data
from tests.launch import fit_arg_lists
from tests.packing.lightning_job import step_checkpoints

SEQ_LEN = 256
SAMPLES = 360
RECORD_SEED = 1
LITDATA_CHUNK = "8KB"
SHUFFLE_SEED = 5  # hf_shuffled: the seed of Hugging Face's shuffle
SHUFFLE_BUFFER = 32  # hf_shuffled: its buffer (records, per DataLoader worker)
PATCH_FEATURES = stream_data.PATCH[0] * stream_data.PATCH[1]
LOADERS = ("mapstyle", "generic", "hf", "hf_shuffled", "litdata")
STRATEGIES = ("ddp", "vlmbalance", "fsdp_vlmbalance")
INJECTED = "resume_job: injected failure at optimizer step"


class InjectedFailureError(RuntimeError):
    """The ``--fail-at-step`` error (a ``RuntimeError``), told apart from real ones."""


class RecordingVLM(ToyVLM):
    def __init__(self, out: str, fail_at_step: int | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.fail_at_step = fail_at_step
        self.seen: list[list[Any]] = []
        self.written = False

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if self.fail_at_step is not None and step == self.fail_at_step:
            raise InjectedFailureError(f"{INJECTED} {step} (rank {self.global_rank})")
        meta = batch["meta"]
        keys = meta["keys"] if "keys" in meta else meta["sample_ids"]  # streamed / map-style
        self.seen.append(
            [
                self.current_epoch,
                step,
                [int(k) for k in keys],
                bool(meta["padding"]),
                float(batch["loss_weight"]),
                int(batch["loss_tokens"]),
            ]
        )
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self(batch)  # a forward only: validation is here for where it checkpoints

    def on_train_end(self) -> None:
        write_record(self, self.trainer, None)


def _report(trainer: L.Trainer) -> dict[str, Any] | None:
    """The streamed training loader's counters (``None`` for the map-style loader)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    if combined is None:
        return None
    loader = combined.flattened[0]
    inner = getattr(loader, "loader", loader)  # under the rebalancing strategies: wrapped
    if not isinstance(inner, vb.PackedStreamLoader):
        return None
    return {
        "padding_packs": inner.padding_packs,
        "left_over": inner.left_over,
        "lent_packs": inner.lent_packs,
        "bad_samples": len(inner.bad_samples),
    }


def _safe_report(trainer: L.Trainer) -> Any:
    try:
        return _report(trainer)
    except Exception as error:  # the record is written whatever state a failed fit left
        return {"unavailable": repr(error)}


def write_record(model: RecordingVLM, trainer: L.Trainer, error: BaseException | None) -> None:
    if model.written and error is None:
        return
    model.written = True
    path = Path(model.out) / f"rank{trainer.global_rank}.json"
    path.write_text(
        json.dumps(
            {
                "seen": model.seen,
                "error": None if error is None else repr(error),
                "world_size": trainer.world_size,
                "report": _safe_report(trainer),
            }
        )
    )


class RecordDataset(Dataset):
    """The records as a map-style dataset of decoded samples."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return stream_data.decode_record(self.records[index])


def packed_map_loader(
    records: list[dict[str, Any]], *, window: int, seed: int, **options: Any
) -> vb.PackedDataLoader:
    """A ``PackedDataLoader`` over ``records`` with its length table from the PNG headers."""
    lengths = [stream_data.record_tokens(r) for r in records]
    sampler = vb.PackingSampler(
        [total for total, _ in lengths],
        [image for _, image in lengths],
        images=[len(r["image_ends"]) for r in records],
        seq_len=SEQ_LEN,
        seed=seed,
        window=window,
    )
    collate = vb.PackCollator(SEQ_LEN, image_feature_shape=(PATCH_FEATURES,))
    return vb.PackedDataLoader(RecordDataset(records), sampler, collate, **options)


def hf_shuffled_stream(paths: list[str], rank: int, world: int) -> Any:
    """Hugging Face parquet in streaming mode, shuffled (its shards and a buffer of records,
    seeded) and then split by node, as its documentation's distributed examples do."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("parquet", data_files=paths, split="train", streaming=True)
    stream = stream.shuffle(seed=SHUFFLE_SEED, buffer_size=SHUFFLE_BUFFER)
    return split_dataset_by_node(stream, rank=rank, world_size=world)


class Data(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.records = stream_data.synthetic_records(SAMPLES, seed=RECORD_SEED)

    def train_dataloader(self) -> Any:
        args, trainer = self.args, self.trainer
        rank, world = trainer.global_rank, trainer.world_size
        data = Path(args.data)
        options = {"trainer": trainer, "num_workers": args.num_workers}
        if args.loader == "mapstyle":
            return packed_map_loader(self.records, window=args.buffer, seed=3, **options)
        parquet = sorted(map(str, data.glob("pq/*.parquet")))
        if args.loader == "hf":
            source = stream_data.hf_stream(parquet, rank, world)
        elif args.loader == "hf_shuffled":
            source = hf_shuffled_stream(parquet, rank, world)
        elif args.loader == "litdata":
            source = stream_data.litdata_stream(str(data / "ld"))
        else:
            source = stream_data.ShardedRecords(self.records, rank, world, shares=args.shares)
        # a failing peer fails the fit within a minute
        return stream_data.stream_loader(
            source, SEQ_LEN, buffer=args.buffer, timeout_s=60, **options
        )

    def val_dataloader(self) -> vb.PackedDataLoader:
        return packed_map_loader(self.records[:16], window=16, seed=0)


def write_data(data: Path) -> None:
    """The records as 8 parquet shards and a LitData directory, once (under a file lock)."""
    from filelock import FileLock

    data.mkdir(parents=True, exist_ok=True)
    with FileLock(str(data / "write.lock")):
        done = data / "done"
        if done.exists():
            return
        records = stream_data.synthetic_records(SAMPLES, seed=RECORD_SEED)
        stream_data.write_parquet(records, data / "pq", shards=8)
        # small chunks: every DataLoader worker of 4 ranks x 2 workers has some
        stream_data.write_litdata(records, data / "ld", chunk_bytes=LITDATA_CHUNK)
        done.write_text("ok")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loader", default="generic", choices=LOADERS)
    p.add_argument("--strategy", default="ddp", choices=STRATEGIES)
    p.add_argument("--mode", default="overlap", choices=("off", "sync", "overlap"))
    p.add_argument("--encoder", action="store_true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--shares", type=float, nargs="+", default=None)
    p.add_argument("--buffer", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps")
    p.add_argument("--val-every", type=int, default=0, help="micro-batches")
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--resume")
    return p


def _strategy(args: argparse.Namespace) -> Any:
    if args.strategy == "ddp":
        return "ddp"
    # a fixed cost model: the plans, and so each rank's packs, depend on the data alone
    config = vb.RebalanceConfig(
        mode=args.mode, encoder=args.encoder, calibration=None, exchange_timeout_s=60
    )
    if args.strategy == "fsdp_vlmbalance":
        return vb.FSDPVLMBalanceStrategy(config=config)
    return vb.VLMBalanceStrategy(config=config)


def _fit(args: argparse.Namespace) -> None:
    # the earlier fits' garbage (their Trainers, strategies and gloo process groups) collected
    # here, not in a DataLoader worker forked from this process: a worker that collected an
    # inherited ProcessGroupGloo hung in its destructor (map-style loader under "vlmbalance",
    # 4 ranks, the 5th fit of a launch: 2 of 2 launches)
    gc.collect()
    L.seed_everything(0, verbose=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[Any] = []
    if args.checkpoint_every:
        callbacks.append(step_checkpoints(args.out, args.checkpoint_every, filename="{step}"))
    validate: dict[str, Any] = {"limit_val_batches": 0}
    if args.val_every:
        # saved when each validation ends (not at the training epoch's end), every one kept
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "ckpt",
                filename="val-{step}",
                save_top_k=-1,
                save_on_train_epoch_end=False,
            )
        )
        validate = {
            "val_check_interval": args.val_every,
            "check_val_every_n_epoch": None,  # every val_every micro-batches, not per epoch
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
        }
    if args.fail_at_step is not None:
        callbacks.append(OnExceptionCheckpoint(dirpath=out / "ckpt", filename="on_exception"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(args),
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        **validate,
    )
    model = RecordingVLM(args.out, args.fail_at_step, **SMALL_VLM, max_positions=SEQ_LEN)
    # a hung rank's stacks on demand (again each fit: Lightning's teardown restores the signal
    # handlers Python knew of, not faulthandler's)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        trainer.fit(model, datamodule=Data(args), ckpt_path=args.resume)
    except BaseException as error:
        write_record(model, trainer, error)
        if not isinstance(error, InjectedFailureError):
            raise
        print(f"rank {trainer.global_rank}: {error} (caught)", flush=True)


def main() -> None:
    parsed = [_parser().parse_args(f) for f in fit_arg_lists(sys.argv[1:])]
    torch.set_num_threads(1)
    for args in parsed:  # before Lightning starts the other ranks (they find it written)
        if args.loader in ("hf", "hf_shuffled", "litdata"):
            write_data(Path(args.data))
    for args in parsed:
        _fit(args)


if __name__ == "__main__":
    main()
