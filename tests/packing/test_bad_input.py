"""Bad length tables and bad dataset items raise errors that name the sample and the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_vlmbalance as vb
from lightning_vlmbalance.packing.collate import PackItem


def test_nan_length_is_named() -> None:
    """A NaN used to become -9223372036854775808 tokens (and a numpy cast warning)."""
    total = np.array([10.0, 12.0, 9.0, np.nan, 11.0])
    with pytest.raises(ValueError, match=r"sample 3 has nan in length table column 'total_tokens'"):
        vb.PackingSampler(total, seq_len=32, num_replicas=1, rank=0)
    image = np.array([0, 0, np.inf, 0, 0])
    with pytest.raises(ValueError, match=r"sample 2 has inf in length table column 'image_tokens'"):
        vb.PackingSampler([10, 12, 9, 8, 11], image, seq_len=32, num_replicas=1, rank=0)


def test_non_integral_length_is_refused() -> None:
    """10.7 used to be cut to 10 silently; 10.0 (a CSV float) is fine."""
    with pytest.raises(ValueError, match=r"sample 1 has a non-integral length 10.7"):
        vb.PackingSampler([12, 10.7, 9], seq_len=32, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"non-integral length 10.7 in length table column"):
        vb.build_epoch_plan(
            np.array([12.0, 10.7]),
            np.zeros(2),
            vb.PackingConfig(seq_len=32),
            num_replicas=1,
            epoch=0,
        )
    sampler = vb.PackingSampler(np.array([12.0, 10.0, 9.0]), seq_len=32, num_replicas=1, rank=0)
    assert sampler.total_tokens.dtype == np.int64 and sampler.total_tokens.tolist() == [12, 10, 9]


def test_non_numeric_column_is_refused() -> None:
    with pytest.raises(ValueError, match=r"column 'total_tokens' must hold integers"):
        vb.PackingSampler(["12", "10"], seq_len=32, num_replicas=1, rank=0)


class _Items(torch.utils.data.Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def _first_batch(items: list, total: list[int], image: list[int] | None = None) -> dict:
    sampler = vb.PackingSampler(total, image, seq_len=64, num_replicas=1, rank=0, shuffle=False)
    loader = vb.PackedDataLoader(
        _Items(items), sampler, vb.PackCollator(64, image_feature_shape=(2,))
    )
    return next(iter(loader))


def test_item_without_input_ids_is_named() -> None:
    items = [{"input_ids": torch.arange(5)}, {"tokens": torch.arange(4)}]
    with pytest.raises(ValueError, match=r"sample 1 has no 'input_ids' \(it has \['tokens'\]\)"):
        _first_batch(items, [5, 4])


def test_item_with_images_but_no_positions_is_named() -> None:
    items = [
        {"input_ids": torch.arange(5)},
        {"input_ids": torch.arange(6), "pixel_values": torch.ones(2, 2), "image_sizes": [2]},
    ]
    with pytest.raises(ValueError, match=r"sample 1 has no 'image_positions'"):
        _first_batch(items, [5, 6], [0, 2])


def test_tuple_item_is_named() -> None:
    """A tuple item used to fail with 'tuple indices must be integers or slices, not str'."""
    items = [(torch.arange(5), None), (torch.arange(4), None)]
    with pytest.raises(ValueError, match=r"sample 0 is a tuple; a dataset item must be a dict"):
        _first_batch(items, [5, 4])
    # the collator alone, given tuples: not mistaken for the loader's (pack, sample, item) triples
    with pytest.raises(ValueError, match=r"sample 0 is a tuple"):
        vb.PackCollator(16)([(torch.arange(5), None, None)])


def _refused_everywhere(bad: dict, match: str) -> None:
    """``bad`` is refused, named by its place in a plain list, by its dataset index in a pack from
    ``PackedDataLoader``, and by the length check that the loader runs on every sample."""
    collate = vb.PackCollator(64, image_feature_shape=(2,))
    text = {"input_ids": torch.arange(5)}
    with pytest.raises(ValueError, match=match.format(sid=1)):
        collate([text, bad])
    with pytest.raises(ValueError, match=match.format(sid=7)):
        collate([PackItem(0, 3, text), PackItem(0, 7, bad)])
    with pytest.raises(ValueError, match=match.format(sid=4)):
        collate.sample_lengths(bad, 4)


def test_image_positions_without_images_are_named() -> None:
    """Image placeholder tokens are never training targets: a sample with image positions but no
    images is refused. It used to be collated as text, its positions dropped and its 2
    placeholder tokens trained."""
    match = r"sample {sid} has 2 'image_positions' but no images"
    bad = {"input_ids": torch.arange(6), "image_positions": torch.tensor([1, 2])}
    _refused_everywhere(bad, match)
    _refused_everywhere({**bad, "image_sizes": []}, match)
    _refused_everywhere({**bad, "pixel_values": torch.zeros(0, 2)}, match)
    # no positions at all is a text-only sample
    text = {"input_ids": torch.arange(6), "image_positions": torch.zeros(0, dtype=torch.long)}
    assert vb.PackCollator(8)([text])["loss_tokens"] == 5


def test_image_sizes_without_pixels_are_named() -> None:
    """A sample's images carry their pixels, as ``pixel_values`` rows or in ``image_fields``.
    Without either it used to be collated (2 image positions, 0 pixel rows) and fail later in
    the model with a shape error."""
    bad = {
        "input_ids": torch.arange(6),
        "image_sizes": [2],
        "image_positions": torch.tensor([1, 2]),
    }
    _refused_everywhere(bad, r"sample {sid} has 'image_sizes' \[2\] but no pixels")
    # a model that encodes whole images carries them in image_fields
    whole = {**bad, "image_fields": {"pixel_values": torch.ones(1, 3, 4, 4)}}
    batch = vb.PackCollator(8)([whole])
    assert batch["image_positions"].tolist() == [1, 2]
    assert batch["image_fields"]["pixel_values"].shape == (1, 3, 4, 4)
    assert vb.PackCollator.sample_lengths(whole, 0) == (6, 2)


def test_empty_pixel_values_with_image_sizes_is_named() -> None:
    """The length check counts the image tokens the collator lays out. An empty ``pixel_values``
    with ``image_sizes=[2]`` used to count 0 image tokens while 2 were laid out."""
    bad = {
        "input_ids": torch.arange(6),
        "pixel_values": torch.zeros(0, 2),
        "image_sizes": [2],
        "image_positions": torch.tensor([1, 2]),
    }
    _refused_everywhere(bad, r"sample {sid}: 'pixel_values' has 0 rows but 'image_sizes' \[2\]")
    # also when image_fields would carry the pixels: an empty pixel_values says "no images"
    _refused_everywhere(
        {**bad, "image_fields": {"pixel_values": torch.ones(1, 3, 4, 4)}},
        r"sample {sid}: 'pixel_values' has 0 rows but 'image_sizes' \[2\]",
    )


def test_pack_of_pixel_rows_and_whole_images_is_named() -> None:
    """A pack's ``pixel_values`` hold a row for every image token of the pack: a sample whose
    images are only in ``image_fields`` cannot share a pack with samples of pixel rows (the
    batch had 2 rows for 4 image tokens)."""
    rows = {
        "input_ids": torch.arange(6),
        "pixel_values": torch.ones(2, 2),
        "image_sizes": [2],
        "image_positions": torch.tensor([1, 2]),
    }
    whole = {
        "input_ids": torch.arange(6),
        "image_sizes": [2],
        "image_positions": torch.tensor([1, 2]),
        "image_fields": {"pixel_values": torch.ones(1, 3, 4, 4)},
    }
    with pytest.raises(ValueError, match=r"pack 2: sample\(s\) \[8\] have images without"):
        vb.PackCollator(16)([PackItem(2, 5, rows), PackItem(2, 8, whole)])
    with pytest.raises(ValueError, match=r"pack -1: sample\(s\) \[0\] have images without"):
        vb.PackCollator(16)([whole, rows])


def test_batched_input_ids_are_named() -> None:
    """A sample is one row of tokens: ``input_ids`` of shape (2, 5) used to be fused into one
    10-token document (row 2's first token trained as predicted from row 1) while the length
    check counted 2 tokens. A leading batch dimension of 1 is one sample, counted the same way
    by the length check and the collator."""
    _refused_everywhere(
        {"input_ids": torch.arange(10).reshape(2, 5)},
        r"sample {sid}: input_ids has shape \(2, 5\), a batch of 2",
    )
    _refused_everywhere(
        {"input_ids": torch.arange(5), "labels": torch.arange(10).reshape(2, 5)},
        r"sample {sid}: labels has shape \(2, 5\), a batch of 2",
    )
    one = {"input_ids": torch.arange(5).reshape(1, 5)}
    assert vb.PackCollator.sample_lengths(one, 0) == (5, 0)
    assert vb.PackCollator(8)([one])["meta"]["doc_lens"] == [5]
