"""lightning_vlmbalance.hf on the tiny random-init families: packed forward equals each document
alone, the padding tail, the loss contract, the vision tower kept in a text-only graph, and the
errors for input the collator cannot pack (CPU, float32)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf

import lightning_vlmbalance as vb
import lightning_vlmbalance.hf as vbhf
from lightning_vlmbalance.balance.exchange import decode_pack, encode_pack
from lightning_vlmbalance.hf.recurrent import is_linear_attention, per_document
from lightning_vlmbalance.hf.synthetic import (
    IMAGE_TOKEN,
    TINY_FAMILIES,
    SyntheticProcessed,
    tiny_config,
)
from lightning_vlmbalance.packing.collate import PackItem

# seed 1: items 0, 1, 2 have images, 3 is text-only, in every family (asserted where used)
SEED = 1
MIXED = (0, 3, 1, 2)  # a text-only document between image documents
PAD = 7  # padding tokens after the documents


@functools.cache
def _reference(family: str) -> torch.nn.Module:
    """The family's tiny model with transformers' default attention (sdpa), eval mode. Never
    modified: tests work on deep copies."""
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(tiny_config(family)).eval()
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    return model


def _packed_copy(family: str) -> torch.nn.Module:
    model = copy.deepcopy(_reference(family))
    model.set_attn_implementation({"text_config": "vlmbalance"})
    return model


def _dataset(family: str, n: int = 8, text_share: float = 0.3) -> SyntheticProcessed:
    return SyntheticProcessed(_reference(family).config, n, seed=SEED, text_share=text_share)


def _length(item: Mapping) -> int:
    return int(item["input_ids"].shape[-1])


def _has_image(item: Mapping) -> bool:
    return item.get("pixel_values") is not None


def _pack(family: str, items: list, pad: int = PAD) -> dict:
    collate = vbhf.HFPackCollator(_reference(family).config, seq_len=sum(map(_length, items)) + pad)
    return collate(items)


def _images(item: Mapping) -> int:
    """Images of one processor output, counted from its own fields (Idefics3: its tiles)."""
    if not _has_image(item):
        return 0
    if "image_grid_thw" in item:
        return int(item["image_grid_thw"].shape[0])
    if "image_sizes" in item:
        return int(item["image_sizes"].shape[0])
    pix = item["pixel_values"]
    # Gemma 3 (images, C, H, W), Gemma 4 (images, patches, dim); tiles (1, tiles, C, H, W)
    return int(pix.shape[0] if pix.dim() in (3, 4) else pix.shape[1])


def _doc_logits(logits: torch.Tensor, batch: dict) -> list[torch.Tensor]:
    cu = batch["cu_seqlens"].tolist()
    return [logits[0, cu[i] : cu[i + 1]] for i in range(len(batch["meta"]["doc_lens"]))]


# -- 1. every document of a packed row sees only itself -------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_packed_forward_equals_each_document_alone(family):
    ref, model = _reference(family), _packed_copy(family)
    ds = _dataset(family)
    items = [ds[i] for i in MIXED]
    has_image = [_has_image(it) for it in items]
    assert len(items) >= 3 and any(has_image) and not all(has_image), has_image
    batch = _pack(family, items)

    lens = [_length(it) for it in items]
    T = batch["input_ids"].shape[1]
    assert batch["meta"]["doc_lens"] == lens
    assert T == sum(lens) + PAD
    # the padding tail is its own segment of the pack
    assert batch["cu_seqlens"].tolist()[-2:] == [sum(lens), T]
    assert (batch["input_ids"][0, sum(lens) :] == ref.config.get_text_config().pad_token_id).all()

    inputs = vbhf.model_inputs(model, batch, labels=False)
    assert "labels" not in inputs and inputs["use_cache"] is False
    with torch.no_grad():
        packed = model(**inputs).logits
        assert packed.shape[:2] == (1, T)
        assert torch.isfinite(packed).all()
        for i, (item, got) in enumerate(zip(items, _doc_logits(packed, batch))):
            alone = ref(**item).logits[0]
            diff = (alone - got).abs().max().item()
            assert diff <= 1e-5, f"{family} document {i} (images: {has_image[i]}): {diff}"


# -- 2. the trap: sdpa with 1-D positions and the default cache leaks across documents ------------


@pytest.mark.parametrize("text_only", [False, True], ids=["mixed", "text"])
def test_unpatched_sdpa_leaks_across_documents(text_only):
    family = "qwen2_5_vl"
    ref = _reference(family)
    if text_only:
        ds = _dataset(family, n=3, text_share=1.0)
        items = [ds[i] for i in range(3)]
        assert not any(map(_has_image, items))
    else:
        ds = _dataset(family)
        items = [ds[i] for i in (3, 0, 1)]
        assert [_has_image(it) for it in items] == [False, True, True]
    batch = _pack(family, items)
    family_ = vbhf.family_of(ref)
    with torch.no_grad():
        # what a naive loop passes: the pack's 1-D per-document positions, no attention mask,
        # use_cache left at its default; sdpa then attends causally over the whole row
        leaky = ref(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            **family_.image_inputs(batch),
        ).logits
        docs = _doc_logits(leaky, batch)
        diffs = [(ref(**it).logits[0] - got).abs().max().item() for it, got in zip(items, docs)]
    # the first document has nothing before it; the later ones attend to it
    assert diffs[0] <= 1e-5, diffs
    assert max(diffs[1:]) > 1e-2, diffs


# -- 3. item_lengths matches what the collator packs ----------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_item_lengths_match_the_collated_meta(family):
    cfg = _reference(family).config
    ds = _dataset(family)
    lengths = vbhf.item_lengths(ds, cfg)
    assert all(x.dtype == np.int64 and x.shape == (len(ds),) for x in lengths)
    assert (lengths.images > 0).any() and (lengths.images == 0).any()
    seq_len = int(lengths.total_tokens.max()) + 16
    collate = vbhf.HFPackCollator(cfg, seq_len=seq_len)
    for i in range(len(ds)):
        meta = collate([ds[i]])["meta"]
        got = (meta["total_tokens"], meta["image_tokens"], meta["images"])
        want = tuple(int(x[i]) for x in lengths)
        assert got == want, f"{family} item {i}"
        assert lengths.total_tokens[i] == _length(ds[i])
        assert lengths.image_tokens[i] == int((ds[i]["input_ids"] == IMAGE_TOKEN).sum())
        assert lengths.images[i] == _images(ds[i])
    # a whole pack counts the sum of its items
    meta = vbhf.HFPackCollator(cfg, seq_len=int(lengths.total_tokens.sum()))(list(ds))["meta"]
    assert meta["total_tokens"] == lengths.total_tokens.sum()
    assert meta["image_tokens"] == lengths.image_tokens.sum()
    assert meta["images"] == lengths.images.sum()

    sampler = vb.PackingSampler(
        lengths.total_tokens, lengths.image_tokens, seq_len=seq_len, num_replicas=1, rank=0
    )
    packs = [list(p) for p in sampler]
    assert sorted(i for p in packs for i in p) == list(range(len(ds)))
    for p in packs:
        assert lengths.total_tokens[p].sum() <= seq_len


# -- 4. input that cannot be packed is refused, naming the sample ---------------------------------


@pytest.mark.parametrize(
    "config",
    [
        tf.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        tf.LlavaNextConfig(),
    ],
    ids=["llama", "llava_next"],
)
def test_unsupported_family_is_refused_by_name(config):
    name = config.model_type
    with pytest.raises(ValueError, match=f"model_type '{name}'"):
        vbhf.HFPackCollator(config, seq_len=64)
    with pytest.raises(ValueError, match=f"model_type '{name}'"):
        vbhf.item_lengths([], config)
    with pytest.raises(ValueError, match=f"model_type '{name}'"):
        vbhf.family_of(config)


def test_unsupported_model_is_refused_by_prepare_model():
    cfg = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = tf.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        vbhf.prepare_model(model)
    assert model.config._attn_implementation != "vlmbalance"


def _spoil_video(item):
    item["pixel_values_videos"] = torch.zeros(4, 96)


def _spoil_unknown(item):
    item["second_per_grid_ts"] = torch.tensor([1.0])


def _spoil_padding(item):
    item["attention_mask"][0, -1] = 0


def _spoil_grid(item):
    item["image_grid_thw"] = item["image_grid_thw"].clone()
    item["image_grid_thw"][0, 1] += 2


def _spoil_no_pixels(item):
    del item["pixel_values"], item["image_grid_thw"]


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (_spoil_video, r"sample {sid} has \['pixel_values_videos'\]"),
        (_spoil_unknown, r"sample {sid}: .*\['second_per_grid_ts'\]"),
        (_spoil_padding, r"sample {sid} has padding \(attention_mask"),
        (_spoil_grid, r"sample {sid}: image_grid_thw .* patch rows, pixel_values has 64"),
        (_spoil_no_pixels, r"sample {sid} has 16 image tokens .* but no pixel_values"),
    ],
    ids=["video", "unknown_field", "padding", "grid_vs_rows", "tokens_without_pixels"],
)
def test_bad_item_is_refused_naming_the_sample(spoil, match):
    family = "qwen2_5_vl"
    cfg = _reference(family).config
    ds = _dataset(family)
    bad = {k: v.clone() for k, v in ds[1].items()}  # 64 patch rows, 16 image tokens
    assert tuple(bad["pixel_values"].shape) == (64, 96)
    spoil(bad)
    collate = vbhf.HFPackCollator(cfg, seq_len=512)
    # by position in a plain list of items
    with pytest.raises(ValueError, match=match.format(sid=1)):
        collate([ds[0], bad])
    # by dataset index in a pack from PackedDataLoader
    with pytest.raises(ValueError, match=match.format(sid=5)):
        collate([PackItem(0, 2, ds[2]), PackItem(0, 5, bad)])
    # and the length table names it by its index in the dataset
    with pytest.raises(ValueError, match=match.format(sid=3)):
        vbhf.item_lengths([ds[0], ds[2], ds[3], bad], cfg)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision", "idefics3"])
@pytest.mark.parametrize("index", [3, 1], ids=["text", "image"])
def test_processor_batch_of_two_is_refused_naming_the_sample(family, index):
    """A dataset item is one sample: a processor output of two rows is refused, naming the item
    and the field, by the collator and by the length table. It used to be fused into one
    document (row 2's first token trained as predicted from row 1, 280 tokens counted for two
    140-token rows), or to fail inside Qwen's rope index with "unhashable type: 'list'"."""
    cfg = _reference(family).config
    ds = _dataset(family)
    one = ds[index]
    assert _has_image(one) == (index == 1)
    # what the processor returns for the same sample twice: every field holds both
    two = {k: torch.cat([v, v]) for k, v in one.items()}
    shape = rf"\(2, {_length(one)}\)"
    match = r"sample {sid}: input_ids has shape " + shape + ", a batch of 2"
    collate = vbhf.HFPackCollator(cfg, seq_len=1024)
    with pytest.raises(ValueError, match=match.format(sid=1)):
        collate([ds[0], two])
    with pytest.raises(ValueError, match=match.format(sid=6)):
        collate([PackItem(0, 2, ds[2]), PackItem(0, 6, two)])
    with pytest.raises(ValueError, match=match.format(sid=2)):
        vbhf.item_lengths([ds[0], ds[3], two], cfg)
    with pytest.raises(ValueError, match=match.format(sid=4)):
        collate.sample_lengths(two, 4)
    # labels of two rows under input_ids of one are refused by name too
    bad_labels = {**one, "labels": two["input_ids"]}
    with pytest.raises(ValueError, match=r"sample 0: labels has shape " + shape + ", a batch of 2"):
        collate([bad_labels])
    # one row, with or without the processor's batch dimension of 1, is one document
    flat = {"input_ids": one["input_ids"][0]} if index == 3 else one
    for item in (one, flat):
        batch = collate([item, ds[0]])
        assert batch["meta"]["doc_lens"] == [_length(one), _length(ds[0])]


