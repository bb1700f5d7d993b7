"""Exact per-record lengths of :class:`~lightning_vlmbalance.hf.records.ChatRecords` without
decoding an image: :func:`header_lengths`, and length tables saved with a fingerprint.

:func:`~lightning_vlmbalance.hf.item_lengths` over ``ChatRecords`` runs the processor on every
record: it decodes, resizes and normalizes every image to count tokens that depend only on the
image sizes. :func:`header_lengths` returns the same ``ItemLengths`` (``total_tokens``,
``image_tokens``, ``images``, counted the way :class:`~lightning_vlmbalance.hf.HFPackCollator`
packs, per family) from:

* the image sizes read from the file headers (:func:`image_size`: PNG without decoding, EXIF
  orientation applied as ``transformers.image_utils.load_image`` applies it);
* per image, the fields the image processor would hand the processor (``image_grid_thw``,
  ``num_crops``, ``num_patches``, ``rows`` / ``cols``, ``image_sizes``,
  ``num_soft_tokens_per_image``), from the image processor's effective settings and its own
  module's size functions (``smart_resize``, ``get_resize_output_image_size``,
  ``get_optimal_tiled_canvas``, ``get_aspect_ratio_preserving_size``, and ``pan_and_scan`` run on
  a zero-stride stand-in array);
* the processor's own ``replace_image_token`` and ``get_text_with_replacements`` on those fields,
  so that the expanded text is the one the processor builds, tokenized in one batched call after
  one batched ``apply_chat_template(..., tokenize=False)``.

Runs of a repeated special token in an expansion (``<|image_pad|>`` x 1,300 ...) are tokenized
as one copy and counted back: each such token is checked once per tokenizer to be one id per copy
alone, in runs and next to text (a token that fails is tokenized in full). The per-image token
counts come from the family's own ``Family._tokens_per_image`` on stand-ins (the grid or resized
sizes, and an image-token mask with the expanded text's token and run counts), so its split and
its refusals are those of ``item_lengths``.

Fallback, exact: records whose image settings the size rules do not cover (an image processor
class not in ``_FAST``, ``do_resize=False`` for the resizing families, LLaVA-OneVision with a
``shortest_edge`` size, Pixtral with ``do_center_crop``) are counted by the real processor on
blank images of the header sizes (pixel values never change the token layout), at the
processor's speed, and logged. Gemma 3 pan-and-scan and LLaVA-OneVision multi-image samples need
none: the crops come from the image processor's ``pan_and_scan`` on a stand-in array, and the
multi-image expansion from the processor's ``replace_image_token``.

Length tables (:func:`save_length_table`, :func:`load_length_table`, ``header_lengths(table=)``)
are ``.npz`` files (plain numpy arrays, loaded with ``allow_pickle=False``):

* ``total_tokens``, ``image_tokens``, ``images``: ``int64``, one per record;
* ``record_hashes``, ``file_hashes``: ``uint64``, one per record: a hash of the record's resolved
  image paths and messages, and one of its image files' sizes and modification times;
* ``fingerprint``: the UTF-8 JSON (``uint8`` array) of :func:`length_fingerprint` less the
  hashes: format version, family, processor class and settings (``to_dict()`` less volatile and
  component keys), image processor class and settings, hashes of the tokenizer vocabulary, its
  special tokens and its pipeline (normalizer, pre-tokenizer, model, post-processor), the chat
  template's hash, the label mask mode, transformers and tokenizers versions, the record count.

A table that does not match is refused with a ``ValueError`` naming every difference, e.g.
``image processor setting size.longest_edge: saved 2304, now 4096``, ``tokenizer vocab changed``,
``chat template changed``, ``record count: saved 100, now 120``, ``records content changed for 1
records: 17``, ``image files (size or modification time) changed for 2 records: 3, 8``.

Not checked here: a record whose assistant turns render to no tokens at all (``ChatRecords``
refuses it when it is read); a record with no assistant message is refused.

Example::

    data = ChatRecords("train.jsonl", processor)
    lengths = header_lengths(data, table="train.lengths.npz", config=model.config)
    sampler = vb.PackingSampler(lengths.total_tokens, lengths.image_tokens, seq_len=8192)
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import re
import struct
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_vlmbalance.hf.families import Family, family_of
from lightning_vlmbalance.hf.inputs import ItemLengths
from lightning_vlmbalance.hf.records import ChatRecords

__all__ = [
    "header_lengths",
    "image_size",
    "length_fingerprint",
    "load_length_table",
    "save_length_table",
]

log = logging.getLogger(__name__)

TABLE_FORMAT = 1
_CHUNK = 4096  # records rendered and tokenized per batch


# --------------------------------------------------------------------------------------------
# 1. image sizes from the file header
# --------------------------------------------------------------------------------------------
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG text chunks whose keyword Pillow reads an EXIF orientation from (Image.getexif)
_PNG_EXIF_KEYWORDS = (b"Raw profile type exif", b"XML:com.adobe.xmp")


def image_size(path: str | Path) -> tuple[int, int]:
    """``(height, width)`` of an image file as the processor sees it after
    ``transformers.image_utils.load_image`` (EXIF orientations 5-8 swap the sides).

    PNG files are read from their chunk headers only: Pillow's ``PngImageFile.getexif`` decodes
    the whole image (to find an ``eXIf`` chunk after the pixel data), so a PNG is walked chunk by
    chunk (headers, no decompression); only a PNG that holds an EXIF or XMP chunk goes through
    Pillow. Other formats are
    opened lazily with Pillow (JPEG and WebP keep EXIF in their header).

    Raises:
        OSError: the file cannot be read; ``PIL.UnidentifiedImageError`` for a non-image.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 33, 0)
        if head[:8] == _PNG_SIGNATURE and head[12:16] == b"IHDR":
            width, height = struct.unpack(">II", head[16:24])
            if not _png_has_orientation_chunk(fd, os.fstat(fd).st_size):
                return height, width
    finally:
        os.close(fd)
    return _pillow_size(path)


