"""The Hugging Face main job: a tiny random-init Qwen2.5-VL trained on packed processor outputs.

    python -m examples.hf_vlm                       # 2 processes (gloo), strategy "vlmbalance"
    python -m examples.hf_vlm --family idefics3     # another family
    python -m examples.hf_vlm --strategy ddp        # plain DDP, same loss contract

The dataset is synthetic (built in, no download): random images through the family's real image
processor, text tokens around them, a share of text-only samples. Lightning's DDP launcher re-runs
this module for the other ranks. Logs go to TensorBoard under ``--root`` (default ``runs/``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from transformers import AutoModelForImageTextToText

import lightning_vlmbalance as vb
import lightning_vlmbalance.hf as vbhf
from examples.train import RunSummary, print_run
from lightning_vlmbalance.hf.synthetic import SyntheticProcessed, tiny_config


# --- the user's code: a LightningModule around any supported Hugging Face VLM -------------------
class HFVLM(L.LightningModule):
    def __init__(self, config: Any, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = AutoModelForImageTextToText.from_config(
            config, attn_implementation="vlmbalance"
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        inputs = vbhf.model_inputs(self.model, batch, labels=False)
        out = vb.packed_cross_entropy(self.model(**inputs).logits, batch, module=self)
        if out.mean is not None:
            self.log("train/loss", out.mean, batch_size=out.loss_tokens)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# --- end of the user's code ----------------------------------------------------------------------


class PackedHFData(L.LightningDataModule):
    """Processor outputs (``dataset``) packed by ``PackingSampler``, lengths from the items."""

    def __init__(
        self, config: Any, dataset: Any, *, seq_len: int, seed: int, lengths: Any = None
    ) -> None:
        super().__init__()
        self.config, self.dataset, self.seq_len, self.seed = config, dataset, seq_len, seed
        # from the same processor outputs, unless given
        self.lengths = vbhf.item_lengths(dataset, config) if lengths is None else lengths
        self.loader: vb.PackedDataLoader | None = None

    def train_dataloader(self) -> vb.PackedDataLoader:
        sampler = vb.PackingSampler(
            self.lengths.total_tokens,
            self.lengths.image_tokens,
            seq_len=self.seq_len,
            seed=self.seed,
        )
        collate = vbhf.HFPackCollator(self.config, self.seq_len)
        self.loader = vb.PackedDataLoader(self.dataset, sampler, collate, trainer=self.trainer)
        return self.loader


class HFData(PackedHFData):
    """Processor outputs of synthetic samples, packed by ``PackingSampler``."""

    def __init__(
        self,
        config: Any,
        *,
        n: int,
        seq_len: int,
        text_share: float,
        seed: int,
        max_images: int = 2,
    ) -> None:
        dataset = SyntheticProcessed(
            config, n, seed=seed, text_share=text_share, max_images=max_images
        )
        super().__init__(config, dataset, seq_len=seq_len, seed=seed)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", default="qwen2_5_vl", choices=vbhf.synthetic.TINY_FAMILIES)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-samples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--text-share", type=float, default=0.4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs")
    p.add_argument("--strategy", default="vlmbalance", choices=("vlmbalance", "ddp"))
    p.add_argument("--balance-mode", default="overlap", choices=("overlap", "sync", "off"))
    p.add_argument(
        "--encoder",
        action="store_true",
        help="encoder balancing: images encoded on other ranks (one micro-batch per step too)",
    )
    p.add_argument("--max-images", type=int, default=2, help="images per sample, at most")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # one core per rank: two ranks must not fight over two cores
    L.seed_everything(args.seed, verbose=False)
    config = tiny_config(args.family)
    data = HFData(
        config,
        n=args.num_samples,
        seq_len=args.seq_len,
        text_share=args.text_share,
        seed=args.seed,
        max_images=args.max_images,
    )
    model = HFVLM(config)
    monitor = vb.StragglerMonitor(log_every_n_steps=10)
    summary = RunSummary(monitor)
    multi = args.devices > 1
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=(
            vb.VLMBalanceStrategy(mode=args.balance_mode, encoder=args.encoder)
            if args.strategy == "vlmbalance" and multi
            else "ddp"
            if multi
            else "auto"
        ),
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(Path(args.root), name=f"hf_{args.family}"),
        log_every_n_steps=5,
        callbacks=[monitor, summary],
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    plan = data.loader.sampler.plan()  # the last epoch's: how many of its packs had no image
    images = data.lengths.image_tokens
    summary.summary["text_only_packs"] = sum(
        int(images[ids].sum() == 0) for packs in plan.rank_packs for ids in packs if len(ids)
    )
    if trainer.is_global_zero:
        print_run(summary.summary)
        print(f"Text-only packs in the last epoch: {summary.summary['text_only_packs']}")
    return summary.summary


if __name__ == "__main__":
    main()
