"""A 2-process CPU fit with StragglerMonitor where rank 1 sleeps in its vision forward.

    python -m tests.callbacks.straggler_job --out DIR --delay-ms 40 --accumulate 4

Run as a subprocess (Lightning's DDP launcher re-executes it). Logs go to DIR/tb.
``--checkpoint-every N`` saves ``DIR/ckpt/step=<k>.ckpt`` every N optimizer steps;
``--then-resume-from K`` then fits again in the same processes, as a restarted job would: a new
Trainer, model and monitor resumed from ``step=K.ckpt`` up to ``--max-steps``, writing the same
JSON-lines folder (``--jsonl-dir``), its summary in ``DIR/summary_resumed.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import (
    LengthTable,
    SyntheticVLMDataset,
    synthetic_length_table,
)
from tests.packing.lightning_job import Data


class SlowVisionVLM(ToyVLM):
    def __init__(self, delay_ms: float, val_sleep_ms: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.delay_s = delay_ms / 1e3
        self.val_sleep_s = val_sleep_ms / 1e3
        # registered before the monitor's hooks, so the sleep is inside the timed forward
        self.vision.register_forward_hook(self._slow_down)

    def _slow_down(self, *_: Any) -> None:
        if self._trainer is not None and self.global_rank == 1 and self.delay_s:
            time.sleep(self.delay_s)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:  # rank 1 is slow in validation only: between training steps
            time.sleep(self.val_sleep_s)
        return self.loss(batch)


class DataWithVal(Data):
    def val_dataloader(self) -> vb.PackedDataLoader:
        return self.train_dataloader()


def _never_called_hook(state: Any, bucket: Any) -> Any:
    raise RuntimeError("the user's comm hook ran on the CPU, where Lightning never registers it")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--delay-ms", type=float, default=40.0)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--epochs", type=int, default=None, help="max_epochs (with --max-steps -1)")
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--resume")
    p.add_argument("--val-sleep-ms", type=float, default=0.0, help="rank 1 sleeps per val batch")
    p.add_argument("--val-every", type=int, default=0, help="micro-batches between validations")
    p.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps")
    p.add_argument("--then-resume-from", type=int, default=0, help="a checkpoint's step")
    p.add_argument("--jsonl-dir")
    p.add_argument("--user-hook", action="store_true", help="DDPStrategy(ddp_comm_hook=...)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "vlmbalance", "fsdp_vlmbalance"))
    p.add_argument("--mode", default="off", help="the rebalancing mode of our strategies")
    p.add_argument("--calibrate-every", type=int, default=0, help="online calibration period")
    p.add_argument("--wrong-model", action="store_true", help="start: vision x0.05, LLM x20")
    p.add_argument("--source", action="store_true", help="balanced at the source (the sampler)")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    table = synthetic_length_table(600, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1)
    _fit(args, table, resume=args.resume)
    if args.then_resume_from:
        ckpt = Path(args.out) / "ckpt" / f"step={args.then_resume_from}.ckpt"
        _fit(args, table, resume=ckpt, summary="summary_resumed.json", version=1)


class RecordCalibration(Callback):
    """At the end of training, every rank writes what online calibration adopted and the model
    its training loader plans with (before the strategy's teardown drops the loader)."""

    def __init__(self, monitor: vb.StragglerMonitor, out: str, name: str) -> None:
        self.monitor, self.out, self.name = monitor, out, name
        self.start_model: dict | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        rebalancer = getattr(trainer.strategy, "rebalancer", None)
        if rebalancer is not None and rebalancer.cost_model is not None:
            self.start_model = rebalancer.cost_model.to_dict()  # after a resume: the restored
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.seen.append(list(batch["meta"]["sample_ids"]))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        rebalancer = getattr(trainer.strategy, "rebalancer", None)  # plain DDP has none
        driver = None if rebalancer is None else rebalancer.calibration
        if driver is None or driver not in self.monitor.listeners:
            return
        sampler = rebalancer.loader.loader.sampler
        (Path(self.out) / f"{self.name}_rank{trainer.global_rank}.json").write_text(
            json.dumps(
                {
                    "seen": self.seen,
                    "switches": [b for b, _ in sampler.cost_schedule()] if sampler.balanced else [],
                    "epoch_packs": sampler.packs_per_rank(),
                    "shipped": driver.shipped,
                    "loader_model": rebalancer.loader.cost_model.to_dict(),
                    "planned_batches": rebalancer.loader.planned_batches,
                    "version": rebalancer.calibrator.version,
                    "global_step": trainer.global_step,
                    "start_model": self.start_model,
                }
            )
        )


class SourceData(Data):
    """The packs balanced at the source by ``cost_model`` (the strategy's starting model)."""

    def __init__(self, table: LengthTable, seq_len: int, workers: int, model: Any) -> None:
        super().__init__(table, seq_len, workers)
        self.model = model

    def train_dataloader(self) -> vb.PackedDataLoader:
        t = self.table
        sampler = vb.PackingSampler(
            t.total_tokens, t.image_tokens, seq_len=self.seq_len, seed=3, balance=self.model
        )
        return vb.PackedDataLoader(
            SyntheticVLMDataset(t, vocab_size=64, patch_dim=8),
            sampler,
            vb.PackCollator(self.seq_len, image_feature_shape=(8,)),
            trainer=self.trainer,
        )


def _start_model(args: argparse.Namespace) -> vb.CostModel | None:
    if not args.wrong_model:
        return None
    return vb.CostModel.from_dict(_scaled(vb.CostModel().to_dict(), 0.05, 20.0))


def _scaled(model: dict, vision: float, llm: float) -> dict:
    """A cost model's coefficients with the vision phases times ``vision``, the LLM's ``llm``."""
    for phase, terms in model["coefficients"].items():
        for term in terms:
            terms[term] *= vision if phase.startswith("vision") else llm
    return model


def _fit(
    args: argparse.Namespace,
    table: LengthTable,
    resume: str | Path | None,
    summary: str = "summary.json",
    version: int = 0,
) -> None:
    monitor = vb.StragglerMonitor(log_every_n_steps=args.log_every, jsonl_dir=args.jsonl_dir)
    name = "calibration" if version == 0 else "calibration_resumed"
    callbacks: list[Callback] = [monitor, RecordCalibration(monitor, args.out, name)]
    if args.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=Path(args.out) / "ckpt",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                filename="{step}",
            )
        )
    strategy: Any = args.strategy if args.devices > 1 else "auto"
    if args.strategy != "ddp":  # by default the order of the packs stays (the wait is measured)
        calibration = (
            vb.Calibration(every_n_steps=args.calibrate_every, window_steps=40, min_records=8)
            if args.calibrate_every
            else None
        )
        config = vb.RebalanceConfig(mode=args.mode, calibration=calibration)
        strategy = (
            vb.VLMBalanceStrategy if args.strategy == "vlmbalance" else vb.FSDPVLMBalanceStrategy
        )(config=config, cost_model=_start_model(args))
    if args.user_hook:
        strategy = DDPStrategy(ddp_comm_hook=_never_called_hook)
    validate = {}
    if args.val_sleep_ms or args.val_every:  # by default every 2 optimizer steps, 2 batches
        validate = dict(
            val_check_interval=args.val_every or 2 * args.accumulate,
            check_val_every_n_epoch=None,
            limit_val_batches=2,
            num_sanity_val_steps=0,
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        **validate,
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(Path(args.out) / "tb", name="run", version=version),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.checkpoint_every),
    )
    model = SlowVisionVLM(
        args.delay_ms,
        val_sleep_ms=args.val_sleep_ms,
        vocab_size=64,
        patch_dim=8,
        dim=16,
        heads=2,
        llm_layers=1,
        max_positions=128,
        moe_experts=2,
    )
    data = (
        SourceData(table, 128, 0, _start_model(args) or vb.CostModel())
        if args.source
        else (DataWithVal if validate else Data)(table, 128, 0)
    )
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    # every rank saves (Lightning's save_checkpoint is a collective); rank 0 writes
    trainer.save_checkpoint(Path(args.out) / ("last.ckpt" if version == 0 else "last_resumed.ckpt"))
    if trainer.is_global_zero:
        (Path(args.out) / summary).write_text(json.dumps(monitor.summary()))


if __name__ == "__main__":
    main()
