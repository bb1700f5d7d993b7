"""Isolation on items built apart from the suite's synthetic generator: real PNG files of many
sizes, through each family's own processor class and chat template (``ChatRecords``), mixed with
text-only conversations, packed into one row; ``check_packing`` must find every document's
logits and gradients equal to the document alone (float64)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf
from PIL import Image

import lightning_vlmbalance.hf as vbhf
from lightning_vlmbalance.hf.offline import tiny_processor
from lightning_vlmbalance.hf.records import ChatRecords
from lightning_vlmbalance.hf.synthetic import tiny_config

# (height, width) of each record's images: wide, tall, tiny, several, none
IMAGES = [[(17, 61)], [], [(64, 13), (30, 30)], [(12, 12)], [], [(45, 37)]]


def _records(root) -> list[dict]:
    rng = np.random.default_rng(11)
    out = []
    for i, sizes in enumerate(IMAGES):
        paths = []
        for j, (h, w) in enumerate(sizes):
            name = f"{i}_{j}.png"
            Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(root / name)
            paths.append(name)
        words = " ".join(["describe"] * (2 + 9 * (not sizes)))  # text-only turns run longer
        user = [{"type": "image"} for _ in paths] + [{"type": "text", "text": f"{words} {i}"}]
        out.append(
            {
                "images": paths,
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}."}]},
                ],
            }
        )
    return out


@pytest.mark.parametrize("family", ["gemma3", "internvl", "mistral3"])
def test_items_from_the_real_processor_pack_in_isolation(family, tmp_path):
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in _records(tmp_path)))
    config = tiny_config(family)
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config)
    records = ChatRecords(tmp_path / "r.jsonl", tiny_processor(family, config))
    items = [records[i] for i in range(len(records))]
    assert sum("pixel_values" in it for it in items) == 4
    report = vbhf.check_packing(model, items)
    assert report.ok, str(report)
    assert [d.images > 0 for d in report.documents] == [bool(s) for s in IMAGES]
