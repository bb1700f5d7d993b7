"""Real processors built offline without torchvision (``lightning_vlmbalance.hf.offline``): every
family's own processor class, its chat template with images read from PNG files, labels on the
assistant's tokens only, the output accepted by the tiny model and by ``HFPackCollator``, and the
processor's image-token counts from the image sizes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf
from PIL import Image

import lightning_vlmbalance.hf as vbhf
from lightning_vlmbalance.hf import offline
from lightning_vlmbalance.hf.synthetic import IMAGE_TOKEN, TINY_FAMILIES, tiny_config

SIZES = ((20, 33), (40, 24))  # (height, width)


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("png")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(SIZES):
        path = root / f"{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def test_a_video_family_processor_fails_without_torchvision_as_documented():
    """The failure the module works around (if transformers fixes it, drop the workaround)."""
    pytest.importorskip("PIL")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed: the ordinary constructor works")
    special, named, _ = offline.family_tokens("qwen2_5_vl")
    tok = offline.tiny_tokenizer(special, named=named)
    with pytest.raises((AttributeError, TypeError), match=r"_extra_content|NoneType"):
        tf.Qwen2_5_VLProcessor(
            image_processor=tf.Qwen2VLImageProcessorPil(), tokenizer=tok, video_processor=None
        )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_real_processor_offline_through_chat_template_model_and_collator(family, pngs):
    torch.manual_seed(0)
    config = tiny_config(family)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    proc = offline.tiny_processor(family, config)
    module = type(proc).__module__
    assert module.startswith("transformers.models."), module  # the family's own class
    images = [Image.open(p) for p in pngs]
    one = family == "llava_onevision"  # its encoder balancing tiles single-image samples only
    content = [{"type": "image", "image": im} for im in images[: 1 if one else 2]]
    messages = [
        {"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    out = proc.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    labels = offline.labels_from_assistant_mask(out)
    item = {k: v for k, v in out.items() if k != "assistant_masks"}
    ids = item["input_ids"][0].tolist()
    assert max(ids) < config.get_text_config().vocab_size
    assert proc.tokenizer.decode([i for i in labels[0].tolist() if i != -100]) == "a cat.<eos>"
    sizes = [im.size[::-1] for im in images[: len(content)]]
    assert sum(offline.num_image_tokens(proc, sizes)) == ids.count(IMAGE_TOKEN)
    with torch.no_grad():
        loss = model(**item, labels=labels).loss
    assert torch.isfinite(loss)
    # the packed loader takes the processor's output as it is, labels included
    item["labels"] = labels
    batch = vbhf.HFPackCollator(config, seq_len=len(ids) + 4)([item])
    assert batch["labels"][0, : len(ids)].tolist()[1:] == labels[0].tolist()[1:]
    assert batch["meta"]["image_tokens"] == ids.count(IMAGE_TOKEN)
