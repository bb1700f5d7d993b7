"""ActivationOffload in a real Trainer: same parameters, no-op without CUDA, clean teardown."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM

_VLM = {"vocab_size": 64, "patch_dim": 8, "dim": 32, "heads": 2, "moe_experts": 2}


def _loader() -> vb.PackedDataLoader:
    table = vb.synthetic_length_table(48, tile_tokens=8, max_text_tokens=64, seed=2)
    ds = vb.SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128, seed=0)
    return vb.PackedDataLoader(ds, sampler, vb.PackCollator(128, image_feature_shape=(8,)))


class Float64VLM(ToyVLM):
    def training_step(self, batch, batch_idx):
        batch["pixel_values"] = batch["pixel_values"].double()
        return super().training_step(batch, batch_idx)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit(callbacks: list, steps: int = 4, **vlm) -> tuple[ToyVLM, L.Trainer]:
    torch.manual_seed(0)
    model = Float64VLM(**{**_VLM, **vlm}).double()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _loader())
    return model, trainer


@pytest.mark.parametrize(("mode", "grad_checkpoint"), [("all", False), ("checkpoint", True)])
def test_trained_parameters_are_bitwise_equal(mode, grad_checkpoint) -> None:
    ref, _ = _fit([], grad_checkpoint=grad_checkpoint)
    cb = vb.ActivationOffload(mode, min_bytes=0, test_mode=True, log_every_n_steps=1)
    got, _ = _fit([cb], grad_checkpoint=grad_checkpoint)
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(a, b), name
    assert cb.offloader is None  # torn down at the end of fit
    stats = cb.last_stats
    # "checkpoint": per micro-batch, the outputs of the 3 blocks (1 vision, 2 LLM; the next
    # block's or the final norm's input) and the LLM cu_seqlens, which the second block's
    # checkpoint saves (min_bytes=0 here); "all": every saved activation (114)
    per_micro_batch = stats["offloaded_tensors"] / 8
    assert per_micro_batch == 4 if mode == "checkpoint" else per_micro_batch > 100
    assert stats["live_handles"] == 0 and stats["pool_in_use_bytes"] == 0
    # hooks are gone: a forward saves nothing through them any more
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_without_cuda_it_is_a_no_op_with_one_line(caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cb = vb.ActivationOffload()
    with caplog.at_level(logging.INFO):
        _fit([cb], steps=1)
    lines = [r.getMessage() for r in caplog.records if "ActivationOffload" in r.getMessage()]
    assert len(lines) == 1 and "nothing to offload" in lines[0]


class FailingVLM(Float64VLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            batch["pixel_values"] = batch["pixel_values"].double()
            self(batch)  # a forward under the hooks, then a failure before backward
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_an_error_in_training_leaves_no_hooks_behind() -> None:
    cb = vb.ActivationOffload(min_bytes=0, test_mode=True)
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(FailingVLM(**_VLM).double(), _loader())
    assert cb.offloader is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_checkpoint_mode_needs_blocks() -> None:
    model = torch.nn.Linear(4, 4)
    cb = vb.ActivationOffload("checkpoint", test_mode=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    module = L.LightningModule()
    module.net = model
    with pytest.raises(ValueError, match="found no blocks"):
        cb.setup(trainer, module, "fit")