def _pillow_size(path: str | Path) -> tuple[int, int]:
    """Pillow's lazy open (header only for JPEG and WebP; a PNG with an EXIF chunk is decoded to
    reach it), EXIF orientations 5-8 swapping the sides as ``load_image`` does."""
    from PIL import Image

    with Image.open(path) as im:
        width, height = im.size
        try:
            orientation = im.getexif().get(0x0112, 1)
        except Exception:  # a malformed EXIF block: transformers' exif_transpose would fail too
            orientation = 1
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def _png_has_orientation_chunk(fd: int, size: int) -> bool:
    """Whether a PNG holds a chunk Pillow could read an EXIF orientation from (or is truncated,
    so that Pillow decides)."""
    pos = 33  # signature (8) + IHDR (4 length + 4 type + 13 data + 4 crc)
    while pos + 8 <= size:
        length, kind = struct.unpack(">I4s", os.pread(fd, 8, pos))
        if kind == b"IEND":
            return False
        if kind == b"eXIf":
            return True
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            keyword = os.pread(fd, min(length, 80), pos + 8).split(b"\0", 1)[0]
            if keyword in _PNG_EXIF_KEYWORDS:
                return True
        pos += 12 + length
    return True


def _stand_in(height: int, width: int) -> np.ndarray:
    """A ``(3, height, width)`` zero-stride array: what the image processors' size functions read
    (``shape``), without pixels."""
    return np.broadcast_to(np.zeros((), dtype=np.uint8), (3, height, width))


# --------------------------------------------------------------------------------------------
# 2. per family: what the image processor reports for images of these sizes
# --------------------------------------------------------------------------------------------
# image processor class (without the "Pil" suffix) -> (size rule, processor classes it serves)
_FAST = {
    "Qwen2VLImageProcessor": (
        "qwen",
        ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"),
    ),
    "Glm4vImageProcessor": ("glm", ("Glm4vProcessor",)),
    "Gemma3ImageProcessor": ("gemma3", ("Gemma3Processor",)),
    "Gemma4ImageProcessor": ("gemma4", ("Gemma4Processor",)),
    "GotOcr2ImageProcessor": ("got", ("InternVLProcessor",)),
    "PixtralImageProcessor": ("pixtral", ("PixtralProcessor",)),
    "LlavaOnevisionImageProcessor": ("llava_ov", ("LlavaOnevisionProcessor",)),
    "Idefics3ImageProcessor": ("idefics", ("Idefics3Processor",)),
    "SmolVLMImageProcessor": ("idefics", ("SmolVLMProcessor",)),
}
# processor class -> the family whose counting conventions apply when no model config is given
_PROCESSOR_FAMILIES = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
    "Glm4vProcessor": "glm4v",
    "LlavaOnevisionProcessor": "llava_onevision",
    "Idefics3Processor": "idefics3",
    "SmolVLMProcessor": "smolvlm",
    "Gemma3Processor": "gemma3",
    "InternVLProcessor": "internvl",
    "PixtralProcessor": "mistral3",
    "Gemma4Processor": "gemma4",
}


def _size_attr(size: Any, key: str) -> Any:
    if size is None:
        return None
    if isinstance(size, Mapping):
        return size.get(key)
    return getattr(size, key, None)