# -- 5. PackItem packs and padding packs -----------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision", "idefics3"])
def test_pack_items_and_padding_pack(family):
    ds = _dataset(family)
    order = [2, 6, 0]
    collate = vbhf.HFPackCollator(_reference(family).config, seq_len=1024)
    batch = collate([PackItem(4, i, ds[i]) for i in order])
    assert batch["meta"]["pack_id"] == 4
    assert batch["meta"]["sample_ids"] == order
    assert batch["meta"]["doc_lens"] == [_length(ds[i]) for i in order]
    assert batch["meta"]["images"] > 0 and not batch["meta"]["padding"]
    assert torch.equal(batch["input_ids"][0, : _length(ds[2])], ds[2]["input_ids"][0])

    pad = collate([PackItem(9, -1, None)])
    meta = pad["meta"]
    assert meta["pack_id"] == 9 and meta["sample_ids"] == [] and meta["padding"]
    assert meta["images"] == 0 and meta["image_tokens"] == 0 and meta["total_tokens"] == 0
    assert pad["image_fields"] == {} and pad["loss_tokens"] == 0
    assert "pixel_values" not in pad
    assert pad["input_ids"].shape == (1, 1024)
    assert (pad["labels"] == vb.IGNORE_INDEX).all()
    inputs = vbhf.model_inputs(_packed_copy(family), pad)
    assert "pixel_values" not in inputs


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision", "idefics3"])
def test_padding_pack_trains_with_zero_loss(family):
    model = _packed_copy(family).train()
    pad = vbhf.HFPackCollator(model.config, seq_len=64)([PackItem(0, -1, None)])
    out = model(**vbhf.model_inputs(model, pad))
    assert torch.isfinite(out.logits).all()
    assert out.loss.item() == 0.0
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith(_VISION_PREFIXES) for n in grads)  # the vision tower is reached
    for name, g in grads.items():
        assert not g.any(), name


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_packed_data_loader_feeds_the_hf_collator(family):
    cfg = _reference(family).config
    ds = _dataset(family)
    lengths = vbhf.item_lengths(ds, cfg)
    seq_len = int(lengths.total_tokens.max()) + 8
    seen, padding = [], 0
    for rank in (0, 1):
        sampler = vb.PackingSampler(
            lengths.total_tokens, lengths.image_tokens, seq_len=seq_len, num_replicas=2, rank=rank
        )
        packs = [list(p) for p in sampler]
        loader = vb.PackedDataLoader(ds, sampler, vbhf.HFPackCollator(cfg, seq_len=seq_len))
        batches = list(loader)
        assert [b["meta"]["sample_ids"] for b in batches] == packs
        for b in batches:
            meta = b["meta"]
            padding += meta["padding"]
            seen += meta["sample_ids"]
            assert meta["total_tokens"] == lengths.total_tokens[meta["sample_ids"]].sum()
            assert meta["image_tokens"] == lengths.image_tokens[meta["sample_ids"]].sum()
    assert sorted(seen) == list(range(len(ds)))


