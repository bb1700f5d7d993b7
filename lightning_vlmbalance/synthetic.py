"""A small built-in multimodal data generator, shaped like real SFT statistics (torch + numpy).

The real InternVL-style sets in the project's benchmarks (ai2d, chartqa, docvqa, synthdog) tile each
image into 1, 3, 4 or 5 tiles of 256 tokens (in proportions of about 9%, 34%, 1% and 56%) and add a
text part of a few dozen to a few hundred tokens; text-only chat samples are log-normally spread and
capped. ``synthetic_length_table`` draws from that shape at any scale (``tile_tokens`` sets the
tokens per tile, so a CPU example can use small packs), and ``SyntheticVLMDataset`` turns a length
table into real samples: token ids, one image's patch features, image-token positions, labels.
The examples and tests use it, so nothing here needs the benchmark data.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["LengthTable", "SyntheticVLMDataset", "read_length_csv", "synthetic_length_table"]

# tiles per image and their frequencies, from the per-sample statistics of the four sets above
_TILES = np.array([1, 3, 4, 5])
_TILE_P = np.array([0.09, 0.34, 0.01, 0.56])


@dataclass(frozen=True, slots=True)
class LengthTable:
    """Per-sample ``total_tokens`` (images included), ``image_tokens`` and ``images``."""

    total_tokens: np.ndarray
    image_tokens: np.ndarray
    images: np.ndarray

    def __len__(self) -> int:
        return len(self.total_tokens)


def synthetic_length_table(
    num_samples: int,
    *,
    text_share: float = 0.2,
    tile_tokens: int = 256,
    max_text_tokens: int = 2048,
    seed: int = 0,
    image_sizes: tuple[int, int] | None = None,
    text_scale: float | None = None,
) -> LengthTable:
    """Draws a length table shaped like a real multimodal SFT mix.

    Args:
        num_samples: samples to draw.
        text_share: fraction of text-only samples.
        tile_tokens: image tokens per tile (256 in InternVL; smaller for CPU examples).
        max_text_tokens: cap of a text-only sample (text parts of image samples scale with
            ``tile_tokens``).
        seed: generator seed.
        image_sizes: ``(smallest, largest)`` image tokens: images of any size between, as
            native-resolution encoders make them (Qwen2-VL: a thumbnail to a document page),
            instead of tiles: each image sample has 1, 2 or 3 images (70%, 20%, 10%) of one
            size, drawn log-uniformly between ``smallest`` and ``largest / images`` (a sample's
            image tokens stay under ``largest``; their text under ``max_text_tokens / 2``).
            Image count, image tokens and the attention within each image then rank samples
            differently.
        text_scale: the text lengths over the real ones (captions of ~110 tokens, chats of
            ~700); default ``tile_tokens / 256``, the scale of the tiles. With ``image_sizes``
            of real size give 1: text and images then keep their real proportions, and a
            long text-only chat is heavy for the language model's attention and free for the
            vision encoder.
    """
    if num_samples < 0 or not 0.0 <= text_share <= 1.0 or tile_tokens < 1:
        raise ValueError(
            f"`synthetic_length_table(num_samples={num_samples}, text_share={text_share},"
            f" tile_tokens={tile_tokens})`: need num_samples >= 0, text_share in [0, 1],"
            " tile_tokens >= 1"
        )
    if image_sizes is not None and not 1 <= image_sizes[0] <= image_sizes[1] // 3:
        raise ValueError(
            f"`synthetic_length_table(image_sizes={image_sizes})`: need 1 <= smallest <="
            " largest / 3 (a sample of 3 images fits under largest)"
        )
    rng = np.random.default_rng(seed)
    is_text = rng.random(num_samples) < text_share
    tiles = rng.choice(_TILES, size=num_samples, p=_TILE_P)
    image_tokens = np.where(is_text, 0, tiles * tile_tokens)
    images = (~is_text).astype(np.int64)
    if image_sizes is not None:
        count = rng.choice(np.array([1, 2, 3]), size=num_samples, p=[0.7, 0.2, 0.1])
        lo, hi = np.log(image_sizes[0]), np.log(image_sizes[1] / count)
        size = np.exp(lo + rng.random(num_samples) * (hi - lo)).astype(np.int64)
        images = np.where(is_text, 0, count)
        image_tokens = np.where(is_text, 0, count * np.maximum(size, image_sizes[0]))
    scale = tile_tokens / 256 if text_scale is None else float(text_scale)
    # text part of an image sample: ~40-400 tokens at 256 tokens per tile (log-normal)
    caption = np.clip(rng.lognormal(np.log(110), 0.7, num_samples) * scale, 2, None)
    if image_sizes is not None:  # a sample of the largest images still fits largest + text cap
        caption = np.minimum(caption, max(2, max_text_tokens // 2))
    # a text-only sample: log-normal around a few hundred tokens, capped
    chat = np.clip(rng.lognormal(np.log(700), 0.9, num_samples) * scale, 8, max_text_tokens)
    total = np.where(is_text, chat, image_tokens + caption).astype(np.int64)
    return LengthTable(
        total_tokens=total,
        image_tokens=image_tokens.astype(np.int64),
        images=images.astype(np.int64),
    )


def read_length_csv(*paths: str | Path) -> LengthTable:
    """Reads length tables in the shared CSV format (``total_tokens,image_tokens,images``).

    Raises:
        ValueError: naming the file, line and column of the first bad cell: a missing column
            or cell, a cell that is not an integer, ``total_tokens < 1``, ``image_tokens``
            outside ``[0, total_tokens]``, ``images < 0``, or images without image tokens
            or image tokens without images.
    """
    cols: dict[str, list[int]] = {"total_tokens": [], "image_tokens": [], "images": []}
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(cols) - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing columns {sorted(missing)}")
            for row in reader:
                line = reader.line_num
                values = {k: _csv_int(row.get(k), path, line, k) for k in cols}
                _check_length_row(values, f"{path}:{line}")
                for k, v in values.items():
                    cols[k].append(v)
    return LengthTable(**{k: np.asarray(v, dtype=np.int64) for k, v in cols.items()})


def _csv_int(cell: str | None, path: str | Path, line: int, column: str) -> int:
    if cell is None:
        raise ValueError(f"{path}:{line}: column {column!r} is missing (the row is too short)")
    try:
        return int(cell.strip())
    except ValueError:
        raise ValueError(f"{path}:{line}: column {column!r} is {cell!r}, not an integer") from None


def _check_length_row(v: dict[str, int], where: str) -> None:
    """One sample's lengths: ``total >= 1``, ``0 <= image <= total``, images with image tokens."""
    if v["total_tokens"] < 1:
        raise ValueError(f"{where}: column 'total_tokens' is {v['total_tokens']} (must be >= 1)")
    if not 0 <= v["image_tokens"] <= v["total_tokens"]:
        raise ValueError(
            f"{where}: column 'image_tokens' is {v['image_tokens']}: image_tokens"
            f" {v['image_tokens']} must be in [0, total_tokens {v['total_tokens']}]"
        )
    if v["images"] < 0:
        raise ValueError(f"{where}: column 'images' is {v['images']} (must be >= 0)")
    if (v["images"] > 0) != (v["image_tokens"] > 0):
        raise ValueError(
            f"{where}: columns 'image_tokens' and 'images': {v['image_tokens']} image tokens"
            f" but {v['images']} images (a sample has images exactly when it has image tokens)"
        )


