"""torch.compile of the example VLM over real packs: no graph break, at most 2 compilations, the
same loss and gradients as eager (CPU, float32, a counting backend that also runs backward)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table

SEQ_LEN, PATCH_DIM, VOCAB = 512, 32, 256
PACKS = 110
SEED = 1  # its packs: first without images, then with, and later without again


@pytest.fixture
def dynamo(one_thread):
    """A fresh dynamo cache and counters, one thread; reset again after the test."""
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _packs(n: int) -> list[dict]:
    """The first ``n`` packs of rank 0, built as ``examples/train.py`` builds them."""
    table = synthetic_length_table(
        4000, text_share=0.2, tile_tokens=16, max_text_tokens=SEQ_LEN // 2, seed=SEED
    )
    dataset = SyntheticVLMDataset(table, vocab_size=VOCAB, patch_dim=PATCH_DIM, seed=SEED)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=SEQ_LEN, seed=SEED)
    collate = vb.PackCollator(SEQ_LEN, image_feature_shape=(PATCH_DIM,))
    return list(itertools.islice(vb.PackedDataLoader(dataset, sampler, collate), n))


def _loss_and_grads(model: torch.nn.Module, fn, batch: dict) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss = vb.packed_cross_entropy(fn(batch), batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_vlm_has_no_graph_break_and_compiles_at_most_twice(dynamo) -> None:
    """Compiled with ``fullgraph=True`` and trained over 110 distinct packs (documents, images
    and image tokens vary, some packs hold no image) the example VLM compiles at most twice and
    computes the loss and gradients of eager."""
    torch.manual_seed(0)
    model = ToyVLM(
        max_positions=SEQ_LEN, patch_dim=PATCH_DIM, vocab_size=VOCAB, dim=32, heads=2, lr=1e-3
    )
    optimizer = model.configure_optimizers()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    packs = _packs(PACKS)
    assert len({b["meta"]["pack_id"] for b in packs}) == PACKS
    assert len({(b["cu_seqlens"].numel(), b["pixel_values"].shape[0]) for b in packs}) > 20
    has_image = [b["meta"]["images"] > 0 for b in packs]
    first_image = has_image.index(True)
    # a pack without images after the dynamic graph: the size dynamo specialises (0 image rows)
    late = [i for i in range(first_image + 1, PACKS) if not has_image[i]]
    if not late:  # the sampler put every text-only pack first: repeat one at the end
        packs.append(packs[has_image.index(False)])
        late = [PACKS]
    checked = {0, first_image, late[0], PACKS - 1}

    for i, batch in enumerate(packs):
        batch = model.on_after_batch_transfer(batch, 0)  # what the Trainer calls
        if i in checked:  # eager first: the compiled step's gradients are the ones applied
            eager_loss, eager_grads = _loss_and_grads(model, model, batch)
        loss, grads = _loss_and_grads(model, compiled, batch)
        if i in checked:
            torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
            for got, want in zip(grads, eager_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(loss)
        optimizer.step()

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count <= 2, backend.frame_count


def test_compiled_hf_language_model_compiles_at_most_twice(dynamo) -> None:
    """The decoder of a Hugging Face VLM (tiny Qwen2-VL, ``attn_implementation="vlmbalance"``)
    compiled with ``fullgraph=True``: no graph break and at most 2 compilations over 30 packs,
    the loss and gradients of eager. Transformers' vision tower is not compiled (its own code
    reads image sizes on the host: see docs/packed_attention.md)."""
    tf = pytest.importorskip("transformers")
    import lightning_vlmbalance.hf as vbhf
    from lightning_vlmbalance.hf.synthetic import SyntheticProcessed, tiny_config

    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(tiny_config("qwen2_vl"))
    model.set_attn_implementation({"text_config": "vlmbalance"})
    reference = copy.deepcopy(model)  # runs eagerly
    dataset = SyntheticProcessed(model.config, 200, seed=0, text_share=0.4)
    lengths = vbhf.item_lengths(dataset, model.config)
    sampler = vb.PackingSampler(lengths.total_tokens, lengths.image_tokens, seq_len=256, seed=0)
    collate = vbhf.HFPackCollator(model.config, 256)
    packs = list(itertools.islice(vb.PackedDataLoader(dataset, sampler, collate), 30))
    assert len({tuple(b["cu_seqlens"].tolist()) for b in packs}) > 20  # document boundaries
    assert len({b["cu_seqlens"].numel() for b in packs}) > 1  # and document counts
    assert {b["meta"]["images"] > 0 for b in packs} == {True, False}  # with and without images

    backend = CompileCounterWithBackend("aot_eager")
    # before the first model_inputs: the package's pre-hook on the decoder (a zero term over the
    # vision tower for text-only packs) then sits on the compiled wrapper and runs eagerly
    model.model.language_model = torch.compile(
        model.model.language_model, backend=backend, fullgraph=True
    )

    def step(m: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list]:
        m.zero_grad(set_to_none=True)
        loss = m(**vbhf.model_inputs(m, batch)).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    for i, batch in enumerate(packs):
        loss, grads = step(model, batch)
        if i in (0, 7, 29) or not batch["meta"]["images"]:
            eager_loss, eager_grads = step(reference, batch)
            torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
            assert len(grads) == len(eager_grads)
            for got, want in zip(grads, eager_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count <= 2, backend.frame_count