# -- 6. a pack survives the rebalancing exchange's encoding ----------------------------------------


def _assert_same(a, b, where="batch"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), where


@pytest.mark.parametrize("family", ["llava_onevision", "idefics3"])
def test_pack_round_trips_through_the_exchange_encoding(family):
    ds = _dataset(family)
    items = [ds[i] for i in MIXED]
    batch = _pack(family, items)
    pix = batch["image_fields"]["pixel_values"]
    if family == "llava_onevision":
        # whole images, the tiles zero-padded to the pack's largest count
        tiles = [int(it["pixel_values"].shape[1]) for it in items if _has_image(it)]
        assert len(set(tiles)) > 1 and pix.shape[1] == max(tiles)
        assert pix.shape[0] == batch["image_fields"]["image_sizes"].shape[0]
        assert batch["sample_fields"]["batch_num_images"].tolist() == [
            int(it["pixel_values"].shape[0]) if _has_image(it) else 0 for it in items
        ]
    else:
        mask = batch["image_fields"]["pixel_attention_mask"]
        assert mask.dtype == torch.bool and mask.shape[0] == pix.shape[0]
    decoded = decode_pack(*encode_pack(batch))
    _assert_same(batch, decoded)
    # and the decoded pack drives the model alike
    model = _packed_copy(family)
    with torch.no_grad():
        a = model(**vbhf.model_inputs(model, batch)).loss
        b = model(**vbhf.model_inputs(model, decoded)).loss
    assert torch.equal(a, b)


