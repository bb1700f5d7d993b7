"""Processor outputs in, packed batches through the package, model keyword arguments out."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_vlmbalance.hf.attention import ATTN_IMPLEMENTATION
from lightning_vlmbalance.hf.encoder import balanced_image_features
from lightning_vlmbalance.hf.families import Family, family_of
from lightning_vlmbalance.hf.recurrent import is_linear_attention, per_document
from lightning_vlmbalance.loss import check_weighted_for
from lightning_vlmbalance.packing.collate import PackCollator, PackItem

__all__ = ["HFPackCollator", "ItemLengths", "item_lengths", "model_inputs", "prepare_model"]

log = logging.getLogger(__name__)

# attention implementations that read the pack's boundaries from cu_seq_lens_q / max_length_q
_VARLEN = (ATTN_IMPLEMENTATION, "flash_attention_2", "flash_attention_3", "flash_attention_4")


class HFPackCollator(PackCollator):
    """Packs Hugging Face processor outputs into the package's packed batch.

    A dataset item is what the model's processor returns for one sample: ``input_ids``, optional
    ``labels``, and the family's image fields (``pixel_values`` with ``image_grid_thw``,
    ``image_sizes`` or ``pixel_attention_mask``), with or without the processor's leading batch
    dimension of 1. The batch is a ``PackedBatch`` (:mod:`lightning_vlmbalance.packing.collate`)
    whose ``image_fields`` carry the family's image tensors, ``token_fields`` the multimodal
    rotary positions of the Qwen-VL families (per document, from the model's own
    ``get_rope_index``), and ``sample_fields`` per-sample fields such as ``batch_num_images``.
    Labels default to ``input_ids`` with image tokens and each document's first token masked.

    Args:
        model_or_config: the transformers model or its config (an unsupported family is refused).
        seq_len: tokens per pack.
        pad_token_id: defaults to the text config's ``pad_token_id`` (else 0).
        truncate_text: cut text-only samples longer than ``seq_len`` (see ``PackCollator``).

    Example::

        collate = HFPackCollator(model.config, seq_len=4096)
        loader = vb.PackedDataLoader(dataset, sampler, collate, trainer=self.trainer)
    """

    def __init__(
        self,
        model_or_config: Any,
        seq_len: int,
        *,
        pad_token_id: int | None = None,
        truncate_text: bool = False,
    ) -> None:
        self.family: Family = family_of(model_or_config)
        super().__init__(
            seq_len,
            pad_token_id=self.family.pad_token_id if pad_token_id is None else pad_token_id,
            image_feature_shape=(),
            truncate_text=truncate_text,
        )

    def sample_lengths(self, sample: Any, sid: int) -> tuple[int, int]:
        """``(total_tokens, image_tokens)`` of one processor output (see ``PackCollator``)."""
        return self.family.lengths(sample, sid)

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        converted: list[Any] = []
        for pos, it in enumerate(items):
            if isinstance(it, PackItem):
                sample = None if it.sample is None else self.family.to_sample(it.sample, it.index)
                converted.append(it._replace(sample=sample))
            else:
                converted.append(self.family.to_sample(it, pos))
        batch = super().__call__(converted)
        # the whole-image families have no per-token pixel rows: the images are in image_fields
        for key in ("pixel_values", "image_cu_seqlens", "image_max_seqlen"):
            batch.pop(key, None)
        batch["image_field_rows"] = self.family.field_rows(batch["image_fields"])
        if self.family.layout == "mrope" and "mrope_position_ids" not in batch["token_fields"]:
            # a padding pack: text positions on all three rows
            batch["token_fields"]["mrope_position_ids"] = (
                batch["position_ids"].expand(3, -1).clone()
            )
        return batch


class ItemLengths(NamedTuple):
    """Per-item lengths for :class:`~lightning_vlmbalance.PackingSampler` (numpy ``int64``)."""

    total_tokens: np.ndarray
    image_tokens: np.ndarray
    images: np.ndarray


def item_lengths(items: Iterable[Any], model_or_config: Any) -> ItemLengths:
    """``(total_tokens, image_tokens, images)`` of every processor output in ``items`` (a
    dataset or any iterable), counted the way :class:`HFPackCollator` will pack them.

    Example::

        lengths = item_lengths(dataset, model.config)
        sampler = vb.PackingSampler(lengths.total_tokens, lengths.image_tokens, seq_len=4096)
    """
    family = family_of(model_or_config)
    total, image, images = [], [], []
    for sid, item in enumerate(items):
        sample = family.to_sample(item, sid, positions=False)
        sizes = sample.get("image_sizes", [])
        total.append(int(sample["input_ids"].numel()))
        image.append(int(sum(sizes)))
        images.append(len(sizes))
    return ItemLengths(*(np.asarray(x, dtype=np.int64) for x in (total, image, images)))


def prepare_model(model: torch.nn.Module) -> Family:
    """Readies a transformers VLM for packed batches (idempotent; :func:`model_inputs` calls it).

    * The language model's attention reads the pack's boundaries: if its
      ``attn_implementation`` is neither ``"vlmbalance"`` nor a flash-attention varlen one, it is
      switched to ``"vlmbalance"`` (the vision tower keeps its own).
    * The vision tower runs in every micro-batch: in a pack without images it encodes one small
      constant image whose output enters the language model's input embeddings multiplied by
      zero, so every rank's backward reaches the vision parameters and DDP (or FSDP's
      reduce-scatter) never waits for a rank that skipped them. A zero term on every vision and
      projector parameter also covers parameters the model's forward never uses (LLaVA-OneVision
      reads SigLIP's hidden states before its last norm and head), which DDP would refuse.

    A ``copy.deepcopy`` of a prepared model (an EMA or reference copy, ``check_packing``'s
    float64 copy) carries hooks that read the original's parameters and state: the first call
    on the copy removes them and prepares the copy itself.

    Raises:
        ValueError: for a model family that is not supported, naming it.
    """
    model = hf_model(model)
    family = family_of(model)
    if getattr(model, "_vlmbalance_family", None) is not None:
        owner = getattr(model, "_vlmbalance_owner", None)
        if owner is not None and owner() is model:
            return model._vlmbalance_family
        _remove_hooks(model)  # a copy of a prepared model: its hooks serve the original
    text_cfg = getattr(model.config, "text_config", model.config)
    if text_cfg._attn_implementation not in _VARLEN:
        log.info(
            "lightning_vlmbalance.hf: the language model's attention %r does not see pack"
            " boundaries; switching it to %r",
            text_cfg._attn_implementation,
            ATTN_IMPLEMENTATION,
        )
        model.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
    decoder = model.get_decoder()
    per_doc = [m for m in decoder.modules() if is_linear_attention(m)]
    for module in per_doc:  # Qwen3.5: a zero state and convolution per document
        per_document(module)
    state: dict[str, Any] = {
        "text_only": False,
        "balanced_zero": None,
        "per_document": bool(per_doc),
    }
    # parameters of the vision tower and projector: some are never used by some models' forward
    # (LLaVA-OneVision reads SigLIP's hidden states before its last norm and head), which DDP
    # refuses; a zero term on them keeps every one in every micro-batch's graph
    multimodal = [
        p
        for child in model.model.children()
        if child is not decoder
        for p in child.parameters()
        if p.requires_grad
    ]

    def note_images(module: Any, args: tuple, kwargs: dict) -> Any:
        pending = state.pop("encoder_batch", None)
        if pending is not None:
            if kwargs.get("input_ids") is not pending["input_ids"]:
                raise RuntimeError(
                    f"encoder balancing: `model_inputs` prepared the images of pack"
                    f" {_pack_id(pending)} for the next forward of {type(model).__name__}, but"
                    " that forward got other `input_ids`: call the model with the inputs"
                    " `model_inputs` returned, once per batch"
                )
            # encoder balancing: the images are encoded here, inside the multimodal model's
            # forward (under FSDP2 the root unit's parameters, the vision tower's patch
            # embedding among them, are gathered by then), and handed to it as precomputed
            # encoder outputs
            encoded = balanced_image_features(model, family, pending)
            kwargs = {**kwargs, "mm_encoder_outputs": {"image": encoded}}
        encoded = (kwargs.get("mm_encoder_outputs") or {}).get("image")
        # encoder balancing's outputs carry their own zero (the return, and the dummy image
        # on a rank that encoded nothing)
        state["balanced_zero"] = getattr(encoded, "zero", None)
        state["text_only"] = kwargs.get("pixel_values") is None and encoded is None
        return args, kwargs

    def keep_vision_in_graph(module: Any, args: tuple, kwargs: dict) -> Any:
        if "encoder_batch" in state:  # the multimodal model's forward was skipped
            pending = state.pop("encoder_batch")
            raise RuntimeError(
                f"encoder balancing: the language model of {type(model).__name__} ran, but the"
                f" multimodal model's forward ({type(model.model).__name__}) was not called"
                f" through its module call, so pack {_pack_id(pending)}'s images were never"
                " encoded and its image tokens would train as text. Call the model (or a"
                " wrapper that calls its modules) with the inputs of `model_inputs`"
            )
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or not (torch.is_grad_enabled() and model.training):
            return None
        zero = _unused_zero(multimodal)
        if state["text_only"]:
            zero = zero + _vision_zero(model, family)
        if state["balanced_zero"] is not None:
            zero = zero + state["balanced_zero"].to(zero.device)
        return args, {**kwargs, "inputs_embeds": embeds + zero.to(embeds.dtype)}

    # on the multimodal model (``model.model``), which the task head calls as a module: a
    # wrapper that calls the head's ``.forward`` directly (PEFT's tuners do) still reaches it
    note_images._vlmbalance_hook = True  # type: ignore[attr-defined]
    keep_vision_in_graph._vlmbalance_hook = True  # type: ignore[attr-defined]
    model.model.register_forward_pre_hook(note_images, with_kwargs=True)
    decoder.register_forward_pre_hook(keep_vision_in_graph, with_kwargs=True)
    model._vlmbalance_family = family
    model._vlmbalance_state = state
    # a weak reference deep-copies as itself: a copy's owner is the original (see above)
    model._vlmbalance_owner = weakref.ref(model)
    return family


def _remove_hooks(model: Any) -> None:
    """Drops :func:`prepare_model`'s hooks from ``model`` (those a deep copy carried over)."""
    for module in (model.model, model.get_decoder()):
        for key, hook in list(module._forward_pre_hooks.items()):
            if getattr(hook, "_vlmbalance_hook", False):
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)


