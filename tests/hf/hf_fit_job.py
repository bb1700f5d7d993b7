"""A 2-rank CPU fit of a tiny Hugging Face VLM (the example's LightningModule and data), run by
``test_hf_fit.py`` as ``python -m tests.hf.hf_fit_job``.

Rank 0 writes the final parameters (``params.pt``) and ``result.json``: optimizer steps, packs
moved, and, per rank, the packs trained and how many of them were text-only. Several fits in
one launch: argument lists separated by ``--then``, one after the other in the same processes.
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
from examples.hf_vlm import HFVLM, HFData
from lightning_vlmbalance.hf.synthetic import tiny_config
from tests.launch import fit_arg_lists


class CountPacks(L.Callback):
    """Counts the packs this rank trains, those without an image, and the images encoder
    balancing sent to another rank."""

    def __init__(self, moe: vb.CompiledMoERouting | None = None) -> None:
        self.packs = self.text_only = self.moe_layers = self.moved_images = 0
        self.sample_ids: list[int] = []
        self.moe = moe

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        meta = batch["meta"]
        if not meta["padding"]:
            self.packs += 1
            self.text_only += int(meta["images"] == 0)
            self.sample_ids += list(meta["sample_ids"])
        route = batch.get("encoder_route")
        self.moved_images += 0 if route is None else route.moved_images
        if self.moe is not None:  # the routing is patched while fit runs
            self.moe_layers = max(self.moe_layers, len(self.moe.patched))


class ShardedHFVLM(HFVLM):
    """The example's module sharded with FSDP2: every decoder layer and vision block is a unit,
    the rest of the Hugging Face model the root unit."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        inner = self.model.model
        vision = getattr(inner, "visual", None) or getattr(inner, "vision_tower", None)
        blocks = [*self.model.get_decoder().layers]
        blocks += [*getattr(vision, "blocks", [])] if vision is not None else []
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # the root: training_step calls self.model


class SGDHFVLM(HFVLM):
    """The example's module with plain SGD. For parity checks of LLaVA-OneVision: its SigLIP
    attention has key biases whose gradient is exactly zero in exact arithmetic (softmax is
    shift-invariant and there is no rotary position), so it is rounding noise, which AdamW
    normalises into full-size steps of arbitrary sign."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    """One fit, or several one after the other in the same processes: argument lists separated
    by ``--then`` (Lightning starts the ranks for the first fit; the later Trainers find them
    started and the process group up)."""
    parsed = [_parser().parse_args(f) for f in fit_arg_lists(sys.argv[1:])]
    torch.set_num_threads(1)
    for args in parsed:
        _fit(args)
    # leave the process group before the interpreter exits: a gloo group torn down at exit
    # while the peer's process is already gone aborted a rank now and then (terminate called
    # without an active exception, exit -6)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--strategy", default="vlmbalance")
    p.add_argument("--mode", default="overlap")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--precision", default="64-true")
    p.add_argument("--moe", action="store_true", help="CompiledMoERouting on the experts")
    p.add_argument("--seq-len", type=int, default=0, help="default: 256, 512 for whole images")
    p.add_argument("--text-share", type=float, default=0.4)
    p.add_argument("--max-images", type=int, default=2, help="images per sample, at most")
    p.add_argument("--encoder", action="store_true", help="encoder balancing (image by image)")
    p.add_argument("--sgd", action="store_true", help="SGD instead of AdamW")
    return p


def _fit(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    config = tiny_config(args.family)
    seq_len = args.seq_len or (256 if args.family.startswith("qwen") else 512)
    data = HFData(
        config,
        n=120,
        seq_len=seq_len,
        text_share=args.text_share,
        seed=0,
        max_images=args.max_images,
    )
    model = (
        ShardedHFVLM(config)
        if args.strategy.startswith("fsdp")
        else SGDHFVLM(config)
        if args.sgd
        else HFVLM(config)
    )
    moe = vb.CompiledMoERouting(backend="aot_eager", log_every_n_steps=1) if args.moe else None
    counter = CountPacks(moe)
    callbacks: list[Any] = [counter] + ([moe] if moe else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=(
            vb.VLMBalanceStrategy(mode=args.mode, encoder=args.encoder)
            if args.strategy == "vlmbalance"
            else vb.FSDPVLMBalanceStrategy(mode=args.mode, encoder=args.encoder)
            if args.strategy == "fsdp_vlmbalance"
            else "ddp"
        ),
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data)
    everyone = trainer.strategy.all_gather(
        torch.tensor([counter.packs, counter.text_only, counter.moved_images], dtype=torch.long)
    )
    ids: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(ids, counter.sample_ids)
    if trainer.is_global_zero:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        params = {k: v.detach().clone() for k, v in model.model.named_parameters()}
        torch.save(params, out / "params.pt")
        result = {
            "steps": trainer.global_step,
            "packs": everyone[:, 0].tolist(),
            "text_only": everyone[:, 1].tolist(),
            "moved_images": everyone[:, 2].tolist(),
            "sample_ids": ids,
            "loss": float(trainer.callback_metrics["train/loss"]),
            "moe_layers": counter.moe_layers,
            "metrics": sorted(trainer.callback_metrics),
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
