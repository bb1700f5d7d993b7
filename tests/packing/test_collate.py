"""PackCollator: the PackedBatch fields and their invariants."""

from __future__ import annotations

import pytest
import torch

from lightning_vlmbalance import IGNORE_INDEX, PackCollator
from lightning_vlmbalance.packing.collate import PackItem


def _image_sample(n_text: int, n_image: int, images: int = 1, dim: int = 3, base: int = 10):
    ids = torch.cat(
        [
            torch.tensor([base]),
            torch.ones(n_image, dtype=torch.long),
            torch.arange(base + 1, base + n_text),
        ]
    )
    sizes = [n_image // images] * images
    sizes[-1] += n_image - sum(sizes)
    return {
        "input_ids": ids,
        "pixel_values": torch.arange(n_image * dim, dtype=torch.float32).reshape(n_image, dim)
        + base,
        "image_sizes": sizes,
        "image_positions": torch.arange(1, 1 + n_image),
    }


def test_fields_of_a_packed_batch() -> None:
    """Positions restart per document, cu_seqlens cover the pack, labels never cross documents,
    and image rows land on their placeholder positions."""
    a = _image_sample(5, 4, images=2, base=100)
    b = {"input_ids": torch.arange(200, 206)}
    c = _image_sample(3, 2, base=300)
    batch = PackCollator(24, image_feature_shape=(3,))([a, b, c])
    T = 24
    assert (
        batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, T)
    )
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 9, 15, 20, 24]  # the padding tail is a segment
    assert batch["max_seqlen"] == 9 and isinstance(batch["max_seqlen"], int)
    assert batch["position_ids"][0].tolist() == [*range(9), *range(6), *range(5), *range(4)]
    labels = batch["labels"][0]
    assert labels[[0, 9, 15]].tolist() == [IGNORE_INDEX] * 3  # document starts
    assert (labels[20:] == IGNORE_INDEX).all()  # padding
    assert (labels[batch["image_positions"]] == IGNORE_INDEX).all()
    assert batch["image_cu_seqlens"].tolist() == [0, 2, 4, 6]
    assert batch["image_max_seqlen"] == 2
    assert batch["image_positions"].tolist() == [1, 2, 3, 4, 16, 17]
    assert torch.equal(batch["pixel_values"], torch.cat([a["pixel_values"], c["pixel_values"]]))
    ids = batch["input_ids"][0]
    assert (ids[batch["image_positions"]] == 1).all()
    # targets: every labelled token of the pack except document starts, images and padding
    assert batch["loss_tokens"] == int((labels[1:] != IGNORE_INDEX).sum()) == 4 + 5 + 2
    assert batch["global_loss_tokens"] == batch["loss_tokens"]
    assert batch["meta"]["doc_lens"] == [9, 6, 5]
    assert batch["meta"]["images"] == 3 and batch["meta"]["image_tokens"] == 6
    assert batch["meta"]["total_tokens"] == 20


def test_the_sample_is_not_modified() -> None:
    s = {"input_ids": torch.arange(5), "labels": torch.arange(5)}
    PackCollator(8)([s])
    assert s["labels"].tolist() == [0, 1, 2, 3, 4]


def test_pack_without_images_has_empty_image_fields() -> None:
    batch = PackCollator(8, image_feature_shape=(3,))([{"input_ids": torch.arange(5)}])
    assert batch["pixel_values"].shape == (0, 3)
    assert batch["image_positions"].numel() == 0
    assert batch["image_cu_seqlens"].tolist() == [0]


def test_padding_pack() -> None:
    batch = PackCollator(8)([PackItem(-1, -1, None)])
    assert batch["meta"]["padding"] and batch["loss_tokens"] == 0
    assert batch["cu_seqlens"].tolist() == [0, 8]


def test_text_only_truncation_and_image_samples_never_cut() -> None:
    batch = PackCollator(4, truncate_text=True)([{"input_ids": torch.arange(10)}])
    assert batch["input_ids"][0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sample 0 has 10 tokens, more than `seq_len=4`"):
        PackCollator(4)([{"input_ids": torch.arange(10)}])  # no silent cut by default
    with pytest.raises(ValueError, match="sample 0 has 7 tokens with images"):
        PackCollator(4, truncate_text=True)([_image_sample(3, 4)])


def test_overfull_pack_names_the_sample() -> None:
    items = [
        PackItem(5, 11, {"input_ids": torch.arange(6)}),
        PackItem(5, 12, {"input_ids": torch.arange(6)}),
    ]
    with pytest.raises(ValueError, match="pack 5: sample 12 \\(6 tokens\\) does not fit"):
        PackCollator(8)(items)


def test_inconsistent_image_fields_name_the_sample() -> None:
    s = _image_sample(3, 4)
    s["image_sizes"] = [3]
    with pytest.raises(ValueError, match="sample 0: 4 pixel rows"):
        PackCollator(16)([s])
