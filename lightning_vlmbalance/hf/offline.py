"""Real Hugging Face ``*Processor`` objects built offline, without torchvision.

In transformers 5.24-5.25 a processor whose family also has a video processor (Qwen-VL,
InternVL, GLM-4.1V, LLaVA-OneVision, SmolVLM, Gemma 4) cannot be built without torchvision,
not even with ``video_processor=None``: ``ProcessorMixin.__init__`` type-checks every component,
``None`` included, against ``VideoProcessorMixin``, which transformers exports only with
torchvision, and the fallback lookup fails with ``VIDEO_PROCESSOR_MAPPING ... _extra_content``
(upstream: huggingface/transformers#43986, #48556). There is no supported switch. The supported
way is to install torchvision; without it, :func:`processor_without_video` builds the real
processor class from its components (the image processor's PIL class, the tokenizer) with no
video processor, changing nothing global.

For tests and the recipe, with transformers 5.25 on CPU and no hub access:

* :func:`tiny_tokenizer` builds a small ``TokenizersBackend`` (the v5 name of
  ``PreTrainedTokenizerFast``) in memory: a char-level ``WordLevel`` model whose ids are all
  ``< vocab_size`` (128), with the family's special tokens at fixed ids and the named attributes
  the processors read (``tokenizer.image_token``, ``tokenizer.image_token_id``, ``boi_token`` ...).
* :func:`tiny_processor` constructs the real processor class (``Qwen2_5_VLProcessor``,
  ``Gemma3Processor`` ...) with a PIL image processor, that tokenizer, a minimal chat template,
  and no video processor. The known ``VIDEO_PROCESSOR_MAPPING ... _extra_content`` crash
  (see :func:`processor_without_video`) is avoided without touching global state.
* :func:`labels_from_assistant_mask` turns the output of
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``
  output into ``labels`` that train only on assistant tokens.

Token ids match ``lightning_vlmbalance.hf.synthetic``: IMAGE=100, VIDEO=101, VISION_START=102,
VISION_END=103, BOI=104, EOI=105, IMG_BREAK=106, IMG_END=107; text characters use ids 3..~70.
"""

from __future__ import annotations

import string
from typing import Any

from lightning_vlmbalance.hf.synthetic import (
    BOI,
    EOI,
    IMAGE_TOKEN,
    IMG_BREAK,
    IMG_END,
    TINY_FAMILIES,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    tiny_config,
)

__all__ = [
    "FAMILIES",
    "chat_template",
    "expanded_length",
    "family_tokens",
    "image_size_from_header",
    "labels_from_assistant_mask",
    "num_image_tokens",
    "pixtral_processor_class",
    "processor_without_video",
    "tiny_processor",
    "tiny_tokenizer",
]

PAD, EOS, BOS = 0, 1, 2
# characters of the char-level vocabulary, ids 3, 4, ... (upper case is lower-cased first)
CHARS = " \n" + string.ascii_lowercase + string.digits + ".,:;!?'\"-_()/<>|[]{}=+*#@%&"

FAMILIES = TINY_FAMILIES


