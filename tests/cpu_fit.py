"""Small single-process CPU fits of the example VLM, shared by the callback tests."""

from __future__ import annotations

import lightning as L

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


def packed_loader(trainer: L.Trainer | None = None) -> vb.PackedDataLoader:
    table = synthetic_length_table(48, tile_tokens=8, max_text_tokens=64, seed=2)
    ds = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128, seed=0)
    return vb.PackedDataLoader(
        ds, sampler, vb.PackCollator(128, image_feature_shape=(8,)), trainer=trainer
    )


class Float64VLM(ToyVLM):
    """The example VLM in float64 (the loader yields float32 pixels)."""

    def training_step(self, batch, batch_idx):
        batch["pixel_values"] = batch["pixel_values"].double()
        return super().training_step(batch, batch_idx)


def cpu_trainer(callbacks: list, steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
