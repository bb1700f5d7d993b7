"""ActivationOffload in a real Trainer: same parameters, no-op without CUDA, clean teardown."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from tests.cpu_fit import Float64VLM, cpu_trainer, packed_loader

_VLM = {"vocab_size": 64, "patch_dim": 8, "dim": 32, "heads": 2, "moe_experts": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(callbacks: list, steps: int = 4, **vlm) -> tuple[ToyVLM, L.Trainer]:
    torch.manual_seed(0)
    model = Float64VLM(**{**_VLM, **vlm}).double()
    trainer = cpu_trainer(callbacks, steps, accumulate_grad_batches=2)
    trainer.fit(model, packed_loader(trainer))
    return model, trainer


@pytest.mark.parametrize(("mode", "grad_checkpoint"), [("all", False), ("checkpoint", True)])
def test_trained_parameters_are_bitwise_equal(mode, grad_checkpoint) -> None:
    ref, _ = _fit([], grad_checkpoint=grad_checkpoint)
    cb = vb.ActivationOffload(mode=mode, min_bytes=0, test_mode=True, log_every_n_steps=1)
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
    trainer = cpu_trainer([cb], 4)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(FailingVLM(**_VLM).double(), packed_loader())
    assert cb.offloader is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_checkpoint_mode_needs_blocks() -> None:
    model = torch.nn.Linear(4, 4)
    cb = vb.ActivationOffload(mode="checkpoint", test_mode=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    module = L.LightningModule()
    module.net = model
    with pytest.raises(ValueError, match="found no blocks"):
        cb.on_fit_start(trainer, module)
