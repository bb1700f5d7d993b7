"""What differs between Hugging Face VLM families: the processor's image fields, positions, and the
model's image keyword arguments.

A :class:`Family` turns one processor output (one sample) into the package's generic sample (see
:mod:`lightning_vlmbalance.packing.collate`) and a packed batch back into the model's keyword
arguments. Three layouts are covered:

* **Qwen-VL** (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``): ``pixel_values`` are
  patch rows ``(patches, patch_dim)`` with ``image_grid_thw`` ``(n_images, 3)``; positions are
  3-row multimodal rotary positions (M-RoPE), computed per document by the model class's own
  ``get_rope_index`` in the collator (on the CPU, in the loader's workers).
* **LLaVA-OneVision** (``llava_onevision``): whole images, each as ``(patches, C, H, W)``
  (any-resolution tiles), with ``image_sizes`` ``(n_images, 2)`` and ``batch_num_images`` per
  sample. Tiles are zero-padded to the pack's largest count; the model slices each image's real
  tiles from ``image_sizes``.
* **Idefics3** (``idefics3``): whole images (the processor's tiles)
  ``(n_tiles, C, H, W)`` with ``pixel_attention_mask`` ``(n_tiles, H, W)``; the pack concatenates
  the tiles of all its samples into one row ``(1, tiles, C, H, W)``.

Videos are refused (``pixel_values_videos``): not packed yet. Other families (LLaVA-NeXT, SmolVLM,
...) are refused by name until they are tested here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SUPPORTED_FAMILIES", "Family", "family_of"]

_MROPE_MODELS = {
    "qwen2_vl": "Qwen2VLModel",
    "qwen2_5_vl": "Qwen2_5_VLModel",
    "qwen3_vl": "Qwen3VLModel",
    "qwen3_vl_moe": "Qwen3VLMoeModel",
    "qwen3_5": "Qwen3_5Model",
    "glm4v": "Glm4vModel",
}
_IGNORED = ("attention_mask", "mm_token_type_ids", "token_type_ids")
_UNSUPPORTED = ("pixel_values_videos", "video_grid_thw", "image_sizes_videos")


def _config(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _flat(x: Any, sid: int, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-token processor field of one sample, ``(L,)``, without its leading batch dimension
    of 1; a batch of more rows is refused by name (fused, its rows would be one document)."""
    t = _strip_batch(x, sid, name, 1)
    return t if dtype is None else t.to(dtype)


def _strip_batch(x: Any, sid: int, name: str, rank: int) -> torch.Tensor:
    """Drops the leading batch dimension of 1 of a field whose per-sample rank is ``rank``."""
    t = torch.as_tensor(x)
    if t.dim() == rank + 1:
        if t.shape[0] != 1:
            raise ValueError(
                f"sample {sid}: {name} has shape {tuple(t.shape)}, a batch of {t.shape[0]};"
                " a dataset item is one sample (process samples one at a time)"
            )
        t = t[0]
    if t.dim() != rank:
        raise ValueError(f"sample {sid}: {name} has shape {tuple(t.shape)}, expected rank {rank}")
    return t


def _runs(mask: torch.Tensor) -> list[int]:
    """Lengths of the runs of ``True`` in a 1-D bool tensor."""
    if not bool(mask.any()):
        return []
    padded = torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).to(torch.int8)
    edges = torch.diff(padded)
    starts = torch.nonzero(edges == 1).reshape(-1)
    ends = torch.nonzero(edges == -1).reshape(-1)
    return (ends - starts).tolist()


