"""The built-in synthetic data: images of varied sizes (``image_sizes``), the example's default."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlmbalance.balance.cost import sample_features
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


def test_varied_images_span_the_range_and_rank_samples_differently_by_each_feature() -> None:
    """Images from 16 to 768 tokens, 1-3 per sample, image tokens of a sample under 768; the
    image count, the image tokens and the attention within images are no longer one feature
    (as they were with one image of 1-5 tiles per sample)."""
    t = synthetic_length_table(4000, text_share=0.5, tile_tokens=16, image_sizes=(16, 768))
    has = t.images > 0
    assert set(np.unique(t.images[has])) == {1, 2, 3}
    assert ((t.image_tokens == 0) == ~has).all()
    per_image = t.image_tokens[has] // t.images[has]
    assert per_image.min() >= 16 and t.image_tokens.max() <= 768
    assert per_image.max() > 600 and np.median(per_image) < 200  # log-uniform: many small
    f = sample_features(t.total_tokens, t.image_tokens, t.images)
    corr = np.corrcoef([f["images"][has], f["image_tokens"][has], f["image_sq_tokens"][has]])
    assert corr[0, 1] < 0.5 and corr[0, 2] < 0.3  # the count says little of the work
    tiles = synthetic_length_table(4000, text_share=0.5, tile_tokens=16)
    assert set(np.unique(tiles.images[tiles.images > 0])) == {1}
    # text at the real scale (chats of ~700 tokens) instead of the tiles' (16/256 of it)
    real = synthetic_length_table(
        4000, text_share=0.5, tile_tokens=16, image_sizes=(16, 768), text_scale=1.0
    )
    text = real.images == 0
    assert np.median(real.total_tokens[text]) > 8 * np.median(t.total_tokens[t.images == 0])
    assert (real.total_tokens - real.image_tokens).max() <= 2048  # capped: max_text_tokens


def test_the_dataset_lays_out_each_image_of_its_size() -> None:
    t = synthetic_length_table(200, text_share=0.3, tile_tokens=16, image_sizes=(8, 96), seed=3)
    ds = SyntheticVLMDataset(t, vocab_size=32, patch_dim=4)
    for i in np.flatnonzero(t.images > 1)[:5]:
        sample = ds[int(i)]
        sizes = sample["image_sizes"].tolist()
        assert len(sizes) == t.images[i] and sum(sizes) == t.image_tokens[i]
        assert len(set(sizes)) == 1  # one size per sample (the cost features assume it)
        assert sample["pixel_values"].shape == (t.image_tokens[i], 4)


@pytest.mark.parametrize("sizes", [(0, 100), (50, 120), (10, 5)])
def test_a_bad_size_range_is_named(sizes) -> None:
    with pytest.raises(ValueError, match=r"image_sizes=\("):
        synthetic_length_table(10, image_sizes=sizes)