# --------------------------------------------------------------------------------------------
# 1. tokenizer
# --------------------------------------------------------------------------------------------
def tiny_tokenizer(
    special_tokens: dict[str, int],
    vocab_size: int = 128,
    named: dict[str, str] | None = None,
    *,
    pad_token: str = "<pad>",
    eos_token: str = "<eos>",
    bos_token: str = "<bos>",
) -> Any:
    """A char-level fast tokenizer with every id ``< vocab_size``.

    ``special_tokens`` maps token strings to fixed ids (e.g. ``{"<|image_pad|>": 100}``); they
    are registered as special added tokens, so a placeholder in text is always one id.
    ``named`` maps tokenizer attribute names to token strings
    (``{"image_token": "<|image_pad|>"}``):
    each becomes ``tokenizer.<name>`` and ``tokenizer.<name>_id`` (v5 ``extra_special_tokens``).
    Ids not taken by specials or characters are filled with unused ``<unused_i>`` entries so that
    the vocabulary is exactly ``vocab_size`` long (a token the tokenizer ever *adds* at run time
    would otherwise land on an id that collides or exceeds the model's vocab).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from transformers import TokenizersBackend

    fixed = {pad_token: PAD, eos_token: EOS, bos_token: BOS, **special_tokens}
    taken = set(fixed.values())
    if len(taken) != len(fixed):
        raise ValueError(f"tiny_tokenizer: duplicate ids in {fixed}")
    if max(taken) >= vocab_size:
        raise ValueError(f"tiny_tokenizer: special ids must be < {vocab_size}: {fixed}")
    vocab = dict(fixed)
    free = (i for i in range(vocab_size) if i not in taken)
    for ch in CHARS:
        vocab[ch] = next(free)
    for i in free:
        vocab[f"<unused_{i}>"] = i
    unk = "<unk>" if "<unk>" in vocab else pad_token  # unknown characters map to pad (id 0)

    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"[\s\S]"), behavior="isolated"
    )  # one char each
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fixed])
    tok = TokenizersBackend(
        tokenizer_object=backend,
        pad_token=pad_token,
        eos_token=eos_token,
        bos_token=bos_token,
        unk_token=unk,
        extra_special_tokens=dict(named or {}),
    )
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


# --------------------------------------------------------------------------------------------
# 2. per family: special tokens, named attributes, chat-template image placeholder
# --------------------------------------------------------------------------------------------
_QWEN = {
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": VIDEO_TOKEN,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
}
_QWEN_NAMED = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# Idefics3 / SmolVLM row/col tags: the image processors here split into at most 2x2 crops
# (longest_edge 32, crops of 16), 3x3 leaves room for other settings
_ROWCOL = {f"<row_{i}_col_{j}>": 110 + 3 * (i - 1) + (j - 1) for i in (1, 2, 3) for j in (1, 2, 3)}
_IDEFICS = {
    "<image>": IMAGE_TOKEN,
    "<fake_token_around_image>": 108,
    "<global-img>": 109,
    "<end_of_utterance>": 119,
    **_ROWCOL,
}


def family_tokens(family: str) -> tuple[dict[str, int], dict[str, str], str]:
    """``(special_tokens, named, image_placeholder)`` of ``family``; ``image_placeholder`` is
    what the chat template writes for one ``{"type": "image"}`` entry (the processor expands it)."""
    if family in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        return dict(_QWEN), dict(_QWEN_NAMED), "<|vision_start|><|image_pad|><|vision_end|>"
    if family == "glm4v":
        special = {
            "<|image|>": IMAGE_TOKEN,
            "<|video|>": VIDEO_TOKEN,
            "<|begin_of_image|>": VISION_START,
            "<|end_of_image|>": VISION_END,
            "<|begin_of_video|>": BOI,
            "<|end_of_video|>": EOI,
        }
        named = {"image_token": "<|image|>", "video_token": "<|video|>"}
        return special, named, "<|begin_of_image|><|image|><|end_of_image|>"
    if family == "gemma3":
        special = {
            "<image_soft_token>": IMAGE_TOKEN,
            "<start_of_image>": BOI,
            "<end_of_image>": EOI,
        }
        named = {
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        }
        return special, named, "<start_of_image>"  # Gemma3Processor expands the boi token
    if family == "gemma4":
        special = {
            "<|image|>": IMAGE_TOKEN,
            "<|video|>": VIDEO_TOKEN,  # Gemma4Processor.__init__ adds it
            "<|image>": BOI,
            "<image|>": EOI,
            "<|audio|>": IMG_BREAK,  # tiny_config's audio_token_id
            "<|audio>": 108,
            "<audio|>": 109,
        }
        named = {
            "image_token": "<|image|>",
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            # Gemma4Processor.validate_inputs raises unless boa/eoa tokens exist
            # (an operator-precedence slip, processing_gemma4.py:187)
            "audio_token": "<|audio|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
        }
        return special, named, "<|image|>"
    if family == "internvl":
        special = {
            "<IMG_CONTEXT>": IMAGE_TOKEN,
            "<video>": VIDEO_TOKEN,
            "<img>": BOI,
            "</img>": EOI,
        }
        named = {
            "context_image_token": "<IMG_CONTEXT>",
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "video_token": "<video>",
        }
        return special, named, "<IMG_CONTEXT>"
    if family in ("mistral3", "pixtral"):
        special = {"[IMG]": IMAGE_TOKEN, "[IMG_BREAK]": IMG_BREAK, "[IMG_END]": IMG_END}
        return special, {}, "[IMG]"
    if family in ("smolvlm", "idefics3"):
        named = {}
        if family == "smolvlm":
            special = {**_IDEFICS, "<video>": VIDEO_TOKEN}
            named = {
                "image_token": "<image>",
                "fake_image_token": "<fake_token_around_image>",
                "global_image_token": "<global-img>",
                "end_of_utterance_token": "<end_of_utterance>",
                "video_token": "<video>",
            }
        else:
            special = dict(_IDEFICS)
        return special, named, "<image>"
    if family == "llava_onevision":
        special = {"<image>": IMAGE_TOKEN, "<video>": VIDEO_TOKEN}
        return special, {"image_token": "<image>", "video_token": "<video>"}, "<image>"
    raise ValueError(f"family_tokens: unknown family {family!r} (have {FAMILIES})")


# --------------------------------------------------------------------------------------------
# 3. chat template
# --------------------------------------------------------------------------------------------
def chat_template(image_placeholder: str, end_of_turn: str = "<eos>", bos: str = "<bos>") -> str:
    """A minimal Jinja chat template: ``<bos>role:content<eos>\\n`` per message, each
    ``{"type": "image"}`` entry rendered as ``image_placeholder``, the assistant turns (content and
    end-of-turn token) wrapped in ``{% generation %}`` so that ``return_assistant_tokens_mask=True``
    marks them."""
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- else -%}{%- for c in content -%}"
        "{%- if c['type'] == 'image' or c['type'] == 'image_url' -%}{{- '"
        + image_placeholder
        + "' -}}"
        "{%- elif c['type'] == 'text' -%}{{- c['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{{- '" + bos + "' -}}"
        "{%- for message in messages -%}"
        "{{- message['role'] + ':' -}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}{{- render(message['content']) -}}{{- '"
        + end_of_turn
        + "' -}}{%- endgeneration -%}"
        "{%- else -%}{{- render(message['content']) -}}{{- '" + end_of_turn + "' -}}{%- endif -%}"
        "{{- '\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
    )


def labels_from_assistant_mask(out: Any, ignore_index: int = -100) -> Any:
    """``labels`` from ``apply_chat_template(..., return_dict=True, return_tensors="pt",
    return_assistant_tokens_mask=True)``: ``input_ids`` where ``assistant_masks`` is 1,
    ``ignore_index`` elsewhere."""
    import torch

    ids = out["input_ids"]
    mask = torch.as_tensor(out["assistant_masks"], dtype=torch.bool)
    return torch.where(mask, ids, torch.full_like(ids, ignore_index))


# --------------------------------------------------------------------------------------------
# 4. processor construction
# --------------------------------------------------------------------------------------------
class _NoVideoProcessor:
    """Stand-in for a video processor (which needs torchvision):
    SmolVLMProcessor.apply_chat_template
    reads ``video_processor.num_frames`` / ``.fps`` even for image-only chats."""

    num_frames = None
    fps = None
    model_input_names: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("offline processor: videos need torchvision's video processor")


def processor_without_video(cls: type, /, **components: Any) -> Any:
    """``cls(**components)`` where ``components`` may hold ``video_processor=None`` (or a stand-in).

    ``ProcessorMixin.__init__`` (processing_utils.py:732-734) type-checks *every* sub-processor,
    ``None`` included, via ``check_argument_for_proper_class`` (:1136-1157). For a
    ``video_processor`` that looks up ``"VideoProcessorMixin"`` (:156), which transformers only
    exports with torchvision (``__init__.py``:323-335), so ``get_possibly_dynamic_module``
    (:2136-2159)
    falls through to the lookup mappings, whose ``VIDEO_PROCESSOR_MAPPING`` is then a torchvision
    dummy without ``_extra_content`` -> ``AttributeError`` (with torchvision it would be
    ``TypeError: Received a NoneType for argument video_processor``). The check is looked up on the
    instance, so shadowing it on this one instance during ``__init__`` lets a missing video
    processor through and leaves every class, and all other checks, unchanged. The result is an
    instance of exactly ``cls``.
    """
    proc = cls.__new__(cls)
    original = proc.check_argument_for_proper_class

    def check(argument_name: str, argument: Any) -> Any:
        if argument is None or isinstance(argument, _NoVideoProcessor):
            return None
        return original(argument_name, argument)

    proc.check_argument_for_proper_class = check
    try:
        proc.__init__(**components)
    finally:
        proc.__dict__.pop("check_argument_for_proper_class", None)
    return proc


def pixtral_processor_class() -> type:
    """The real ``PixtralProcessor`` class without torchvision.

    ``transformers.PixtralProcessor`` is a torchvision dummy (``@requires(backends=("torchvision",
    "torch"))``, processing_pixtral.py:38), and ``processing_pixtral`` cannot even be imported:
    at :17-18 it imports ``get_resize_output_image_size`` from ``image_processing_pixtral``, whose
    line 19 imports torchvision. That function is identical in ``image_processing_pil_pixtral``
    (:66-106 vs :49-88), so for the duration of the import only, a stand-in module that exposes the
    PIL copy takes the torchvision module's place in ``sys.modules``; it is removed afterwards.
    """
    import importlib
    import sys
    import types

    name = "transformers.models.pixtral.processing_pixtral"
    if name in sys.modules:
        return sys.modules[name].PixtralProcessor
    tv_name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        importlib.import_module(tv_name)  # torchvision present: the ordinary import works
    except ImportError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        shim = types.ModuleType(tv_name)
        shim.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[tv_name] = shim
        try:
            return importlib.import_module(name).PixtralProcessor
        finally:
            if sys.modules.get(tv_name) is shim:
                del sys.modules[tv_name]
    return importlib.import_module(name).PixtralProcessor


def _num2words_missing(*args: Any, **kwargs: Any) -> str:
    raise ImportError("num2words is not installed (SmolVLMProcessor needs it only for videos)")


def _side(config: Any) -> int:
    side = config.vision_config.image_size
    return side if isinstance(side, int) else int(side[0])


def tiny_processor(family: str, config: Any | None = None, **overrides: Any) -> Any:
    """The real processor of ``family``, offline, with image settings matching ``config``
    (default: ``lightning_vlmbalance.hf.synthetic.tiny_config(family)``).

    ``overrides`` replace processor init kwargs (e.g. ``chat_template=...``)."""
    import transformers as tf

    if config is None:
        config = tiny_config(family)
    special, named, placeholder = family_tokens(family)
    tok = tiny_tokenizer(special, vocab_size=config.get_text_config().vocab_size, named=named)
    template = chat_template(placeholder)
    vc = config.vision_config
    kw: dict[str, Any] = {"tokenizer": tok, "chat_template": template}

    if family.startswith("qwen") or family == "glm4v":
        if family == "glm4v":
            ip = tf.Glm4vImageProcessorPil(
                patch_size=vc.patch_size,
                merge_size=vc.spatial_merge_size,
                temporal_patch_size=vc.temporal_patch_size,
                size={"shortest_edge": 64, "longest_edge": 48 * 48},
            )
            cls = tf.Glm4vProcessor
        else:
            ip = tf.Qwen2VLImageProcessorPil(
                patch_size=vc.patch_size,
                merge_size=vc.spatial_merge_size,
                temporal_patch_size=vc.temporal_patch_size,
                size={"shortest_edge": 64, "longest_edge": 48 * 48},  # = min_pixels / max_pixels
            )
            cls = {"qwen2_vl": tf.Qwen2VLProcessor, "qwen2_5_vl": tf.Qwen2_5_VLProcessor}.get(
                family, tf.Qwen3VLProcessor
            )
        kw.update(image_processor=ip, video_processor=None)
    elif family == "gemma3":
        side = _side(config)
        ip = tf.Gemma3ImageProcessorPil(size={"height": side, "width": side})
        cls = tf.Gemma3Processor
        kw.update(image_processor=ip, image_seq_length=config.mm_tokens_per_image)
    elif family == "gemma4":
        ip = tf.Gemma4ImageProcessorPil(
            patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size, max_soft_tokens=70
        )
        cls = tf.Gemma4Processor
        kw.update(
            feature_extractor=None, image_processor=ip, video_processor=None, image_seq_length=70
        )
    elif family == "internvl":
        side = _side(config)
        ip = tf.GotOcr2ImageProcessorPil(
            size={"height": side, "width": side}, crop_to_patches=True, min_patches=1, max_patches=6
        )
        cls = tf.InternVLProcessor
        kw.update(
            image_processor=ip, video_processor=None, image_seq_length=config.image_seq_length
        )
    elif family == "mistral3":
        cell = vc.patch_size * config.spatial_merge_size
        ip = tf.PixtralImageProcessorPil(
            size={"longest_edge": 32}, patch_size={"height": cell, "width": cell}
        )
        cls = pixtral_processor_class()
        kw.update(
            image_processor=ip,
            patch_size=vc.patch_size,
            spatial_merge_size=config.spatial_merge_size,
        )
    elif family in ("smolvlm", "idefics3"):
        side = _side(config)
        seq = (side // vc.patch_size) ** 2 // config.scale_factor**2
        if family == "smolvlm":
            ip = tf.SmolVLMImageProcessorPil(
                size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
            )
            cls = tf.SmolVLMProcessor
            kw.update(video_processor=_NoVideoProcessor())
        else:
            ip = tf.Idefics3ImageProcessorPil(
                size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
            )
            cls = tf.Idefics3Processor
        kw.update(image_processor=ip, image_seq_len=seq)
    elif family == "llava_onevision":
        side = _side(config)
        ip = tf.LlavaOnevisionImageProcessorPil(
            size={"height": side, "width": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=config.image_grid_pinpoints,
        )
        cls = tf.LlavaOnevisionProcessor
        kw.update(
            image_processor=ip,
            video_processor=None,
            num_image_tokens=(side // vc.patch_size) ** 2,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            vision_aspect_ratio=config.vision_aspect_ratio,
        )
    else:
        raise ValueError(f"tiny_processor: unknown family {family!r} (have {FAMILIES})")
    kw.update(overrides)
    if family != "smolvlm":
        return processor_without_video(cls, **kw)
    # SmolVLMProcessor.__init__ (processing_smolvlm.py:126-129) refuses to build without the
    # `num2words` package, which only its video prompt uses (:181): lend a stand-in for __init__
    from transformers.models.smolvlm import processing_smolvlm

    if processing_smolvlm.num2words is not None:
        return processor_without_video(cls, **kw)
    processing_smolvlm.num2words = _num2words_missing
    try:
        return processor_without_video(cls, **kw)
    finally:
        processing_smolvlm.num2words = None


# --------------------------------------------------------------------------------------------
# 5. image-token counts from the image size alone (no pixel decoding)
# --------------------------------------------------------------------------------------------
def image_size_from_header(path: str) -> tuple[int, int]:
    """``(height, width)`` as the processor will see the image (EXIF orientation applied, as
    transformers' ``load_image`` applies it), from the file's header: see
    :func:`lightning_vlmbalance.hf.lengths.image_size` (Pillow's own EXIF read of a PNG decodes
    the whole image)."""
    from lightning_vlmbalance.hf.lengths import image_size

    return image_size(path)


def num_image_tokens(
    processor: Any, image_sizes: list[tuple[int, int]], **kwargs: Any
) -> list[int]:
    """Per image, how many ``processor.image_token_id`` tokens the processor puts in a sample that
    holds images of these ``(height, width)`` sizes (one sample: the list is that sample's images).

    Delegates to the processor's own ``_get_num_multimodal_tokens(image_sizes=...)`` (present on all
    11 processors in 5.25; ``kwargs`` are processor call kwargs, e.g. ``size=...``), with the two
    cases where that API disagrees with the real output fixed:
    * LlavaOnevisionProcessor, >1 image in the sample: each image is the base view plus one newline
      (``num_image_tokens + 1``, processing_llava_onevision.py:84-85), whatever its size;
    * Gemma3Processor with ``do_pan_and_scan``: the API ignores the crops
      (processing_gemma3.py:134-135);
      use :func:`expanded_length` then.
    """
    name = type(processor).__name__
    if name == "LlavaOnevisionProcessor" and len(image_sizes) > 1:
        n = (
            processor.num_image_tokens
            + 1
            - int(processor.vision_feature_select_strategy == "default")
        )
        return [n] * len(image_sizes)
    # Gemma3Processor's own images_kwargs decide (its class default overrides the image
    # processor's attribute)
    pan_and_scan = kwargs.get(
        "do_pan_and_scan", (getattr(processor, "images_kwargs", None) or {}).get("do_pan_and_scan")
    )
    if name == "Gemma3Processor" and pan_and_scan:
        raise NotImplementedError(
            "Gemma3 pan-and-scan: _get_num_multimodal_tokens ignores crops; use expanded_length"
        )
    return list(
        processor._get_num_multimodal_tokens(image_sizes=list(image_sizes), **kwargs)[
            "num_image_tokens"
        ]
    )


def expanded_length(
    processor: Any, text: str, image_sizes: list[tuple[int, int]], **kwargs: Any
) -> int:
    """Exact ``len(input_ids)`` of ``processor(text=text, images=<images of these sizes>)`` for one
    sample, from the sizes alone: runs the real processor on black images of those sizes (the
    token layout never depends on pixel values). Covers what :func:`num_image_tokens` does not:
    break / start / end / row-col / newline tokens and tokenizer-dependent text in the expansion."""
    from PIL import Image

    images = [Image.new("RGB", (w, h)) for h, w in image_sizes]
    nested = type(processor).__name__ in (
        "LlavaOnevisionProcessor",
        "Idefics3Processor",
        "SmolVLMProcessor",
        "Gemma3Processor",
        "Gemma4Processor",
    )
    out = processor(text=text, images=[images] if nested else images, **kwargs)
    return len(out["input_ids"][0])
