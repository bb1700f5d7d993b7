"""CompiledMoERouting in a real Trainer: the example VLM and a tiny Hugging Face Mixtral."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch._dynamo

import lightning_vlmbalance as vb
from tests.cpu_fit import Float64VLM, cpu_trainer, packed_loader

_VLM = {"vocab_size": 64, "patch_dim": 8, "dim": 32, "heads": 2, "moe_experts": 4, "moe_topk": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_example_vlm_trains_the_same_with_sorted_compiled_routing() -> None:
    models = []
    cb = vb.CompiledMoERouting(backend="aot_eager", log_every_n_steps=1)
    for callbacks in ([], [cb]):
        torch.manual_seed(0)
        model = Float64VLM(**_VLM).double()
        trainer = cpu_trainer(callbacks, steps=4)
        trainer.fit(model, packed_loader())
        models.append((model, trainer))
    (ref, _), (got, trainer) = models
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9), name
    metrics = trainer.logged_metrics
    assert {"moe/lb_loss", "moe/max_load", "moe/llm.blocks.0.ffn/lb_loss"} <= set(metrics)
    assert float(metrics["moe/max_load"]) >= 1.0
    assert cb.patched == [] and "forward" not in got.llm.blocks[0].ffn.__dict__  # restored


class TinyMixtral(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.MixtralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
        self.model = transformers.MixtralForCausalLM(cfg)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(ids, labels=ids).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_hugging_face_mixtral_trains_with_the_callback() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (6, 16))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    cb = vb.CompiledMoERouting(backend="aot_eager", log_every_n_steps=1)
    model = TinyMixtral()
    trainer = cpu_trainer([cb], steps=3)
    trainer.fit(model, data)
    assert torch.isfinite(trainer.logged_metrics["loss"])
    assert "moe/model.model.layers.1.mlp.experts/lb_loss" in trainer.logged_metrics