class SyntheticVLMDataset(Dataset):
    """Deterministic samples for a length table: item ``i`` depends only on ``(seed, i)``.

    A sample with images starts with a BOS token, then its image tokens (placeholder id
    ``image_token_id``, one row of ``pixel_values`` each, images one after the other), then text.
    Text tokens follow a simple learnable rule (an arithmetic sequence modulo the vocabulary, with
    10% random tokens) so a model's loss visibly falls.

    Args:
        table: the length table (total and image tokens, images per sample).
        vocab_size: token ids are in ``[2, vocab_size)``; 0 is padding, 1 is the image placeholder.
        patch_dim: features per image token.
        seed: base seed.
    """

    image_token_id = 1

    def __init__(
        self, table: LengthTable, *, vocab_size: int = 256, patch_dim: int = 32, seed: int = 0
    ) -> None:
        if vocab_size < 4:
            raise ValueError(f"`SyntheticVLMDataset(vocab_size={vocab_size})` must be >= 4")
        bad = np.flatnonzero(
            (table.image_tokens > 0)
            & ((table.total_tokens <= table.image_tokens) | (table.images > table.image_tokens))
        )
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"sample {i}: {int(table.total_tokens[i])} tokens, {int(table.image_tokens[i])}"
                f" image tokens in {int(table.images[i])} images; a sample with images needs at"
                " least one text token and one image token per image"
            )
        self.table = table
        self.vocab_size = vocab_size
        self.patch_dim = patch_dim
        self.seed = seed

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = int(self.table.total_tokens[index])
        n_image = int(self.table.image_tokens[index])
        n_images = max(int(self.table.images[index]), 1) if n_image else 0
        rng = np.random.default_rng([self.seed, int(index)])
        text = n - n_image
        # an arithmetic sequence mod V (the step is readable from the context) with 10% noise
        v = self.vocab_size - 2
        start, step = rng.integers(v), rng.integers(1, 8)
        seq = (start + step * np.arange(text)) % v
        noise = rng.random(text) < 0.1
        seq[noise] = rng.integers(v, size=int(noise.sum()))
        tokens = torch.from_numpy(seq + 2).long()
        if n_image == 0:
            return {"input_ids": tokens}
        input_ids = torch.cat(
            [tokens[:1], torch.full((n_image,), self.image_token_id, dtype=torch.long), tokens[1:]]
        )
        sizes = [n_image // n_images] * n_images
        sizes[-1] += n_image - sum(sizes)
        return {
            "input_ids": input_ids,
            "pixel_values": torch.from_numpy(
                rng.standard_normal((n_image, self.patch_dim), dtype=np.float32)
            ),
            "image_sizes": torch.tensor(sizes),
            "image_positions": torch.arange(1, 1 + n_image),
        }


def take_rows(table: LengthTable, rows: np.ndarray) -> LengthTable:
    """The rows ``rows`` of ``table``, in that order."""
    return LengthTable(
        total_tokens=table.total_tokens[rows],
        image_tokens=table.image_tokens[rows],
        images=table.images[rows],
    )


def resample_text_share(table: LengthTable, text_share: float, seed: int) -> LengthTable:
    """Keeps every image row once, draws text-only rows to reach ``text_share``, then shuffles.

    ``n_txt = round(F / (1 - F) * n_img)`` text rows (``image_tokens == 0``) are drawn uniformly
    with replacement; ``F = 0`` drops all text rows; ``F = 1`` is only valid when every row is a
    text row (all of them are kept). The combined rows are shuffled with the same generator.

    Raises:
        ValueError: for a share outside [0, 1], or data without the rows the share needs.
    """
    if not 0.0 <= text_share <= 1.0:
        raise ValueError(f"text_share {text_share} must be in [0, 1)")
    is_text = table.image_tokens == 0
    text_rows = np.flatnonzero(is_text)
    image_rows = np.flatnonzero(~is_text)
    rng = np.random.default_rng(seed)
    if text_share == 1.0:
        if len(image_rows) or not len(text_rows):
            raise ValueError(
                "text_share 1 is only valid when the data has only text-only rows"
                f" (it has {len(image_rows)} image rows and {len(text_rows)} text rows);"
                " use a value in [0, 1)"
            )
        rows = text_rows
    else:
        if text_share > 0.0 and not len(text_rows):
            raise ValueError(
                f"text_share {text_share} needs text-only rows (image_tokens == 0), but the"
                " data has none; add a text-only file or use a text share of 0"
            )
        if not len(image_rows):
            raise ValueError(
                f"text_share {text_share} keeps the image rows and scales the text rows to"
                " them, but the data has no image rows"
            )
        n_txt = round(text_share / (1.0 - text_share) * len(image_rows))
        drawn = rng.choice(text_rows, size=n_txt, replace=True) if n_txt else text_rows[:0]
        rows = np.concatenate([image_rows, drawn])
    return take_rows(table, rows[rng.permutation(len(rows))])