class _Rules:
    """The size rules of one processor's image processor, from its effective settings.

    ``image_inputs(sizes)`` returns ``(fake image_inputs, units per image)``: the fields the
    processor's ``replace_image_token`` reads, as the image processor would return them for
    images of these ``(height, width)`` sizes in one sample, and how many first-dimension rows of
    ``pixel_values`` each image becomes (tiles for InternVL / Idefics3 / SmolVLM, the crops for
    Gemma 3 pan-and-scan). ``rule`` is ``None`` where these settings are not covered (the records
    with images then take the fallback)."""

    def __init__(self, processor: Any, images_kwargs: dict[str, Any]) -> None:
        ip = processor.image_processor
        name = type(ip).__name__.removesuffix("Pil")
        rule, processors = _FAST.get(name, (None, ()))
        self.rule = rule if type(processor).__name__ in processors else None
        self.ip = ip
        self.processor = processor
        self.module = sys.modules[type(ip).__module__]
        self.settings: dict[str, Any] = {}
        if self.rule is not None:
            self.settings = ip._merge_and_standardize_kwargs(**copy.deepcopy(images_kwargs))
            if not self._covered():
                self.rule = None

    def _covered(self) -> bool:
        s = self.settings
        size = s.get("size")
        if self.rule in ("qwen", "glm", "gemma3", "gemma4"):
            return bool(s.get("do_resize"))
        if self.rule == "pixtral":
            ok_size = _size_attr(size, "longest_edge") or (
                _size_attr(size, "height") and _size_attr(size, "width")
            )
            return bool(not s.get("do_center_crop") and (ok_size or not s.get("do_resize")))
        if self.rule == "llava_ov":
            return bool(
                s.get("do_resize") and _size_attr(size, "height") and _size_attr(size, "width")
            )
        if self.rule == "idefics":
            ok_size = _size_attr(size, "longest_edge") or (
                _size_attr(size, "height") and _size_attr(size, "width")
            )
            return bool(ok_size or not s.get("do_resize"))
        return self.rule == "got"

    def image_inputs(self, sizes: list[tuple[int, int]]) -> tuple[dict[str, Any], list[int]]:
        return getattr(self, f"_{self.rule}")(sizes)

    # -- the rules: each mirrors the image processor's _preprocess for the sizes alone --------

    def _qwen(self, sizes):
        s = self.settings
        p, m = int(s["patch_size"]), int(s["merge_size"])
        size = s["size"]
        grids = []
        for h, w in sizes:
            rh, rw = self.module.smart_resize(
                h,
                w,
                factor=p * m,
                min_pixels=_size_attr(size, "shortest_edge"),
                max_pixels=_size_attr(size, "longest_edge"),
            )
            grids.append([1, rh // p, rw // p])
        return {"image_grid_thw": np.asarray(grids, dtype=np.int64).reshape(-1, 3)}, [1] * len(
            sizes
        )

    def _glm(self, sizes):
        s = self.settings
        p, m, t = int(s["patch_size"]), int(s["merge_size"]), int(s["temporal_patch_size"])
        size = s["size"]
        grids = []
        for h, w in sizes:
            rh, rw = self.module.smart_resize(
                height=h,
                width=w,
                num_frames=t,
                factor=p * m,
                temporal_factor=t,
                min_pixels=_size_attr(size, "shortest_edge"),
                max_pixels=_size_attr(size, "longest_edge"),
            )
            grids.append([1, rh // p, rw // p])
        return {"image_grid_thw": np.asarray(grids, dtype=np.int64).reshape(-1, 3)}, [1] * len(
            sizes
        )

    def _gemma3(self, sizes):
        s = self.settings
        crops = []
        for h, w in sizes:
            if s.get("do_pan_and_scan"):
                pieces = self.ip.pan_and_scan(
                    image=_stand_in(h, w),
                    pan_and_scan_min_crop_size=s["pan_and_scan_min_crop_size"],
                    pan_and_scan_max_num_crops=s["pan_and_scan_max_num_crops"],
                    pan_and_scan_min_ratio_to_activate=s["pan_and_scan_min_ratio_to_activate"],
                )
                crops.append(len(pieces))
            else:
                crops.append(0)
        return {"num_crops": crops}, [1 + c for c in crops]

    def _gemma4(self, sizes):
        s = self.settings
        p, k = int(s["patch_size"]), int(s["pooling_kernel_size"])
        max_patches = int(s["max_soft_tokens"]) * k * k
        tokens = []
        for h, w in sizes:
            th, tw = self.module.get_aspect_ratio_preserving_size(
                height=h, width=w, patch_size=p, max_patches=max_patches, pooling_kernel_size=k
            )
            tokens.append((th // p) * (tw // p) // (k * k))
        return {"num_soft_tokens_per_image": tokens}, [1] * len(sizes)

    def _got(self, sizes):
        s = self.settings
        size = s["size"]
        tile = (_size_attr(size, "height"), _size_attr(size, "width"))
        patches = []
        for h, w in sizes:
            n = 1
            if s.get("crop_to_patches") and s["max_patches"] > 1:
                cols, rows = self.module.get_optimal_tiled_canvas(
                    (h, w), tile, s["min_patches"], s["max_patches"]
                )
                if cols * rows > 1:  # the tiles plus a thumbnail
                    n += cols * rows
            patches.append(n)
        return {"num_patches": patches}, patches

    def _pixtral(self, sizes):
        from transformers.image_processing_utils import get_size_dict
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        s = self.settings
        patch = get_size_dict(s.get("patch_size") or self.ip.patch_size, default_to_square=True)
        patch = (patch["height"], patch["width"])
        size = s["size"]
        longest = _size_attr(size, "longest_edge")
        bound = (
            (longest, longest)
            if longest
            else (_size_attr(size, "height"), _size_attr(size, "width"))
        )
        out = []
        for h, w in sizes:
            if s.get("do_resize"):
                h, w = pil.get_resize_output_image_size(
                    _stand_in(h, w),
                    size=bound,
                    patch_size=patch,
                    input_data_format="channels_first",
                )
            out.append((int(h), int(w)))
        return {"image_sizes": out}, [1] * len(sizes)

    def _llava_ov(self, sizes):
        s = self.settings
        size, crop = s["size"], s.get("crop_size")
        h, w = _size_attr(size, "height"), _size_attr(size, "width")
        if s.get("do_center_crop") and crop is not None:
            h, w = _size_attr(crop, "height"), _size_attr(crop, "width")
        first = np.broadcast_to(np.zeros((), dtype=np.float32), (1, 3, h, w))
        fake = {
            "batch_num_images": [len(sizes)],
            "image_sizes": list(sizes),
            "pixel_values": [first],
        }
        return fake, [1] * len(sizes)

    def _idefics(self, sizes):
        s = self.settings
        size = s["size"]
        longest = _size_attr(size, "longest_edge")
        split = s.get("do_image_splitting")
        tile = int(s["max_image_size"]["longest_edge"])
        rows, cols, units = [], [], []
        for h, w in sizes:
            if s.get("do_resize"):
                if longest:
                    h, w = self.module.get_resize_output_image_size(
                        _stand_in(h, w), resolution_max_side=longest
                    )
                else:
                    h, w = _size_attr(size, "height"), _size_attr(size, "width")
            r = c = 0
            if split:  # resize_for_vision_encoder, then split_images
                aspect = w / h
                if w >= h:
                    w = math.ceil(w / tile) * tile
                    h = int(w / aspect)
                    h = math.ceil(h / tile) * tile
                else:
                    h = math.ceil(h / tile) * tile
                    w = int(h * aspect)
                    w = math.ceil(w / tile) * tile
                if h > tile or w > tile:
                    r, c = (h - tile) // tile + 1, (w - tile) // tile + 1
            rows.append(r)
            cols.append(c)
            units.append(r * c + 1 if (r or c) else 1)
        return {"rows": [rows], "cols": [cols]}, units


# --------------------------------------------------------------------------------------------
# 3. the plan: what one processor needs, built once
# --------------------------------------------------------------------------------------------
_TEXT_DROP = (
    "return_tensors",
    "return_mm_token_type_ids",
    "return_text_replacement_offsets",
    "return_offsets_mapping",
    "padding_side",
)


def _family(processor: Any, config: Any | None) -> Family:
    """The counting conventions: the model config's family when given, else one built from the
    processor (its image token id, merge size, patch cell)."""
    if config is not None:
        return family_of(config)
    cls = type(processor).__name__
    name = _PROCESSOR_FAMILIES.get(cls)
    if name is None:
        raise ValueError(
            f"header_lengths: no family known for processor {cls}; pass the model config"
            f" (config=...) (known processors: {', '.join(sorted(_PROCESSOR_FAMILIES))})"
        )
    tok = processor.tokenizer
    if name == "gemma3":  # Gemma3Processor.image_token_id is the begin-of-image token
        image_id = tok.image_token_id
    else:
        image_id = processor.image_token_id
    ip = processor.image_processor
    merge = getattr(ip, "merge_size", None)
    vision = types.SimpleNamespace(
        spatial_merge_size=merge, patch_size=getattr(processor, "patch_size", None)
    )
    text = types.SimpleNamespace(use_bidirectional_attention="vision")
    cfg = types.SimpleNamespace(
        model_type=name,
        image_token_id=int(image_id),
        vision_config=vision,
        spatial_merge_size=getattr(processor, "spatial_merge_size", None),
        get_text_config=lambda: text,
    )
    return family_of(cfg)


class _Plan:
    """Everything header_lengths needs of one processor, computed once."""

    def __init__(self, processor: Any, config: Any | None) -> None:
        self.processor = processor
        self.family = _family(processor, config)
        self.image_id = self.family.image_token_id
        tok = processor.tokenizer
        self.tokenizer = tok
        self.bos = getattr(tok, "bos_token", None)
        self.placeholder = getattr(processor, "image_token", None)
        merged = {
            flag: processor._merge_kwargs(
                tokenizer_init_kwargs=tok.init_kwargs,
                **({} if flag else {"add_special_tokens": False}),
            )
            for flag in (True, False)
        }
        self.images_kwargs = dict(merged[True]["images_kwargs"])
        if type(processor).__name__ == "PixtralProcessor":  # PixtralProcessor._process_images
            self.images_kwargs["patch_size"] = processor.patch_size * processor.spatial_merge_size
        self.text_kwargs = {}
        for flag, m in merged.items():
            kw = {k: v for k, v in m["text_kwargs"].items() if k not in _TEXT_DROP}
            kw.update(padding=False, return_attention_mask=False, return_token_type_ids=False)
            self.text_kwargs[flag] = kw
        self.rules = _Rules(processor, self.images_kwargs)
        self._compress_setup()

    def _compress_setup(self) -> None:
        """The special tokens whose repeated runs are tokenized as one copy: each must be one id
        per copy alone, in runs and between text (checked here, with this tokenizer)."""
        tok = self.tokenizer
        candidates = {
            self.placeholder,
            getattr(tok, "image_token", None),
            tok.convert_ids_to_tokens(self.image_id),
        }
        added = set(tok.get_added_vocab())
        kw = self.text_kwargs[False]
        self.token_ids: dict[str, tuple[int, re.Pattern]] = {}
        candidates = {c for c in candidates if isinstance(c, str) and c in added}
        # a token inside another would be counted inside it too: such pairs are not cut
        candidates = {c for c in candidates if not any(c != o and c in o for o in candidates)}
        for t in sorted(candidates):
            tid = tok.convert_tokens_to_ids(t)
            probes = [t, t * 2, t * 3, f"a{t}b", f"a{t * 3}b", f" {t * 2} "]
            ids = tok(probes, **kw)["input_ids"]
            ok = (
                [len(x) for x in ids[:3]] == [1, 2, 3]
                and ids[0] == [tid]
                and len(ids[4]) == len(ids[3]) + 2
                and ids[4].count(tid) == 3
                and ids[5].count(tid) == 2
            )
            if ok:
                self.token_ids[t] = (tid, re.compile(f"(?:{re.escape(t)}){{2,}}"))

    def compress(self, text: str) -> tuple[str, int, int]:
        """``text`` with each run of a compressible token cut to one copy, the tokens cut, and
        how many of them were image tokens (a run of ``k`` copies of a token is ``k``
        non-overlapping occurrences of it: the cut is the drop in ``str.count``)."""
        cut = cut_image = 0
        for t, (tid, pattern) in self.token_ids.items():
            before = text.count(t)
            if before < 2:
                continue
            first = text.find(t)
            end = text.rfind(t) + len(t)
            if end - first == before * len(t):  # one run (most expansions): no regex needed
                text = text[:first] + t + text[end:]
            else:
                text = pattern.sub(t, text)
            k = before - text.count(t)
            cut += k
            cut_image += k * (tid == self.image_id)
        return text, cut, cut_image


_PLANS: dict[int, tuple[Any, Any, _Plan]] = {}


def _plan_for(processor: Any, config: Any | None) -> _Plan:
    """The plan of ``processor`` (cached while the processor and its settings are unchanged)."""
    key = id(processor)
    state = _settings_state(processor)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is processor and hit[1] == (state, id(config)):
        return hit[2]
    plan = _Plan(processor, config)
    _PLANS.clear()  # one processor at a time: no growing cache
    _PLANS[key] = (processor, (state, id(config)), plan)
    return plan


def _settings_state(processor: Any) -> str:
    """What a plan is built from: the processor's and image processor's settings and the
    tokenizer's size and special tokens."""
    ip = getattr(processor, "image_processor", None)
    tok = processor.tokenizer
    return json.dumps(
        [
            _jsonable(processor.to_dict()),
            _jsonable(ip.to_dict() if ip is not None else None),
            len(tok),
            _jsonable(getattr(tok, "special_tokens_map", {})),
        ],
        sort_keys=True,
    )


# --------------------------------------------------------------------------------------------
# 4. header_lengths
# --------------------------------------------------------------------------------------------
def header_lengths(
    records: ChatRecords,
    *,
    table: str | Path | None = None,
    config: Any | None = None,
) -> ItemLengths:
    """``(total_tokens, image_tokens, images)`` of every record of ``records``, equal to
    ``item_lengths(records, config)``, without decoding an image (see the module docstring).

    Args:
        records: the :class:`~lightning_vlmbalance.hf.ChatRecords` (its processor is used).
        table: a length table (``.npz``): reused if it exists and its fingerprint matches these
            records and this processor, written after counting if it does not exist.
        config: the model config (or model) whose family counts the lengths, as
            ``item_lengths`` takes it; default: the family of the processor class (image token
            id, merge size and patch cell read from the processor).

    Returns:
        ``ItemLengths`` of ``int64`` arrays, one entry per record.

    Raises:
        ValueError: naming the record, for a missing image file, image entries that do not
            match its images, a conversation without an assistant message, or a count the
            processor would refuse; for a stale ``table``, naming what changed; for a processor
            of no known family without ``config``.
    """
    if table is not None and Path(table).exists():
        return load_length_table(table, records, config=config)
    fingerprint = length_fingerprint(records, config=config) if table is not None else None
    plan = _plan_for(records.processor, config)
    totals: list[int] = []
    image_counts: list[int] = []
    units: list[int] = []
    fallbacks = 0
    for start in range(0, len(records), _CHUNK):
        part = _count_chunk(records, plan, range(start, min(start + _CHUNK, len(records))))
        for total, image, n, fell in part:
            totals.append(total)
            image_counts.append(image)
            units.append(n)
            fallbacks += fell
    if fallbacks:
        log.info(
            "header_lengths: %d of %d records counted by the processor on blank images (image"
            " settings not covered by the size rules of %s)",
            fallbacks,
            len(records),
            type(records.processor.image_processor).__name__,
        )
    lengths = ItemLengths(*(np.asarray(x, dtype=np.int64) for x in (totals, image_counts, units)))
    if table is not None:
        save_length_table(table, lengths, fingerprint)
    return lengths


def _check_record(records: ChatRecords, index: int) -> list[Path]:
    """The record's image paths; the errors ChatRecords raises for it (and no assistant turn)."""
    paths = records.image_paths(index)
    for path in paths:
        if not path.is_file():
            raise ValueError(f"record {index}: image file {path} does not exist")
    messages = records.records[index]["messages"]
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError(f"record {index}: no assistant message (no tokens to train on)")
    return paths


def _count_chunk(
    records: ChatRecords, plan: _Plan, indices: range
) -> list[tuple[int, int, int, bool]]:
    """``(total, image_tokens, images, by_fallback)`` of the records ``indices``: one chat
    template call and one tokenizer call (per ``add_special_tokens`` setting) for all of them."""
    processor = plan.processor
    conversations, sizes = [], []
    for i in indices:
        paths = _check_record(records, i)
        conversations.append(records.messages(i))
        try:
            sizes.append([image_size(p) for p in paths])
        except Exception as e:
            raise ValueError(f"record {i}: cannot read the size of its images ({e})") from e
    if not conversations:
        return []
    prompts = processor.apply_chat_template(conversations, tokenize=False)
    if isinstance(prompts, str):
        prompts = [prompts]
    texts: dict[bool, list[str]] = {True: [], False: []}
    pending: list[Any] = []  # per record: a finished count, or where its ids will be
    for i, prompt, image_sizes in zip(indices, prompts, sizes):
        special = not (plan.bos is not None and prompt.startswith(plan.bos))
        n_images = len(image_sizes)
        if n_images and plan.placeholder is not None:
            found = prompt.count(plan.placeholder)
            if found != n_images:
                raise ValueError(
                    f"record {i}: its chat template rendered {found} {plan.placeholder!r}"
                    f" placeholders for {n_images} images"
                )
        if n_images and plan.rules.rule is None:
            pending.append(_fallback(plan, i, prompt, image_sizes, special))
            continue
        text, extra, extra_image, fake, n_units = prompt, 0, 0, {}, []
        if n_images:
            try:
                fake, n_units = plan.rules.image_inputs(image_sizes)
                replacements = [
                    processor.replace_image_token(fake, image_idx=k, **plan.images_kwargs)
                    for k in range(n_images)
                ]
            except Exception as e:
                raise ValueError(f"record {i}: images of sizes {image_sizes}: {e}") from e
            compressed = []
            for r in replacements:
                c, cut, cut_image = plan.compress(r)
                compressed.append(c)
                extra += cut
                extra_image += cut_image
            text = processor.get_text_with_replacements([prompt], images_replacements=compressed)
            text = text[0][0]
        texts[special].append(text)
        pending.append((special, len(texts[special]) - 1, extra, extra_image, fake, n_units))
    ids = {
        flag: (plan.tokenizer(batch, **plan.text_kwargs[flag])["input_ids"] if batch else [])
        for flag, batch in texts.items()
    }
    out = []
    for i, item in zip(indices, pending):
        if len(item) == 4:  # counted by the fallback
            out.append(item)
            continue
        special, pos, extra, extra_image, fake, n_units = item
        out.append((*_count(plan, i, ids[special][pos], extra, extra_image, fake, n_units), False))
    return out


def _count(
    plan: _Plan,
    index: int,
    ids: Sequence[int],
    extra: int,
    extra_image: int,
    fake: Mapping[str, Any],
    n_units: list[int],
) -> tuple[int, int, int]:
    """``(total, image_tokens, images)`` as ``Family.to_sample`` counts them, from the ids of the
    compressed text plus the tokens cut from it."""
    total = len(ids) + extra
    is_image = np.asarray(ids, dtype=np.int64) == plan.image_id
    n_image = int(is_image.sum()) + extra_image
    if (n_image > 0) != bool(n_units):
        raise ValueError(
            f"record {index}: {n_image} image tokens (id {plan.image_id}) for {len(n_units)} images"
        )
    if not n_units:
        return total, 0, 0
    # the family's own split into per-image token counts (and its refusals), on stand-ins:
    # the grid / resized sizes the image processor would return, and an image-token mask with
    # the same number of tokens and of runs as the expanded text's
    fam = plan.family
    fields: dict[str, torch.Tensor] = {}
    if fam.layout == "mrope":
        fields["image_grid_thw"] = torch.as_tensor(fake["image_grid_thw"]).reshape(-1, 3)
    elif fam.layout == "sized":
        fields["image_sizes"] = torch.as_tensor(fake["image_sizes"]).reshape(-1, 2).long()
    runs = int(is_image[0]) + int(np.count_nonzero(is_image[1:] & ~is_image[:-1]))
    mask = np.zeros(n_image + runs - 1, dtype=bool)
    mask[: n_image - runs + 1] = True
    mask[n_image - runs + 2 :: 2] = True
    sizes = fam._tokens_per_image(fields, torch.from_numpy(mask), sum(n_units), index)
    return total, int(sum(sizes)), len(sizes)


def _fallback(
    plan: _Plan, index: int, prompt: str, image_sizes: list[tuple[int, int]], special: bool
) -> tuple[int, int, int, bool]:
    """Exact counts for settings the size rules do not cover: the real processor on blank images
    of these sizes, counted by the family as ``item_lengths`` counts it."""
    from PIL import Image

    images = [Image.new("RGB", (w, h)) for h, w in image_sizes]
    kwargs = {} if special else {"add_special_tokens": False}
    out = plan.processor(text=prompt, images=[images], return_tensors="pt", **kwargs)
    item = {k: v for k, v in out.items() if k != "assistant_masks"}
    sample = plan.family.to_sample(item, index, positions=False)
    sizes = sample.get("image_sizes", [])
    return int(sample["input_ids"].numel()), int(sum(sizes)), len(sizes), True


# --------------------------------------------------------------------------------------------
# 5. fingerprints and length tables
# --------------------------------------------------------------------------------------------
_VOLATILE = ("processor_class", "_processor_class", "auto_map", "_valid_processor_keys")
_NOT_SETTINGS = (
    "image_processor",
    "video_processor",
    "feature_extractor",
    "audio_tokenizer",
    "tokenizer",
    "chat_template",
)


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (dicts, lists, numbers, strings); objects by class name."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if hasattr(value, "items"):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _digest(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _hash64(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "little")


def _record_hashes(records: ChatRecords) -> tuple[np.ndarray, np.ndarray]:
    """Per record: a hash of its resolved image paths and messages, and one of its image files'
    sizes and modification times (a missing file hashes as missing)."""
    content = np.empty(len(records), dtype=np.uint64)
    files = np.empty(len(records), dtype=np.uint64)
    for i, record in enumerate(records.records):
        paths = [str(p) for p in records.image_paths(i)]
        content[i] = _hash64(
            json.dumps([paths, record.get("messages")], sort_keys=True, default=str)
        )
        stats = []
        for p in paths:
            try:
                st = os.stat(p)
                stats.append(f"{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                stats.append("missing")
        files[i] = _hash64("|".join(stats))
    return content, files


def _tokenizer_parts(tok: Any) -> dict[str, Any]:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    special = {
        "special_tokens_map": _jsonable(getattr(tok, "special_tokens_map", {})),
        "added": sorted(tok.get_added_vocab().items(), key=lambda kv: kv[1]),
    }
    backend = getattr(tok, "_tokenizer", None)
    pipeline = None
    if backend is not None and hasattr(backend, "to_str"):
        spec = json.loads(backend.to_str())
        spec.get("model", {}).pop("vocab", None)  # the vocabulary is hashed on its own
        spec.pop("added_tokens", None)
        pipeline = _digest(json.dumps(spec, sort_keys=True))
    return {
        "tokenizer class": type(tok).__name__,
        "tokenizer vocab": _digest(json.dumps(vocab)),
        "tokenizer special tokens": _digest(json.dumps(special, sort_keys=True, default=str)),
        "tokenizer pipeline": pipeline,
    }


def length_fingerprint(records: ChatRecords, *, config: Any | None = None) -> dict[str, Any]:
    """What the lengths of ``records`` depend on (see the module docstring): JSON data, plus
    ``"_hashes"``: per record, the hash of its image paths and messages and the hash of its
    image files' sizes and modification times (two ``uint64`` arrays).

    Reads the processor's settings, tokenizer and chat template, the records and the image
    files' ``stat``; runs neither the processor nor the chat template."""
    import tokenizers
    import transformers

    processor = records.processor
    ip = getattr(processor, "image_processor", None)
    settings = {
        k: v
        for k, v in _jsonable(processor.to_dict()).items()
        if k not in _VOLATILE and k not in _NOT_SETTINGS
    }
    ip_settings = {}
    if ip is not None:
        ip_settings = {k: v for k, v in _jsonable(ip.to_dict()).items() if k not in _VOLATILE}
    template = getattr(processor, "chat_template", None)
    family = _family(processor, config).name
    return {
        "format": TABLE_FORMAT,
        "family": family,
        "processor class": type(processor).__name__,
        "processor settings": settings,
        "image processor class": type(ip).__name__ if ip is not None else None,
        "image processor settings": ip_settings,
        **_tokenizer_parts(processor.tokenizer),
        "chat template": _digest(json.dumps(template, sort_keys=True, default=str)),
        "transformers version": transformers.__version__,
        "tokenizers version": tokenizers.__version__,
        "record count": len(records),
        "_hashes": _record_hashes(records),
    }


def save_length_table(
    path: str | Path, lengths: ItemLengths, fingerprint: Mapping[str, Any]
) -> None:
    """Writes ``lengths`` with ``fingerprint`` (from :func:`length_fingerprint` of the same
    records) to ``path``, a ``.npz`` file (format in the module docstring; written to a
    temporary name first, then moved into place).

    Raises:
        ValueError: the lengths and the fingerprint's record count differ.
    """
    count = int(fingerprint["record count"])
    if any(len(x) != count for x in lengths):
        raise ValueError(
            f"save_length_table: {len(lengths.total_tokens)} lengths for a fingerprint of"
            f" {count} records"
        )
    content, files = fingerprint["_hashes"]
    data = {k: v for k, v in fingerprint.items() if k != "_hashes"}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        total_tokens=np.asarray(lengths.total_tokens, dtype=np.int64),
        image_tokens=np.asarray(lengths.image_tokens, dtype=np.int64),
        images=np.asarray(lengths.images, dtype=np.int64),
        record_hashes=np.asarray(content, dtype=np.uint64),
        file_hashes=np.asarray(files, dtype=np.uint64),
        fingerprint=np.frombuffer(json.dumps(data, sort_keys=True).encode("utf-8"), np.uint8),
    )
    os.replace(tmp, path)


def load_length_table(
    path: str | Path, records: ChatRecords, *, config: Any | None = None
) -> ItemLengths:
    """The lengths saved at ``path``, after checking that they are the lengths of ``records``
    with its processor (fingerprint and per-record hashes); runs no processor.

    Raises:
        ValueError: the table is stale, naming every difference (settings with their saved and
            current values, the first changed records), or is not a length table.
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            saved = json.loads(bytes(z["fingerprint"]).decode("utf-8"))
            arrays = {k: z[k] for k in z.files if k != "fingerprint"}
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"length table {path}: not a readable length table ({e})") from e
    now = length_fingerprint(records, config=config)
    problems = _differences(saved, {k: v for k, v in now.items() if k != "_hashes"})
    if not problems:
        content, files = now["_hashes"]
        problems += _changed_records("records content", arrays["record_hashes"], content)
        problems += _changed_records(
            "image files (size or modification time)", arrays["file_hashes"], files
        )
    if problems:
        raise ValueError(f"length table {path} is stale: " + "; ".join(problems))
    return ItemLengths(
        arrays["total_tokens"].astype(np.int64),
        arrays["image_tokens"].astype(np.int64),
        arrays["images"].astype(np.int64),
    )


def _changed_records(what: str, saved: np.ndarray, now: np.ndarray) -> list[str]:
    changed = np.flatnonzero(saved != now)
    if not len(changed):
        return []
    first = ", ".join(str(int(i)) for i in changed[:5])
    more = f" (and {len(changed) - 5} more)" if len(changed) > 5 else ""
    return [f"{what} changed for {len(changed)} records: {first}{more}"]


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    out = []
    for key in now:
        a, b = saved.get(key), now[key]
        if a == b:
            continue
        if key in ("processor settings", "image processor settings"):
            label = "image processor setting" if key.startswith("image") else "processor setting"
            flat_a, flat_b = _flatten(a or {}), _flatten(b or {})
            for k in sorted(set(flat_a) | set(flat_b)):
                if flat_a.get(k, "<unset>") != flat_b.get(k, "<unset>"):
                    out.append(
                        f"{label} {k}: saved {flat_a.get(k, '<unset>')},"
                        f" now {flat_b.get(k, '<unset>')}"
                    )
        elif key in ("tokenizer vocab", "tokenizer special tokens", "tokenizer pipeline"):
            out.append(f"{key} changed")
        elif key == "chat template":
            out.append("chat template changed")
        else:
            out.append(f"{key}: saved {a}, now {b}")
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, name + "."))
        else:
            out[name] = json.dumps(v) if isinstance(v, list | dict) else v
    return out