# -- 7. a text-only pack keeps the vision tower in the graph ---------------------------------------

# the vision side of the models: towers and projectors
_VISION_PREFIXES = (
    "model.visual.",
    "model.vision_model.",
    "model.vision_tower.",
    "model.connector.",
    "model.multi_modal_projector.",
)


def _reached(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is not None}


def _vision_tower(model):
    inner = model.model
    for name in ("visual", "vision_model", "vision_tower"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise AssertionError(f"{type(inner).__name__}: no vision tower found")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_text_only_pack_reaches_the_vision_tower(family):
    model = _packed_copy(family).train()
    plain = copy.deepcopy(model)  # never prepared: no hooks
    for module in plain.modules():  # but Qwen3.5's linear attention runs per document
        if is_linear_attention(module):
            per_document(module)
    imaged = copy.deepcopy(model)
    text = _dataset(family, n=3, text_share=1.0)
    items = [text[i] for i in range(3)]
    assert not any(map(_has_image, items))
    batch = _pack(family, items)
    inputs = vbhf.model_inputs(model, batch)
    assert "pixel_values" not in inputs

    out = model(**inputs)
    out.loss.backward()
    ref = plain(**inputs)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)

    vision = {n for n, _ in model.named_parameters() if n.startswith(_VISION_PREFIXES)}
    assert vision and not (_reached(plain) & vision)
    params = dict(model.named_parameters())
    for name in _reached(model) & vision:
        assert not params[name].grad.any(), name
    # the language model's gradients are untouched by the zero term
    for name in _reached(plain):
        torch.testing.assert_close(
            params[name].grad, plain.get_parameter(name).grad, rtol=1e-5, atol=1e-7
        )
    # every parameter an image pack trains gets a (zero) gradient from a text-only pack too
    ds = _dataset(family)
    image_batch = _pack(family, [ds[0], ds[1]])
    imaged(**vbhf.model_inputs(imaged, image_batch)).loss.backward()
    assert _reached(imaged) <= _reached(model), sorted(_reached(imaged) - _reached(model))
    if family != "llava_onevision":  # its SigLIP head and post-norm are unused by the model
        assert all(p.grad is not None for p in _vision_tower(model).parameters())
    # prepare_model is idempotent: a second call adds no second hook
    assert vbhf.prepare_model(model) is vbhf.prepare_model(model)
    assert len(model.model._forward_pre_hooks) == 1  # on the multimodal model


