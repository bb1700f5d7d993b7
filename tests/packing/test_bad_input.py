"""Bad length tables and bad dataset items raise errors that name the sample and the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_vlmbalance as vb


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
            world_size=1,
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
