"""Tiny random-init Hugging Face VLMs and synthetic processor outputs (no download).

For tests, the example and smoke runs: :func:`tiny_config` builds a small config of a supported
family, and :class:`SyntheticProcessed` yields, per sample, what that family's processor returns
for one sample: random images through the family's real image processor (PIL backend), and
``input_ids`` with the image placeholder tokens laid out and counted as the processor would.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import torch

__all__ = ["TINY_FAMILIES", "SyntheticProcessed", "tiny_config"]

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 100, 101, 102, 103
TEXT_TOKENS = (3, 96)  # random text ids are drawn from this range
TINY_FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_onevision",
    "idefics3",
    "gemma3",
    "internvl",
    "smolvlm",
    "mistral3",
    "glm4v",
    "qwen3_5",
    "gemma4",
)
BOI, EOI = 104, 105  # begin / end of image (Gemma, InternVL)
IMG_BREAK, IMG_END = 106, 107  # Pixtral's row break and image end

_TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
}
_QWEN_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 4,
}
_MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
_QWEN_TOKENS = {
    "image_token_id": IMAGE_TOKEN,
    "video_token_id": VIDEO_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}


def tiny_config(family: str, **text_overrides: Any) -> Any:
    """A small random-init config of ``family`` (one of :data:`TINY_FAMILIES`); build the model
    with ``AutoModelForImageTextToText.from_config(config, attn_implementation=...)``."""
    import transformers as tf

    text = {**_TEXT, **text_overrides}
    if family == "qwen2_vl":
        vision = {k: v for k, v in _QWEN_VISION.items() if k not in ("out_hidden_size",)}
        vision.update(embed_dim=32, hidden_size=32, mlp_ratio=2)
        return tf.Qwen2VLConfig(
            text_config={**text, "rope_parameters": _MROPE}, vision_config=vision, **_QWEN_TOKENS
        )
    if family == "qwen2_5_vl":
        vision = {**_QWEN_VISION, "window_size": 16, "fullatt_block_indexes": [1]}
        return tf.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": _MROPE}, vision_config=vision, **_QWEN_TOKENS
        )
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        vision = {**_QWEN_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
        rope = {**_MROPE, "mrope_interleaved": True}
        text = {**text, "head_dim": 8, "rope_parameters": rope}
        if family == "qwen3_vl":
            return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_QWEN_TOKENS)
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_QWEN_TOKENS)
    if family == "llava_onevision":
        return tf.LlavaOnevisionConfig(
            text_config={**text, "model_type": "qwen2"},
            vision_config=_SIGLIP,
            image_token_index=IMAGE_TOKEN,
            video_token_index=VIDEO_TOKEN,
            image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]],
            vision_feature_layer=-1,
        )
    if family == "idefics3":
        vision = {k: v for k, v in _SIGLIP.items() if k != "model_type"}
        return tf.Idefics3Config(
            text_config={**text, "model_type": "llama"},
            vision_config=vision,
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )
    if family == "gemma3":
        # a sliding window shorter than the documents, one sliding and one full layer
        text = {**text, "head_dim": 8, "sliding_window": 8}
        text["layer_types"] = ["sliding_attention", "full_attention"]
        return tf.Gemma3Config(
            text_config=text,
            vision_config=_SIGLIP,
            mm_tokens_per_image=4,
            image_token_index=IMAGE_TOKEN,
            boi_token_index=BOI,
            eoi_token_index=EOI,
        )
    if family == "internvl":  # InternVL 3.5: a Qwen3 language model, 4 tokens per tile
        return tf.InternVLConfig(
            text_config={**text, "model_type": "qwen3", "head_dim": 8},
            vision_config={k: v for k, v in _SIGLIP.items() if k != "model_type"},
            image_token_id=IMAGE_TOKEN,
            image_seq_length=4,
            downsample_ratio=0.5,
        )
    if family == "smolvlm":
        return tf.SmolVLMConfig(
            text_config={**text, "model_type": "llama"},
            vision_config={k: v for k, v in _SIGLIP.items() if k != "model_type"},
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )
    if family == "mistral3":  # a Mistral language model with a sliding window, a Pixtral tower
        return tf.Mistral3Config(
            text_config={**text, "model_type": "mistral", "head_dim": 8, "sliding_window": 8},
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "head_dim": 16,
                "patch_size": 4,
                "image_size": 64,
            },
            image_token_index=IMAGE_TOKEN,
            spatial_merge_size=2,
            vision_feature_layer=-1,
        )
    if family in ("glm4v", "qwen3_5"):
        vision = {**_QWEN_VISION, "image_size": 16, "num_position_embeddings": 64}
        rope = {**_MROPE, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.5}
        text = {**text, "head_dim": 8, "rope_parameters": rope}
        if family == "glm4v":
            return tf.Glm4vConfig(
                text_config=text,
                vision_config=vision,
                image_token_id=IMAGE_TOKEN,
                video_token_id=VIDEO_TOKEN,
                image_start_token_id=VISION_START,
                image_end_token_id=VISION_END,
                video_start_token_id=BOI,
                video_end_token_id=EOI,
            )
        # Qwen3.5: a linear-attention (Gated DeltaNet) layer, then a full-attention one
        text.update(
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        rope["mrope_interleaved"] = True
        return tf.Qwen3_5Config(text_config=text, vision_config=vision, **_QWEN_TOKENS)
    if family == "gemma4":
        # bidirectional within images, a sliding window shorter than the documents, per-layer
        # inputs, and the last two layers reusing the first two's keys and values
        text = {
            **text,
            "num_hidden_layers": 4,
            "head_dim": 8,
            "global_head_dim": 8,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "vocab_size_per_layer_input": text["vocab_size"],
            "hidden_size_per_layer_input": 8,
            "use_bidirectional_attention": "vision",
        }
        vision = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "patch_size": 4,
            "pooling_kernel_size": 2,
            "position_embedding_size": 64,
        }
        return tf.Gemma4Config(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN,
            boi_token_id=BOI,
            eoi_token_id=EOI,
            audio_token_id=IMG_BREAK,
        )
    raise ValueError(f"tiny_config: no tiny config for {family!r} (have {TINY_FAMILIES})")


class SyntheticProcessed(torch.utils.data.Dataset):
    """Processor outputs of ``n`` synthetic samples of ``config``'s family.

    Each sample is text with 1 to ``max_images`` random images of random size up to ``max_side``
    pixels, or (a ``text_share`` of them) longer text only; every item is deterministic in
    ``(seed, index)``.
    """

    def __init__(
        self,
        config: Any,
        n: int,
        *,
        seed: int = 0,
        text_share: float = 0.3,
        max_images: int = 2,
        max_side: int = 40,
        text_len: tuple[int, int] = (8, 48),
        text_only_len: tuple[int, int] = (48, 160),
    ) -> None:
        self.config, self.n, self.seed = config, n, seed
        self.text_share, self.max_images, self.max_side = text_share, max_images, max_side
        self.text_len, self.text_only_len = text_len, text_only_len
        self.family = config.model_type
        self._processor = _image_processor(config)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, index])
        with_images = rng.random() >= self.text_share
        n_images = int(rng.integers(1, self.max_images + 1)) if with_images else 0
        images = [
            (rng.random((*rng.integers(12, self.max_side + 1, size=2), 3)) * 255).astype(np.uint8)
            for _ in range(n_images)
        ]

        def text(lo: int | None = None, hi: int | None = None) -> list[int]:
            k = int(rng.integers(lo or self.text_len[0], (hi or self.text_len[1]) + 1))
            return rng.integers(*TEXT_TOKENS, size=k).tolist()

        ids = text() if images else text(*self.text_only_len)
        item: dict[str, Any] = {}
        if images:
            flat = ("qwen", "internvl", "mistral3", "glm4v", "gemma4")
            one_sample = images if self.family.startswith(flat) else [images]
            item = dict(self._processor(images=one_sample, return_tensors="pt"))
            for placeholder in self._placeholders(item, images):
                ids += placeholder + text(2)
        item["input_ids"] = torch.tensor([ids])
        item["attention_mask"] = torch.ones_like(item["input_ids"])
        if self.family.startswith(("qwen", "glm4v")):  # their processors return it
            item["mm_token_type_ids"] = (item["input_ids"] == IMAGE_TOKEN).int()
        if self.family == "gemma3":  # Gemma3Processor's name for the same marking
            item["token_type_ids"] = (item["input_ids"] == IMAGE_TOKEN).long()
            item.pop("num_crops", None)  # the processor drops it
        if self.family == "gemma4":  # Gemma4Processor's marking
            item["mm_token_type_ids"] = (item["input_ids"] == IMAGE_TOKEN).long()
        item.pop("num_patches", None)  # InternVLProcessor lays out the text with it, then drops it
        item.pop("num_soft_tokens_per_image", None)  # so does Gemma4Processor
        return item

    def _placeholders(self, item: dict, images: list[np.ndarray]) -> list[list[int]]:
        cfg = self.config
        if self.family.startswith(("qwen", "glm4v")):
            merge = cfg.vision_config.spatial_merge_size
            counts = (item["image_grid_thw"].prod(-1) // merge**2).tolist()
            return [[VISION_START] + [IMAGE_TOKEN] * n + [VISION_END] for n in counts]
        if self.family == "llava_onevision":
            # as LlavaOnevisionProcessor.replace_image_token counts them
            side = cfg.vision_config.image_size
            if len(images) == 1:
                count = _llava_counter(cfg, self._processor)
                counts = [count(images[0].shape[0], images[0].shape[1], side, side)]
            else:  # a multi-image sample: the base patch and a newline per image
                counts = [(side // cfg.vision_config.patch_size) ** 2 + 1] * len(images)
            drop = int(cfg.vision_feature_select_strategy == "default")
            return [[IMAGE_TOKEN] * (n - drop) for n in counts]
        if self.family == "gemma3":  # "<boi>" + image soft tokens + "<eoi>" per image
            return [[BOI] + [IMAGE_TOKEN] * cfg.mm_tokens_per_image + [EOI] for _ in images]
        if self.family == "gemma4":  # as many soft tokens as the image processor made
            counts = item["num_soft_tokens_per_image"].tolist()
            return [[BOI] + [IMAGE_TOKEN] * n + [EOI] for n in counts]
        if self.family == "internvl":  # "<img>" + 4 tokens per tile + "</img>" per image
            tiles = item["num_patches"].tolist()
            return [[BOI] + [IMAGE_TOKEN] * (cfg.image_seq_length * t) + [EOI] for t in tiles]
        if self.family == "mistral3":  # per row: [IMG] x cols + [IMG_BREAK]; the last [IMG_END]
            cell = cfg.vision_config.patch_size * cfg.spatial_merge_size
            out = []
            for h, w in item["image_sizes"].tolist():
                tokens = ([IMAGE_TOKEN] * (w // cell) + [IMG_BREAK]) * (h // cell)
                out.append([*tokens[:-1], IMG_END])
            return out
        # idefics3, smolvlm: every tile (crops and the global image) is one image of
        # image_seq_len tokens
        vc = cfg.vision_config
        per_tile = (vc.image_size // vc.patch_size) ** 2 // cfg.scale_factor**2
        tiles = int(item["pixel_values"].shape[1])
        return [[IMAGE_TOKEN] * per_tile + [4]] * tiles  # 4: a stand-in for the tile tags


def _image_processor(config: Any) -> Any:
    import transformers as tf

    if config.model_type == "glm4v":
        vc = config.vision_config
        return tf.Glm4vImageProcessorPil(
            patch_size=vc.patch_size,
            merge_size=vc.spatial_merge_size,
            temporal_patch_size=vc.temporal_patch_size,
            size={"shortest_edge": 64, "longest_edge": 48 * 48},
        )
    if config.model_type == "gemma4":
        vc = config.vision_config
        return tf.Gemma4ImageProcessorPil(
            patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size, max_soft_tokens=70
        )
    if config.model_type.startswith("qwen"):
        vc = config.vision_config
        return tf.Qwen2VLImageProcessorPil(
            patch_size=vc.patch_size,
            merge_size=vc.spatial_merge_size,
            temporal_patch_size=vc.temporal_patch_size,
            min_pixels=64,
            max_pixels=48 * 48,
        )
    side = config.vision_config.image_size
    side = side if isinstance(side, int) else int(side[0])  # InternVL's is (height, width)
    if config.model_type == "gemma3":
        return tf.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    if config.model_type == "internvl":  # InternVLProcessor's image processor, tiling on
        return tf.GotOcr2ImageProcessorPil(
            size={"height": side, "width": side}, crop_to_patches=True, min_patches=1, max_patches=6
        )
    if config.model_type == "mistral3":  # PixtralProcessor passes patch x merge as the patch
        cell = config.vision_config.patch_size * config.spatial_merge_size
        return tf.PixtralImageProcessorPil(
            size={"longest_edge": 32}, patch_size={"height": cell, "width": cell}
        )
    if config.model_type == "smolvlm":
        return tf.SmolVLMImageProcessorPil(
            size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
        )
    if config.model_type == "llava_onevision":
        return tf.LlavaOnevisionImageProcessorPil(
            size={"height": side, "width": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=config.image_grid_pinpoints,
        )
    return tf.Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
    )


def _llava_counter(config: Any, image_processor: Any) -> Any:
    """LLaVA-OneVision's processor's own image-token count, bound to a stand-in for the
    processor (it needs no tokenizer for this)."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor as P,
    )

    side = config.vision_config.image_size // config.vision_config.patch_size
    shim = types.SimpleNamespace(
        image_processor=image_processor,
        num_image_tokens=side * side,
        vision_aspect_ratio=config.vision_aspect_ratio,
    )
    shim._get_unpadded_features = functools.partial(P._get_unpadded_features, shim)
    return functools.partial(P._get_number_of_features, shim)
