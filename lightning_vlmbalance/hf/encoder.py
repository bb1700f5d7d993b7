"""Encoder balancing for Hugging Face VLMs: the model's forward on a batch from
:func:`~lightning_vlmbalance.hf.model_inputs` encodes the images planned for this rank (in a
forward pre-hook, so FSDP2 has gathered the root unit's parameters) and hands itself the pack's
own image embeddings as precomputed encoder outputs (``mm_encoder_outputs``, which every
supported family's forward accepts in place of ``pixel_values``).

With ``RebalanceConfig(encoder=True)`` each packed batch carries an ``encoder_route`` and the
images received to encode (``encoder_fields``: every per-image field of the family, moved with
its image by the :class:`~lightning_vlmbalance.RebalancingLoader`). Here:

1. the local set is this pack's kept images (their rows of every image field) followed by the
   received ones;
2. the family's own ``get_image_features`` runs on it once (:meth:`Family.encode`): Qwen-VL's
   per-image grids and window attention, Qwen3-VL's deepstack features, LLaVA-OneVision's
   any-resolution tiles, Idefics3's tiles (the tile is the unit);
3. the rows of the received images go back to their owners in one ``all_to_all`` with autograd
   (:func:`~lightning_vlmbalance.balance.encoder.return_home`), the deepstack features in the
   same message (concatenated along the feature dimension).

A rank that encodes nothing runs the vision tower on the family's dummy image (the same one a
text-only pack uses), so its vision parameters, and FSDP's gathers of them, take part in every
micro-batch. The zero terms that keep them in the graph, and that make every rank enter the
backward of the return, are added to the language model's input embeddings by the hook of
:func:`~lightning_vlmbalance.hf.prepare_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.utils import ModelOutput

from lightning_vlmbalance.balance.encoder import (
    ImageRoute,
    check_rows,
    check_unchanged,
    return_home,
)
from lightning_vlmbalance.hf.families import Family
from lightning_vlmbalance.loaders.rebalancing import image_payload_fields
from lightning_vlmbalance.packing.collate import cat_padded

__all__ = ["EncodedImages", "balanced_image_features"]


@dataclass
class EncodedImages(ModelOutput):
    """``mm_encoder_outputs["image"]`` of one packed batch, in the layout the model's forward
    reads: ``pooler_output`` (the pack's image embeddings, as one chunk) and, for Qwen3-VL,
    ``deepstack_features`` (one chunk per deepstack layer). ``zero`` is a scalar zero that
    depends on the return (and, on a rank that encoded nothing, on the dummy image)."""

    pooler_output: tuple[torch.Tensor, ...] | torch.Tensor | None = None
    deepstack_features: list[tuple[torch.Tensor, ...]] | None = None
    zero: torch.Tensor | None = None


def balanced_image_features(model: Any, family: Family, batch: Mapping[str, Any]) -> EncodedImages:
    """The pack's image embeddings with its images encoded where ``batch["encoder_route"]``
    planned them (see the module docstring).

    Raises:
        ValueError: if the model's outputs do not have one row per image token of the images
            encoded here (naming the model and both counts); for LLaVA-OneVision packs with a
            multi-image sample.
    """
    route: ImageRoute = batch["encoder_route"]
    _check_single_images(family, batch)
    own = image_payload_fields(dict(batch))
    for name, (tensor, _) in own.items():
        check_unchanged(route, name, tensor)
    received = batch.get("encoder_fields") or {}
    local: dict[str, torch.Tensor] = {}
    for name in own.keys() | received.keys():
        parts = []
        if name in own:
            tensor, starts = own[name]
            kept = route.kept_rows(np.diff(starts))
            parts.append(tensor.index_select(0, torch.from_numpy(kept).to(tensor.device)))
        if name in received:
            parts.append(received[name])
        local[name] = cat_padded(parts, name)
    encoded_here = len(route.keep) + route.received_images
    zero: torch.Tensor | None = None
    if encoded_here:
        features = family.encode(model, local)
    else:  # nothing to encode here: the dummy image keeps the tower in this rank's graph
        dummy = family.encode(model, _dummy_fields(family, model))
        zero = sum(f.float().sum() for f in dummy) * 0.0
        features = [f[:0] for f in dummy]
    widths = [int(f.shape[-1]) for f in features]
    rows = torch.cat(features, dim=-1)
    check_rows(model, rows, sum(route.local_sizes), encoded_here, unit="images")
    home = return_home(route, rows)
    zero = home.float().sum() * 0.0 + (0.0 if zero is None else zero)
    chunks = torch.split(home, widths, dim=-1)
    deepstack = [(c,) for c in chunks[1:]] if len(chunks) > 1 else None
    # Gemma's forward reads one tensor; the others concatenate a tuple of per-image chunks
    pooled = chunks[0] if family.layout == "whole" else (chunks[0],)
    return EncodedImages(pooler_output=pooled, deepstack_features=deepstack, zero=zero)


def _dummy_fields(family: Family, model: Any) -> dict[str, torch.Tensor]:
    """The family's dummy image as image fields (what :meth:`Family.encode` takes)."""
    kwargs = family.dummy_image_inputs(model)
    if family.layout == "tiles":  # (1, tiles, ...) -> (tiles, ...)
        return {k: v[0] for k, v in kwargs.items()}
    if family.layout == "patches":  # the fields keep Gemma 4's positions shifted by one
        return {**kwargs, "image_position_ids": kwargs["image_position_ids"] + 1}
    return {k: v for k, v in kwargs.items() if k != "batch_num_images"}


def _check_single_images(family: Family, batch: Mapping[str, Any]) -> None:
    if family.layout != "anyres":
        return
    num = (batch.get("sample_fields") or {}).get("batch_num_images")
    if num is not None and bool((num > 1).any()):
        raise ValueError(
            f"encoder balancing of {family.name}: pack {batch['meta'].get('pack_id')} has a"
            f" sample with {int(num.max())} images; the model encodes the images of a"
            " multi-image sample without any-resolution tiles, which encoder balancing does not"
            " reproduce yet: turn `encoder` off for this data"
        )