def hf_model(model: Any) -> Any:
    """The transformers model inside ``model``: unwraps a PEFT model (``get_base_model``), a
    compiled model (``_orig_mod``) and any module that holds the model as ``module`` or
    ``model``, until a transformers ``PreTrainedModel`` (or nothing more to unwrap)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        base = getattr(model, "get_base_model", None)
        if callable(base):
            inner = base()
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            inner = model._orig_mod
        else:
            inner = getattr(model, "module", None) or getattr(model, "model", None)
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner
    return model


def _doc_bounds(batch: Mapping[str, Any]) -> list[int]:
    """``cu_seqlens`` as host ints, from the pack's ``meta`` (no device read): its documents,
    then the padding tail as a segment of its own, as the collator lays them out."""
    meta = batch.get("meta") or {}
    if "doc_lens" not in meta:  # a batch of other making: ask the tensor
        return batch["cu_seqlens"].tolist()
    bounds = [0, *itertools.accumulate(int(n) for n in meta["doc_lens"])]
    total = int(batch["input_ids"].shape[-1])
    return [*bounds, total] if bounds[-1] < total else bounds


def _pack_id(batch: Mapping[str, Any]) -> Any:
    return (batch.get("meta") or {}).get("pack_id")


def _unused_zero(params: list[torch.Tensor]) -> torch.Tensor:
    """``0 * sum(p)`` over plain tensors (FSDP's sharded DTensors are reduced by FSDP itself)."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros(())
    for p in params:
        if not isinstance(p, DTensor):
            total = total.to(p.device) + p.sum().float()
    return total * 0.0


def _vision_zero(model: Any, family: Family) -> torch.Tensor:
    """A scalar zero that depends on every output of the vision tower for a dummy image."""
    out = model.model.get_image_features(**family.dummy_image_inputs(model))
    total = None
    for t in _tensors(out):
        s = t.float().sum()
        total = s if total is None else total + s
    return total * 0.0


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput
        yield from _tensors(obj.to_tuple())


def model_inputs(
    model: torch.nn.Module, batch: Mapping[str, Any], *, module: Any = None, labels: bool = True
) -> dict[str, Any]:
    """The keyword arguments for ``model(**inputs)`` of one packed batch.

    * ``input_ids`` ``(1, T)``; per-document ``position_ids`` (M-RoPE rows for the Qwen-VL
      families); ``use_cache=False``; no ``attention_mask``.
    * The pack's boundaries under transformers' varlen names (``cu_seq_lens_q`` / ``_k``,
      ``max_length_q`` / ``_k``), read by ``attn_implementation="vlmbalance"``.
    * The images in the family's layout. With encoder balancing on (the batch has an
      ``encoder_route``) there are none: the model's next forward on these ``input_ids``
      encodes the images where the route planned them and hands the pack's embeddings to
      itself as ``mm_encoder_outputs`` (see :mod:`lightning_vlmbalance.hf.encoder`).
    * With ``labels=True``: ``labels`` and ``num_items_in_batch = 1 / loss_weight``, so the
      model's own loss (``out.loss``) is the pack's summed token loss times ``loss_weight``: the
      loss contract of :mod:`lightning_vlmbalance.loss` (the step's token-mean gradient).

    ``module`` (the ``LightningModule``) checks the batch's weight against its Trainer, as
    :func:`~lightning_vlmbalance.packed_cross_entropy` does.
    """
    family = prepare_model(model)
    model = hf_model(model)
    if module is not None:
        check_weighted_for(batch, module)
    cu = batch["cu_seqlens"]
    max_len = int(batch["max_seqlen"])
    inputs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": family.position_ids(batch),
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
        **family.attention_inputs(batch),
    }
    if model._vlmbalance_state["per_document"]:  # the boundaries as host ints, read once
        inputs["vlmbalance_doc_bounds"] = _doc_bounds(batch)
    if batch.get("encoder_route") is not None:
        # encoded in the multimodal model's forward (its pre-hook): see prepare_model
        state = model._vlmbalance_state
        if "encoder_batch" in state:
            waiting = state.pop("encoder_batch")
            raise RuntimeError(
                f"encoder balancing: `model_inputs` was called for pack {_pack_id(batch)}"
                f" while the images of pack {_pack_id(waiting)} still wait for"
                f" the forward of {type(model).__name__}: call the model with each batch's"
                " inputs before preparing the next"
            )
        state["encoder_batch"] = batch
    else:
        inputs.update(family.image_inputs(batch))
    if labels:
        weight = float(batch.get("loss_weight") or 0.0)
        inputs["labels"] = batch["labels"]
        inputs["num_items_in_batch"] = 1.0 / weight if weight > 0 else float("inf")
    return inputs
