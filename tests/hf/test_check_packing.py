"""check_packing: every supported family's packed documents equal each alone (logits and
gradients, float64), a leaking attention is caught by document, the caller's model is left as it
was, and the command line (a saved checkpoint and saved items, or --tiny) answers by exit code."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf

import lightning_vlmbalance.hf as vbhf
import lightning_vlmbalance.hf.attention as hf_attention
from lightning_vlmbalance.hf import check as hf_check
from lightning_vlmbalance.hf.synthetic import TINY_FAMILIES, SyntheticProcessed, tiny_config


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForImageTextToText.from_config(tiny_config(family))


def _items(model: torch.nn.Module, n: int = 4) -> list:
    data = SyntheticProcessed(model.config, n, seed=1)  # seed 1: items 0-2 images, 3 text only
    return [data[i] for i in range(n)]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_packs_exactly_in_float64(family):
    model = _model(family)
    report = vbhf.check_packing(model, _items(model))
    assert report.ok, str(report)
    assert report.family == family and report.dtype == "float64"
    assert len(report.documents) == 4
    assert [d.images > 0 for d in report.documents] == [True, True, True, False]
    for d in report.documents:
        assert d.logit_scale > 0.1 and d.grad_scale > 0.1  # something was compared
        assert d.logit_diff <= 1e-10 * max(1.0, d.logit_scale)
        grad_tol = 1e-10 if family not in hf_check.FLOAT32_NORMS else 1e-6
        assert d.grad_diff <= grad_tol * max(1.0, d.grad_scale)


NORMS = {  # each family's RMSNorm, and its forward computing in the input's dtype
    "gemma3": (
        "gemma3.modeling_gemma3.Gemma3RMSNorm",
        lambda self, x: self._norm(x) * (1 + self.weight),
    ),
    "gemma4": (
        "gemma4.modeling_gemma4.Gemma4RMSNorm",
        lambda self, x: self._norm(x) * self.weight if self.with_scale else self._norm(x),
    ),
    "qwen3_5": (
        "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
        lambda self, x: self._norm(x) * (1 + self.weight),
    ),
}


@pytest.mark.parametrize("family", hf_check.FLOAT32_NORMS)
def test_float32_norms_are_the_only_reason_for_the_looser_gradient_tolerance(family, monkeypatch):
    """Gemma's and Qwen3.5's gradients are held to 1e-6 in float64 because their RMSNorm
    computes in float32; with that norm computing in the model's dtype the gradients agree to
    1e-10 as well (Qwen3.5: its linear-attention layers run per document exactly)."""
    import importlib

    path, forward = NORMS[family]
    module, cls = path.rsplit(".", 1)
    norm = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    monkeypatch.setattr(norm, "forward", forward)
    model = _model(family)
    report = vbhf.check_packing(model, _items(model), tolerance=1e-10)
    assert report.ok and report.tolerance == 1e-10 and not report.note, str(report)


def _leaking(q, k, v, cu, max_len, *, causal=True, softmax_scale=None, **kwargs):
    """Causal attention over the whole packed row: documents see the ones before them."""
    T = q.shape[0]
    whole = torch.tensor([0, T], dtype=cu.dtype, device=cu.device)
    return _REAL(q, k, v, whole, T, causal=causal, softmax_scale=softmax_scale)


_REAL = hf_attention.packed_attention


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_a_leaking_attention_is_caught_per_document(family, monkeypatch):
    monkeypatch.setattr(hf_attention, "packed_attention", _leaking)
    model = _model(family)
    report = vbhf.check_packing(model, _items(model))
    assert not report.ok
    first, *rest = report.documents
    assert first.ok, str(report)  # the first document has nothing before it to see
    for d in rest:
        assert not d.ok and d.logit_diff > 1e-4 and d.grad_diff > 1e-4, str(report)
    assert "DIFFERS" in str(report) and "do not train" in str(report)


def test_float32_in_place_leaves_the_model_as_it_was():
    model = _model("qwen2_vl").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = vbhf.check_packing(model, _items(model, 3), dtype=None)
    assert report.ok and report.dtype == "float32" and report.tolerance == 1e-5, str(report)
    assert model.training  # its mode restored
    assert next(model.parameters()).dtype == torch.float32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind
    # the default (float64) copies: the caller's model keeps its attention and dtype
    fresh = _model("qwen2_vl")
    vbhf.check_packing(fresh, _items(fresh, 2), gradients=False)
    assert fresh.config.get_text_config()._attn_implementation == "sdpa"
    assert next(fresh.parameters()).dtype == torch.float32


def test_logits_only_and_refusals():
    model = _model("llava_onevision")
    report = vbhf.check_packing(model, _items(model, 2), gradients=False)
    assert report.ok and all(d.grad_diff is None for d in report.documents)
    with pytest.raises(ValueError, match="at least one"):
        vbhf.check_packing(model, [])
    text = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="'llama'"):
        vbhf.check_packing(text, [{"input_ids": torch.tensor([[1, 2, 3]])}])


def test_command_line_on_a_saved_checkpoint_and_items(tmp_path, capsys):
    model = _model("qwen3_vl")
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(_items(model, 3), tmp_path / "items.pt")
    rc = hf_check.main([str(tmp_path / "ckpt"), str(tmp_path / "items.pt"), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["ok"] and report["family"] == "qwen3_vl"
    assert len(report["documents"]) == 3
    rc = hf_check.main(["--tiny", "idefics3", "--n", "2", "--no-gradients"])
    out = capsys.readouterr().out
    assert rc == 0 and "packing is exact for this model" in out


def test_qwen3_5_linear_layers_leak_when_run_over_the_whole_row(monkeypatch):
    """Without the per-document run, Qwen3.5's Gated DeltaNet carries its convolution and state
    from one document into the next (the packed keys dropped, one call on the whole row): the
    check catches it on every document after the first."""
    import lightning_vlmbalance.hf.inputs as hf_inputs

    def whole_row(module):
        original = module.forward

        def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
            for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                kwargs.pop(key, None)
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

        module.forward = forward

    monkeypatch.setattr(hf_inputs, "per_document", whole_row)
    model = _model("qwen3_5")
    report = vbhf.check_packing(model, _items(model), gradients=False)
    first, *rest = report.documents
    assert first.ok and all(d.logit_diff > 1e-4 for d in rest), str(report)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_items_without_their_marking_are_checked_as_the_processor_marks_them(family):
    """A pipeline that dropped Gemma's (mm_)token_type_ids: the pack attends within each image
    as the processor marks it, and the reference alone gets the same marking (no false alarm)."""
    model = _model(family)
    items = [{k: v for k, v in it.items() if "token_type_ids" not in k} for it in _items(model)]
    assert vbhf.check_packing(model, items, gradients=False).ok
