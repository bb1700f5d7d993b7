"""StragglerMonitor undoes its hooks and keeps its JSON lines when training raises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import synthetic_length_table
from tests.packing.lightning_job import Data


class FailingVLM(ToyVLM):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.global_step == 3:
            raise ValueError("boom")
        return super().training_step(batch, batch_idx)


def test_cleanup_after_an_exception(tmp_path: Path) -> None:
    torch.manual_seed(0)
    table = synthetic_length_table(200, tile_tokens=8, max_text_tokens=64, seed=1)
    monitor = vb.StragglerMonitor(log_every_n_steps=100, jsonl_dir=tmp_path)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    model = FailingVLM(vocab_size=64, patch_dim=8, dim=16, heads=2, llm_layers=1, max_positions=128)
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(model, datamodule=Data(table, 128, 0))
    loop = trainer.fit_loop.epoch_loop
    assert "_broadcast_sigterm_tensor" not in loop.__dict__
    assert not model.vision._forward_pre_hooks and not model.vision._forward_hooks
    rows = [json.loads(x) for x in (tmp_path / "rank_0.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [1, 2, 3]
