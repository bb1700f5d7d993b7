"""A 2-process CPU fit with ``strategy="vlmbalance"`` or ``"ddp"``, for the strategy tests.

    python -m tests.balance.strategy_job --out DIR --strategy vlmbalance --mode sync

Float64, seeded: rank 0 writes ``DIR/params.pt`` (the final parameters); every rank writes
``DIR/rank{r}.json`` with the ``(epoch, pack_id, sample_ids)`` it trained on and the balance
metrics it saw. With ``--strategy ddp --global-tokens`` the loader is wrapped in a
``RebalancingLoader(mode="off")`` so that plain DDP uses the same loss normalisation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.loader import RebalancingLoader
from tests.packing.lightning_job import SMALL_VLM, Data, RecordingVLM


class GlobalTokenData(Data):
    def __init__(self, *args: Any, micro_steps: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.micro_steps = micro_steps

    def train_dataloader(self) -> Any:
        return RebalancingLoader(
            super().train_dataloader(),
            micro_steps=self.micro_steps,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            mode="off",
        )


BROADCASTS = [0]


def _fail_exchange(rank: int, at: int) -> None:
    """On ``rank``, the n-th exchange raises (as a bug or a lost device would)."""
    import os

    import lightning_vlmbalance.balance.loader as loader_mod

    if int(os.environ.get("LOCAL_RANK", "0")) != rank:
        return
    original, calls = loader_mod.exchange_packs, [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(f"rank {rank} failed on purpose in its exchange")
        return original(*args, **kwargs)

    loader_mod.exchange_packs = failing


def _count_broadcasts() -> None:
    """Counts Lightning's SIGTERM broadcasts (a class-level wrap, under any instance gate)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    original = _TrainingEpochLoop._broadcast_sigterm_tensor

    def counted(self: Any) -> None:
        BROADCASTS[0] += 1
        original(self)

    _TrainingEpochLoop._broadcast_sigterm_tensor = counted


class Job(RecordingVLM):
    def on_train_end(self) -> None:
        super().on_train_end()
        strategy = self.trainer.strategy
        loader = getattr(strategy, "rebalancing_loader", None)
        stats = list(loader.stats) if loader is not None else []
        path = Path(self.out) / f"stats{self.global_rank}.json"
        path.write_text(
            json.dumps(
                {
                    "stats": stats,
                    "broadcasts": BROADCASTS[0],
                    "optimizer_steps": self.trainer.global_step,
                    "logged": sorted(k for k in self.trainer.callback_metrics if "balance" in k),
                }
            )
        )
        if self.global_rank == 0:
            torch.save(
                {k: v.detach().clone() for k, v in self.state_dict().items()},
                Path(self.out) / "params.pt",
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="vlmbalance")
    p.add_argument("--mode", default="overlap")
    p.add_argument("--global-tokens", action="store_true")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--data-micro-steps", type=int, default=None, help="for --global-tokens")
    p.add_argument("--fail-rank", type=int, default=None, help="this rank's exchange raises")
    p.add_argument("--fail-at", type=int, default=2, help="...at its n-th global batch")
    p.add_argument("--exchange-timeout-s", type=float, default=60.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    _count_broadcasts()
    L.seed_everything(0, verbose=False)
    seq_len = 128
    table = vb.synthetic_length_table(
        args.samples, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1
    )
    strategy: Any = args.strategy
    if args.strategy == "vlmbalance":
        strategy = vb.VLMBalanceStrategy(mode=args.mode, exchange_timeout_s=args.exchange_timeout_s)
    if args.fail_rank is not None:
        _fail_exchange(args.fail_rank, args.fail_at)
    data = (
        GlobalTokenData(table, seq_len, 0, micro_steps=args.data_micro_steps or args.accumulate)
        if args.global_tokens
        else Data(table, seq_len, 0)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        precision="64-true",
        logger=False,
        enable_checkpointing=bool(args.checkpoint_every),
        callbacks=[
            ModelCheckpoint(
                dirpath=Path(args.out) / "ckpt",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                filename="{step}",
            )
        ]
        if args.checkpoint_every
        else [],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Job(args.out, **SMALL_VLM, max_positions=seq_len)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