def _split_evenly(total: int, n: int, runs: list[int]) -> list[int]:
    if len(runs) == n:
        return runs
    if n == 0 or total % n:
        return [total] if total else []
    return [total // n] * n


@dataclass(frozen=True)
class Family:
    """How one family of Hugging Face VLMs lays out its images (see the module docstring)."""

    name: str
    layout: str  # "mrope", "anyres", "tiles"
    config: Any

    @property
    def image_token_id(self) -> int:
        cfg = self.config
        tid = getattr(cfg, "image_token_id", None)
        if tid is None:
            tid = getattr(cfg, "image_token_index", None)
        if tid is None:
            raise ValueError(f"{self.name}: the config names no image token id")
        return int(tid)

    @property
    def pad_token_id(self) -> int:
        text = getattr(self.config, "text_config", self.config)
        pad = getattr(text, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    # -- one processor output -> the generic sample ------------------------------------------

    def lengths(self, item: Any, sid: int) -> tuple[int, int]:
        """``(total_tokens, image_tokens)`` of one processor output, checked."""
        sample = self.to_sample(item, sid, positions=False)
        return int(sample["input_ids"].numel()), int(sum(sample.get("image_sizes", [])))

    def to_sample(self, item: Any, sid: int, *, positions: bool = True) -> dict[str, Any]:
        """The generic sample of one processor output (``input_ids``, ``labels``, image token
        positions and sizes, and the family's fields; ``positions=False`` skips the M-RoPE rows,
        for counting)."""
        if not isinstance(item, Mapping):
            raise ValueError(
                f"sample {sid} is a {type(item).__name__}; a dataset item for HFPackCollator is"
                " what the model's processor returns for one sample (a dict / BatchFeature)"
            )
        if "input_ids" not in item:
            raise ValueError(f"sample {sid} has no 'input_ids' (it has {sorted(item)})")
        bad = [k for k in _UNSUPPORTED if item.get(k) is not None]
        if bad:
            raise ValueError(
                f"sample {sid} has {bad}: videos are not packed by lightning_vlmbalance.hf yet"
            )
        known = {"input_ids", "labels", *_IGNORED, *self._image_keys}
        unknown = sorted(k for k in item if k not in known)
        if unknown:
            raise ValueError(
                f"sample {sid}: {self.name} item has fields {unknown} that HFPackCollator does not"
                f" know how to pack (it packs {sorted(known)}); drop them or file an issue"
            )
        ids = _flat(item["input_ids"], sid, "input_ids", torch.long)
        mask = item.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError(
                f"sample {sid} has padding (attention_mask has zeros): process samples one at a"
                " time, without padding; the packs are the padding"
            )
        self._check_token_types(item, ids, sid)
        sample: dict[str, Any] = {"input_ids": ids}
        if item.get("labels") is not None:
            sample["labels"] = _flat(item["labels"], sid, "labels", torch.long)
        is_image = ids == self.image_token_id
        has_pixels = item.get("pixel_values") is not None
        if bool(is_image.any()) != has_pixels:
            raise ValueError(
                f"sample {sid} has {int(is_image.sum())} image tokens (id {self.image_token_id})"
                f" but {'' if has_pixels else 'no '}pixel_values"
            )
        if has_pixels:
            fields, n_images = self._image_fields(item, sid)
            sample["image_fields"] = fields
            sample["image_positions"] = torch.nonzero(is_image).reshape(-1)
            sample["image_sizes"] = self._tokens_per_image(fields, is_image, n_images, sid)
        if self.layout == "anyres":
            n = len(sample.get("image_sizes", []))
            sample["sample_fields"] = {"batch_num_images": torch.tensor([n])}
        if self.layout == "mrope" and positions:
            sample["token_fields"] = {"mrope_position_ids": self._mrope(item, ids, is_image, sid)}
        return sample

    @property
    def _image_keys(self) -> tuple[str, ...]:
        return {
            "mrope": ("pixel_values", "image_grid_thw"),
            "anyres": ("pixel_values", "image_sizes", "batch_num_images"),
            "tiles": ("pixel_values", "pixel_attention_mask"),
            "whole": ("pixel_values",),
            "sized": ("pixel_values", "image_sizes"),
            "patches": ("pixel_values", "image_position_ids"),
        }[self.layout]

    @property
    def image_blocks(self) -> bool:
        """Whether each image's tokens attend to each other in both directions (Gemma 3, and
        Gemma 4 with ``use_bidirectional_attention="vision"``): the packed attention takes one
        block per run of image tokens (see :func:`image_blocks`)."""
        if self.name == "gemma4":
            return self.config.get_text_config().use_bidirectional_attention == "vision"
        return self.name in _IMAGE_BLOCKS

    @property
    def _token_types(self) -> str:
        return "mm_token_type_ids" if self.name == "gemma4" else "token_type_ids"

    def _check_token_types(self, item: Mapping, ids: torch.Tensor, sid: int) -> None:
        """Gemma's ``token_type_ids`` mark exactly the image tokens (what its processor returns);
        the packed attention derives the image blocks from the image tokens, so any other
        marking would train another attention than the model's own forward: refused."""
        name = self._token_types
        types_ = item.get(name)
        if types_ is None or not self.name.startswith("gemma"):
            return
        types_ = _flat(types_, sid, name, torch.long)
        if not torch.equal(types_ != 0, ids == self.image_token_id):
            raise ValueError(
                f"sample {sid}: {name} mark {int((types_ != 0).sum())} tokens, the image"
                f" tokens (id {self.image_token_id}) are {int((ids == self.image_token_id).sum())};"
                f" {self.name}'s packed attention makes each run of image tokens one"
                " bidirectional block, as its processor marks them"
            )

    def _image_fields(self, item: Mapping, sid: int) -> tuple[dict[str, torch.Tensor], int]:
        if self.layout == "mrope":
            pix = _strip_batch(item["pixel_values"], sid, "pixel_values", 2)
            grid = _strip_batch(item["image_grid_thw"], sid, "image_grid_thw", 2).long()
            rows = int(grid.prod(-1).sum())
            if rows != pix.shape[0]:
                raise ValueError(
                    f"sample {sid}: image_grid_thw {grid.tolist()} describes {rows} patch rows,"
                    f" pixel_values has {pix.shape[0]}"
                )
            return {"pixel_values": pix, "image_grid_thw": grid}, grid.shape[0]
        if self.layout == "anyres":
            pix = torch.as_tensor(item["pixel_values"])
            if pix.dim() == 4:  # one image: (patches, C, H, W)
                pix = pix[None]
            sizes = torch.as_tensor(item["image_sizes"]).reshape(-1, 2).long()
            if pix.dim() != 5 or pix.shape[0] != sizes.shape[0]:
                raise ValueError(
                    f"sample {sid}: pixel_values {tuple(pix.shape)} and image_sizes"
                    f" {tuple(sizes.shape)} do not describe the same images"
                )
            return {"pixel_values": pix, "image_sizes": sizes}, pix.shape[0]
        if self.layout == "sized":  # Pixtral: (images, C, H, W) padded, each image's real size
            pix = torch.as_tensor(item["pixel_values"])
            sizes = torch.as_tensor(item["image_sizes"]).reshape(-1, 2).long()
            if pix.dim() != 4 or pix.shape[0] != sizes.shape[0]:
                raise ValueError(
                    f"sample {sid}: pixel_values {tuple(pix.shape)} and image_sizes"
                    f" {tuple(sizes.shape)} do not describe the same images"
                )
            return {"pixel_values": pix, "image_sizes": sizes}, pix.shape[0]
        if self.layout == "patches":  # Gemma 4: (images, patches, dim), padded, with positions
            pix = torch.as_tensor(item["pixel_values"])
            pos = torch.as_tensor(item["image_position_ids"]).long()
            if pix.dim() != 3 or pos.shape != (*pix.shape[:2], 2):
                raise ValueError(
                    f"sample {sid}: pixel_values {tuple(pix.shape)} and image_position_ids"
                    f" {tuple(pos.shape)} do not describe the same patches"
                )
            # kept shifted by one, so that the packs' zero padding is the model's (-1, -1)
            return {"pixel_values": pix, "image_position_ids": pos + 1}, pix.shape[0]
        if self.layout == "whole":  # (images, C, H, W): one row per image
            pix = torch.as_tensor(item["pixel_values"])
            if pix.dim() != 4:
                raise ValueError(
                    f"sample {sid}: {self.name} pixel_values has shape {tuple(pix.shape)},"
                    " expected (images, channels, height, width)"
                )
            return {"pixel_values": pix}, pix.shape[0]
        pix = _strip_batch(item["pixel_values"], sid, "pixel_values", 4)
        fields = {"pixel_values": pix}
        if item.get("pixel_attention_mask") is not None:
            fields["pixel_attention_mask"] = _strip_batch(
                item["pixel_attention_mask"], sid, "pixel_attention_mask", 3
            ).bool()
        return fields, pix.shape[0]

    def _tokens_per_image(
        self, fields: dict[str, torch.Tensor], is_image: torch.Tensor, n_images: int, sid: int
    ) -> list[int]:
        total = int(is_image.sum())
        if self.layout == "mrope":
            merge = int(self.config.vision_config.spatial_merge_size)
            sizes = (fields["image_grid_thw"].prod(-1) // (merge * merge)).tolist()
            if sum(sizes) != total:
                raise ValueError(
                    f"sample {sid}: image_grid_thw gives {sum(sizes)} image tokens, input_ids"
                    f" hold {total}"
                )
            return sizes
        if self.layout == "sized":  # one feature per (patch x merge) cell of the real size
            cell = int(self.config.vision_config.patch_size) * int(self.config.spatial_merge_size)
            sizes = ((fields["image_sizes"] // cell).prod(-1)).tolist()
            if 1 in sizes:
                k = sizes.index(1)
                h, w = fields["image_sizes"][k].tolist()
                raise ValueError(
                    f"sample {sid}: image {k} is {h}x{w} pixels, one feature ({cell}x{cell}"
                    " pixels or less): transformers'"
                    f" {self.name} get_image_features fails on a call that holds only such an"
                    " image (it squeezes its one row away), which a pack or an encoder rank can"
                    " make at any step; give the processor a larger minimum size or leave it out"
                )
            if sum(sizes) != total:
                raise ValueError(
                    f"sample {sid}: image_sizes {fields['image_sizes'].tolist()} give {sum(sizes)}"
                    f" image tokens (one per {cell}x{cell} pixels), input_ids hold {total}"
                )
            return sizes
        # whole-image families: one run of image tokens per image when they are separated;
        # the split only feeds the cost features (image_sq_tokens), never the model
        return _split_evenly(total, n_images, _runs(is_image))

    def _mrope(
        self, item: Mapping, ids: torch.Tensor, is_image: torch.Tensor, sid: int
    ) -> torch.Tensor:
        types_ = item.get("mm_token_type_ids")
        types_ = is_image.int() if types_ is None else _flat(types_, sid, "mm_token_type_ids").int()
        grid = item.get("image_grid_thw")
        grid = None if grid is None else torch.as_tensor(grid).reshape(-1, 3).long()
        pos, _ = _rope_index(self.config)(
            ids[None], mm_token_type_ids=types_[None], image_grid_thw=grid
        )
        return pos[:, 0].long()  # (3, L)

    def field_rows(self, fields: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
        """Rows (first dimension) of each image in each of a pack's image fields, in the pack's
        image order: what moves with an image that encoder balancing encodes on another rank.
        Qwen-VL: each image's patch rows and its ``image_grid_thw`` row; LLaVA-OneVision: one
        (tile-padded) image and its ``image_sizes`` row; Idefics3: one tile per image (the
        tile is the unit)."""
        if "pixel_values" not in fields:
            return {}
        if self.layout == "mrope":
            grid = fields["image_grid_thw"]
            return {
                "pixel_values": grid.prod(-1).tolist(),
                "image_grid_thw": [1] * grid.shape[0],
            }
        n = int(fields["pixel_values"].shape[0])
        return {name: [1] * n for name in fields}

    # -- a packed batch -> the model's image keyword arguments --------------------------------

    def image_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        fields = batch.get("image_fields") or {}
        if "pixel_values" not in fields:
            return {}
        if self.layout == "mrope":
            return {
                "pixel_values": fields["pixel_values"],
                "image_grid_thw": fields["image_grid_thw"],
            }
        if self.layout == "anyres":
            out = {"pixel_values": fields["pixel_values"], "image_sizes": fields["image_sizes"]}
            num = (batch.get("sample_fields") or {}).get("batch_num_images")
            if num is not None:
                out["batch_num_images"] = num
            return out
        if self.layout == "whole":
            return {"pixel_values": fields["pixel_values"]}
        if self.layout == "sized":
            return {"pixel_values": fields["pixel_values"], "image_sizes": fields["image_sizes"]}
        if self.layout == "patches":
            return _patch_inputs(fields)
        out = {"pixel_values": fields["pixel_values"][None]}
        if "pixel_attention_mask" in fields:
            out["pixel_attention_mask"] = fields["pixel_attention_mask"][None]
        return out

    def encode(self, model: Any, fields: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The vision tower and projector of ``model`` on a set of images given as image fields
        (their per-image rows concatenated, as :meth:`field_rows` splits them), through the
        model's own ``get_image_features``: ``[embeddings, *deepstack features]``, each with one
        row per image token, the images in the order given (encoder balancing's local set).

        Raises:
            ValueError: for LLaVA-OneVision images of a multi-image sample (the model encodes
                those without any-resolution tiles: not balanced yet).
        """
        inner = model.model
        if self.layout == "mrope":
            out = inner.get_image_features(
                fields["pixel_values"], fields["image_grid_thw"], return_dict=True
            )
            deepstack = getattr(out, "deepstack_features", None) or []
            return [torch.cat(out.pooler_output), *(torch.cat(f) for f in deepstack)]
        if self.layout == "anyres":
            out = inner.get_image_features(
                pixel_values=fields["pixel_values"],
                image_sizes=fields["image_sizes"],
                batch_num_images=None,  # every image tiled: single-image samples only
                return_dict=True,
            )
            return [torch.cat(out.pooler_output)]
        if self.layout == "patches":
            out = inner.get_image_features(**_patch_inputs(fields), return_dict=True)
            return [torch.cat(out.pooler_output)]
        if self.layout == "sized":
            out = inner.get_image_features(
                pixel_values=fields["pixel_values"],
                image_sizes=fields["image_sizes"],
                return_dict=True,
            )
            return [torch.cat(out.pooler_output)]
        if self.layout == "whole":
            out = inner.get_image_features(fields["pixel_values"], return_dict=True)
            pooled = out.pooler_output  # (images, tokens per image, hidden)
            return [pooled.reshape(-1, pooled.shape[-1])]
        mask = fields.get("pixel_attention_mask")
        out = inner.get_image_features(
            fields["pixel_values"][None],
            None if mask is None else mask[None],
            return_dict=True,
        )
        return [torch.cat(out.pooler_output)]

    def attention_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Extra keyword arguments for the packed attention (``vlmbalance_image_blocks``: one
        positive id per run of image tokens, for the families whose images attend within
        themselves in both directions)."""
        if not self.image_blocks:
            return {}
        out = {"vlmbalance_image_blocks": image_blocks(batch["input_ids"][0], self.image_token_id)}
        if self.name == "gemma4":  # Gemma 4's full-attention layers stay causal over images
            out["vlmbalance_blocks_sliding_only"] = True
        return out

    def position_ids(self, batch: Mapping[str, Any]) -> torch.Tensor:
        if self.layout == "mrope":
            return batch["token_fields"]["mrope_position_ids"][:, None, :]  # (3, 1, T)
        return batch["position_ids"]

    def dummy_image_inputs(self, model: Any) -> dict[str, Any]:
        """Keyword arguments of ``get_image_features`` for one small constant image (what keeps
        the vision tower in a text-only pack's graph)."""
        vc = self.config.vision_config
        p = next(model.parameters())
        if self.layout == "mrope":
            m = int(vc.spatial_merge_size)
            dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
            return {
                "pixel_values": torch.zeros(m * m, dim, device=p.device, dtype=p.dtype),
                "image_grid_thw": torch.tensor([[1, m, m]], device=p.device),
            }
        if self.layout == "patches":  # a 2k x k patch image: two soft tokens
            k = int(vc.pooling_kernel_size)
            dim = 3 * int(vc.patch_size) ** 2
            xy = torch.cartesian_prod(torch.arange(2 * k), torch.arange(k)).to(p.device)
            return {
                "pixel_values": torch.zeros(1, 2 * k * k, dim, device=p.device, dtype=p.dtype),
                "image_position_ids": xy[None],
            }
        if self.layout == "sized":  # a small image of two features (Mistral 3's
            # get_image_features squeezes a one-feature image's rows away)
            cell = int(vc.patch_size) * int(self.config.spatial_merge_size)
            return {
                "pixel_values": torch.zeros(1, 3, cell, 2 * cell, device=p.device, dtype=p.dtype),
                "image_sizes": torch.tensor([[cell, 2 * cell]], device=p.device),
            }
        size = vc.image_size if isinstance(vc.image_size, int) else int(vc.image_size[0])
        if self.layout == "anyres":
            from transformers.models.llava_onevision.modeling_llava_onevision import (
                image_size_to_num_patches,
            )

            n = image_size_to_num_patches(
                [size, size], self.config.image_grid_pinpoints, vc.image_size
            )
            out = {
                "pixel_values": torch.zeros(1, n, 3, size, size, device=p.device, dtype=p.dtype),
                "image_sizes": torch.tensor([[size, size]], device=p.device),
            }
            out["batch_num_images"] = torch.tensor([1], device=p.device)
            return out
        if self.layout == "whole":
            h, w = (size, size) if isinstance(vc.image_size, int) else map(int, vc.image_size)
            return {"pixel_values": torch.zeros(1, 3, h, w, device=p.device, dtype=p.dtype)}
        return {  # ones: Idefics3 drops all-zero tiles as padding
            "pixel_values": torch.ones(1, 1, 3, size, size, device=p.device, dtype=p.dtype),
            "pixel_attention_mask": torch.ones(1, 1, size, size, device=p.device, dtype=torch.bool),
        }


_LAYOUTS = {
    **{name: "mrope" for name in _MROPE_MODELS},
    "llava_onevision": "anyres",
    "idefics3": "tiles",
    "smolvlm": "tiles",
    "gemma3": "whole",
    "internvl": "whole",
    "mistral3": "sized",
    "gemma4": "patches",
}
_IMAGE_BLOCKS = ("gemma3",)
SUPPORTED_FAMILIES = tuple(_LAYOUTS)


def _patch_inputs(fields: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma 4's image keyword arguments from the pack's fields (positions kept shifted by one,
    so that zero padding reads as the model's ``(-1, -1)``)."""
    return {
        "pixel_values": fields["pixel_values"],
        "image_position_ids": fields["image_position_ids"] - 1,
    }


def image_blocks(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``(T,)`` block ids of a packed row: ``k`` on the tokens of its ``k``-th run of image
    tokens (counted from 1), 0 elsewhere (Gemma's ``get_block_sequence_ids_for_mask``, shifted
    by one). A run that crosses a document boundary is cut there by the attention's own
    document mask."""
    is_image = input_ids == image_token_id
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:-1]
    return torch.where(is_image, torch.cumsum(starts.long(), 0), 0)


def family_of(model_or_config: Any) -> Family:
    """The :class:`Family` of a transformers model or config.

    Raises:
        ValueError: for a model type this module does not support, naming it, and for a
            configuration of a supported one that cannot be packed exactly (with the reason).
    """
    cfg = _config(model_or_config)
    name = getattr(cfg, "model_type", None)
    if name == "gemma4" and cfg.get_text_config().use_bidirectional_attention == "all":
        raise ValueError(
            "gemma4 with use_bidirectional_attention='all' is an encoder (every token sees the"
            " whole row, no causal mask): lightning_vlmbalance.hf packs causal language models"
        )
    if name not in _LAYOUTS:
        raise ValueError(
            f"lightning_vlmbalance.hf does not support model_type {name!r} yet (supported:"
            f" {', '.join(SUPPORTED_FAMILIES)}); packing it without its own image layout and"
            " positions would train it wrong silently"
        )
    return Family(name, _LAYOUTS[name], cfg)


def _rope_index(config: Any) -> Any:
    """The model class's own ``get_rope_index`` bound to a stand-in that holds only ``config``
    (it reads nothing else), so the collator needs no model instance."""
    import transformers

    cls = getattr(transformers, _MROPE_MODELS[config.model_type])
    shim = types.SimpleNamespace(config=config)
    shim.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, shim)
    return functools.partial(cls.get_rope_index, shim)
