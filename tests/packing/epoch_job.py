"""A CPU fit over several epochs whose plans have different pack counts, for the epoch tests.

    python -m tests.packing.epoch_job --out DIR --strategy vlmbalance --devices 2 --balance

Every rank writes ``DIR/rank{r}.json``: per micro-batch it trained, ``(epoch, global_step,
sample_ids, loss_tokens, global_loss_tokens)``, and the pack count of every epoch's plan on its
rank (what the sampler planned, whatever Lightning was told). ``--reload`` asks for a new loader
every epoch; ``--checkpoint-every N`` saves every N optimizer steps; ``--resume CKPT`` resumes;
``--plain-loader`` trains a torch ``DataLoader`` over epoch 0's packs with ``PackCollator``
(a loader that cannot resume). Several fits in one launch: argument lists separated by
``--then``, one after the other in the same processes.
Run as a subprocess: Lightning's DDP launcher re-executes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_vlmbalance as vb
from lightning_vlmbalance.synthetic import LengthTable, SyntheticVLMDataset, synthetic_length_table
from tests.balance.strategy_job import Job
from tests.launch import fit_arg_lists
from tests.packing.lightning_job import SMALL_VLM, step_checkpoints

SAMPLES, SEQ_LEN = 300, 128


def length_table() -> LengthTable:
    return synthetic_length_table(
        SAMPLES, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1
    )


def pack_heavy(pack_ms: float) -> vb.CostModel:
    """A cost model whose packs cost ``pack_ms`` each besides their tokens: at 24 ms the epochs
    of this table are predicted faster formed at the source in some epochs, plain in others
    (``mode="auto"``'s per-epoch decision: formed, plain, plain, formed, formed at seed 6)."""
    return vb.CostModel(
        coefficients={
            "vision_fwd": {"image_pack": 1.0, "image_tokens": 1.0},
            "vision_bwd": {"image_pack": 2.0, "image_tokens": 2.0},
            "llm_fwd": {"pack": pack_ms, "total_tokens": 0.1},
            "llm_bwd": {"pack": 2 * pack_ms, "total_tokens": 0.2},
        }
    )


def sampler(
    *,
    seed: int,
    window: int,
    balance: bool,
    num_replicas: int | None = None,
    micro_steps: int | None = None,
    when: str = "always",
    pack_ms: float | None = None,
    **kw: Any,
) -> vb.PackingSampler:
    """The sampler of the job (the tests build the same one to know its plans' pack counts).
    Balanced, it forms every epoch at the source (these fits are about formed plans' counts)
    unless ``when="auto"``."""
    table = length_table()
    model = None if pack_ms is None else pack_heavy(pack_ms)
    return vb.PackingSampler(
        table.total_tokens,
        table.image_tokens,
        seq_len=SEQ_LEN,
        seed=seed,
        window=window,
        balance=vb.SourceBalance(micro_steps=micro_steps, when=when, cost_model=model)
        if balance
        else None,
        num_replicas=num_replicas,
        **kw,
    )


class EpochData(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.loaders: list[vb.PackedDataLoader] = []

    def train_dataloader(self) -> Any:
        a = self.args
        if a.plain_loader:  # this rank's packs of epoch 0, the same every epoch; no state
            world, rank = self.trainer.world_size, self.trainer.global_rank
            plan = sampler(seed=a.seed, window=a.window, balance=False, num_replicas=world)
            return DataLoader(
                SyntheticVLMDataset(length_table(), vocab_size=64, patch_dim=8),
                batch_sampler=[ids.tolist() for ids in plan.plan().rank_packs[rank]],
                collate_fn=vb.PackCollator(SEQ_LEN, image_feature_shape=(8,)),
            )
        if a.validate_with_training_loader and self.loaders:
            return self.loaders[-1]  # made by val_dataloader for the sanity check
        workers = {"persistent_workers": True} if a.persistent_workers else {}
        loader = vb.PackedDataLoader(
            SyntheticVLMDataset(length_table(), vocab_size=64, patch_dim=8),
            sampler(
                seed=a.seed,
                window=a.window,
                balance=a.balance,
                when=a.balance_when,
                pack_ms=a.balance_pack_ms,
            ),
            vb.PackCollator(SEQ_LEN, image_feature_shape=(8,)),
            trainer=self.trainer,
            num_workers=a.num_workers,
            **workers,
        )
        self.loaders.append(loader)
        return loader

    def val_dataloader(self) -> Any:
        a = self.args
        if a.validate_with_training_loader:  # the very same object (validation mid-epoch)
            return self.loaders[-1] if self.loaders else self.train_dataloader()
        if not a.validate:
            return []
        return vb.PackedDataLoader(
            SyntheticVLMDataset(length_table(), vocab_size=64, patch_dim=8),
            sampler(seed=a.seed, window=a.window, balance=False),
            vb.PackCollator(SEQ_LEN, image_feature_shape=(8,)),
            trainer=self.trainer,
        )


class EpochJob(Job):
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.validated.append((self.current_epoch, batch["meta"]["sample_ids"]))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.trained.append(
            (
                self.current_epoch,
                self.trainer.global_step,
                batch["meta"]["sample_ids"],
                int(batch["loss_tokens"]),
                int(batch["global_loss_tokens"]),
            )
        )
        return super().training_step(batch, batch_idx)

    one_cycle = False  # --one-cycle

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if not self.one_cycle:
            return optimizer
        # the usual schedule sized from Lightning's estimate: stepping past its end raises
        self.estimated_steps = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-3, total_steps=self.estimated_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        super().on_train_start()
        self.trained: list[tuple] = []
        self.validated: list[tuple] = []

    def on_train_end(self) -> None:
        loaders = self.trainer.datamodule.loaders
        planned, taken = {}, {}
        for epoch in range(self.trainer.max_epochs if loaders else 0):
            plan = loaders[-1].sampler.plan(epoch)
            planned[epoch] = len(plan.rank_packs[loaders[-1].sampler.rank])
            taken[epoch] = None if plan.epoch_choice is None else plan.epoch_choice["taken"]
        path = Path(self.out) / f"rank{self.global_rank}.json"
        path.write_text(
            json.dumps(
                {
                    "trained": self.trained,
                    "validated": self.validated,
                    "planned": planned,
                    "taken": taken,  # mode="auto": each epoch's plan (plain or formed)
                    "optimizer_steps": self.trainer.global_step,
                    "estimated_steps": getattr(self, "estimated_steps", None),
                    "loaders": len(self.trainer.datamodule.loaders),
                }
            )
        )


def main() -> None:
    """One fit, or several one after the other in the same processes: argument lists separated
    by ``--then`` (``tests.balance.strategy_job.run_fits``)."""
    parsed = [_parser().parse_args(f) for f in fit_arg_lists(sys.argv[1:])]
    assert len({a.devices for a in parsed}) == 1, "one world per launch"
    torch.set_num_threads(1)
    for args in parsed:
        _fit(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="vlmbalance")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--balance", action="store_true")
    p.add_argument("--balance-when", default="always", choices=("always", "auto"))
    p.add_argument("--balance-pack-ms", type=float, default=None, help="pack_heavy(ms) model")
    p.add_argument("--reload", action="store_true", help="reload_dataloaders_every_n_epochs=1")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--overfit-batches", type=float, default=0.0)
    p.add_argument("--plain-loader", action="store_true")
    p.add_argument("--validate", action="store_true", help="a PackedDataLoader validates")
    p.add_argument("--one-cycle", action="store_true", help="OneCycleLR over the estimate")
    p.add_argument("--validate-with-training-loader", action="store_true")
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--val-check-interval", type=int, default=None, help="in training batches")
    return p


def _fit(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    strategy: Any = args.strategy
    if args.strategy == "fsdp_vlmbalance":
        strategy = vb.FSDPVLMBalanceStrategy(exchange_timeout_s=60.0)
    elif args.strategy == "vlmbalance":
        strategy = vb.VLMBalanceStrategy(exchange_timeout_s=60.0)
    callbacks = []
    if args.checkpoint_every:
        callbacks.append(step_checkpoints(args.out, args.checkpoint_every))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        reload_dataloaders_every_n_epochs=1 if args.reload else 0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        overfit_batches=args.overfit_batches,
        val_check_interval=args.val_check_interval,
        use_distributed_sampler=not args.plain_loader,  # its batch sampler is a list
    )
    model = EpochJob(args.out, **{**SMALL_VLM, "moe_experts": 0}, max_positions=SEQ_LEN)
    model.one_cycle = args.one_cycle
    trainer.fit(model, datamodule=EpochData(args), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
