"""The example VLM trains in bf16 on the CPU, with and without its MoE feed-forward."""

from __future__ import annotations

import pytest
import torch

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


@pytest.mark.parametrize("experts", [0, 2])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_forward_and_backward_in_bf16(experts, precision) -> None:
    """bf16-mixed used to fail twice: the projector's bf16 output put into float32 embeddings,
    and the experts' bf16 outputs added into a float32 sum."""
    table = synthetic_length_table(6, tile_tokens=8, max_text_tokens=64, seed=0)
    ds = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
    batch = vb.PackCollator(256)([ds[i] for i in range(6)])
    assert batch["image_positions"].numel() > 0
    model = ToyVLM(vocab_size=64, patch_dim=8, dim=16, heads=2, moe_experts=experts)
    if precision == "bf16-true":
        model = model.bfloat16()
        batch["pixel_values"] = batch["pixel_values"].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        out = vb.packed_cross_entropy(model(batch), batch)
    out.loss.backward()
    assert torch.isfinite(out.loss_sum)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
