"""CompiledMoERouting in a real Trainer: the example VLM and tiny Hugging Face Mixtral/GPT-OSS."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch._dynamo

import lightning_vlmbalance as vb
from examples.vlm import MoEFeedForward, ToyVLM
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


class FailsAtStepTwo(ToyVLM):
    """The example VLM, raising in ``training_step`` at step 2 (after two optimizer steps)."""

    patched_in_step: bool = False

    def training_step(self, batch, batch_idx):
        self.patched_in_step = all("forward" in b.ffn.__dict__ for b in self.llm.blocks)
        if batch_idx == 2:
            raise RuntimeError("failed on purpose at step 2")
        return super().training_step(batch, batch_idx)


def test_forwards_are_restored_when_fit_raises() -> None:
    """Lightning skips callback ``teardown`` after an exception: ``on_exception`` must restore
    the original forwards, and a later ``teardown`` must find nothing left to do."""
    torch.manual_seed(0)
    model = FailsAtStepTwo(**_VLM)
    cb = vb.CompiledMoERouting(compile=False, log_every_n_steps=1)
    trainer = cpu_trainer([cb], steps=4)
    with pytest.raises(RuntimeError, match="failed on purpose at step 2"):
        trainer.fit(model, packed_loader())
    assert trainer.global_step == 2 and model.patched_in_step  # it crashed while patched
    ffns = [b.ffn for b in model.llm.blocks]
    assert cb.patched == []
    for ffn in ffns:
        assert "forward" not in ffn.__dict__
        assert ffn.forward.__func__ is MoEFeedForward.forward
    cb.teardown(trainer, model, "fit")  # idempotent
    assert all(ffn.forward.__func__ is MoEFeedForward.forward for ffn in ffns)


class TinyGptOss(L.LightningModule):
    """GPT-OSS: fused experts with biases, interleaved gate/up and a clamped SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.GptOssConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
        self.model = transformers.GptOssForCausalLM(cfg)


def test_unsupported_moe_modules_are_named_with_the_reason() -> None:
    """A model whose MoE layers it cannot prove must be told apart from one without MoE: each
    skipped module is named with why, and the forwards stay the model's own."""
    torch.manual_seed(0)
    model = TinyGptOss()
    cb = vb.CompiledMoERouting(compile=False)
    with pytest.warns(UserWarning, match="leaves 2 MoE module") as record:
        cb.setup(cpu_trainer([cb], steps=1), model, "fit")
    message = next(str(w.message) for w in record if "CompiledMoERouting" in str(w.message))
    for layer in (0, 1):
        assert (
            f"model.model.layers.{layer}.mlp.experts: expert biases (gate_up_proj_bias,"
            " down_proj_bias) are not supported" in message
        )
    assert "interleaved gate/up columns (`is_concatenated=False`)" in message
    assert "its own gating (`GptOssExperts._apply_gate`)" in message
    assert "found no MoE module" not in message
    assert cb.patched == []
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_model_without_moe_keeps_the_generic_warning() -> None:
    model = ToyVLM(vocab_size=64, patch_dim=8, dim=32, heads=2)  # dense feed-forward
    cb = vb.CompiledMoERouting(compile=False)
    with pytest.warns(UserWarning, match="found no MoE module it knows"):
        cb.setup(cpu_trainer([cb], steps=1), model, "fit")
    assert cb.patched == []


class WithFrozenReference(Float64VLM):
    """The example VLM with a frozen copy of its language model made in ``configure_model``, as
    DPO makes its reference (Lightning calls it after the callbacks' ``setup``). Each step
    records how far the reference's MoE outputs are from what its own weights give."""

    def configure_model(self) -> None:
        if "reference" not in self.__dict__:  # not a submodule: neither trained nor saved
            self.__dict__["reference"] = copy.deepcopy(self.llm).requires_grad_(False)
            self.drift: list[float] = []

    def training_step(self, batch, batch_idx):
        x = torch.randn(16, _VLM["dim"], dtype=torch.float64)
        with torch.no_grad():
            for block in self.reference.blocks:
                got, own = block.ffn(x), MoEFeedForward.forward(block.ffn, x)
                self.drift.append(((got - own).abs().max() / own.abs().max()).item())
        return super().training_step(batch, batch_idx)


def test_a_reference_copied_in_configure_model_computes_with_its_own_weights() -> None:
    """A frozen copy of a patched model must not follow the trained weights: its MoE outputs
    equal those of its own weights at every step, and after fit neither the model nor the copy
    is patched."""
    torch.manual_seed(0)
    model = WithFrozenReference(**_VLM).double()
    cb = vb.CompiledMoERouting(compile=False, log_every_n_steps=1)
    trainer = cpu_trainer([cb], steps=3)
    trainer.fit(model, packed_loader())
    assert trainer.global_step == 3 and len(model.drift) == 3 * len(model.llm.blocks)
    assert max(model.drift) < 1e-12, model.drift
    for m in (*model.modules(), *model.reference.modules()):
        assert "forward" not in m.__dict__ and not m._forward_hooks, type(m).__name__


class HalvedFeedForward(MoEFeedForward):
    """A subclass with a forward of its own (it inherits the opt-in, not what it declares)."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x_TD)


def test_a_subclass_with_its_own_forward_is_named_and_trains_unchanged() -> None:
    """A subclass that overrides forward must train exactly as without the callback, and the
    setup warning names it with the reason."""
    models = []
    for callbacks in ([], [vb.CompiledMoERouting(compile=False)]):
        torch.manual_seed(0)
        model = Float64VLM(**_VLM).double()
        for block in model.llm.blocks:
            block.ffn.__class__ = HalvedFeedForward
        if callbacks:
            with pytest.warns(UserWarning, match="HalvedFeedForward.forward") as record:
                cpu_trainer(callbacks, steps=2).fit(model, packed_loader())
            message = next(str(w.message) for w in record if "leaves" in str(w.message))
            assert "llm.blocks.0.ffn: its forward" in message
        else:
            cpu_trainer(callbacks, steps=2).fit(model, packed_loader())
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