# -- 8. the model's own loss is the loss contract's ------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_model_loss_follows_the_loss_contract(family):
    model = _packed_copy(family)
    ds = _dataset(family)
    batch = _pack(family, [ds[i] for i in MIXED])
    # weighted as for a larger optimizer step: the loss is the summed token loss times the weight
    batch["loss_weight"] = batch["loss_weight"] / 3.0
    inputs = vbhf.model_inputs(model, batch, labels=True)
    assert torch.equal(inputs["labels"], batch["labels"])
    with torch.no_grad():
        out = model(**inputs)
    want = vb.packed_cross_entropy(out.logits, batch)
    assert batch["loss_tokens"] > 0
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen2_5_vl"])
def test_a_deep_copy_of_a_prepared_model_is_its_own_model(family):
    """An EMA / reference copy made with ``copy.deepcopy`` after training began computes with
    its own weights (Qwen3.5's per-document linear-attention layers were bound to the original)
    and gets its own hooks on first use; ``check_packing`` works on the prepared model."""
    model = _packed_copy(family).train()
    ds = _dataset(family)
    batch = _pack(family, [ds[i] for i in MIXED])
    model(**vbhf.model_inputs(model, batch)).loss.backward()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    fresh = _packed_copy(family).train()
    fresh.load_state_dict(twin.state_dict())
    with torch.no_grad():
        got = twin(**vbhf.model_inputs(twin, batch)).logits
        want = fresh(**vbhf.model_inputs(fresh, batch)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert len(twin.model._forward_pre_hooks) == 1  # its own, the original's dropped
    assert vbhf.check_packing(model, [ds[i] for i in MIXED], gradients=False).ok
