"""Streamed records with encoded images: written as Hugging Face parquet shards or a LitData
``optimize()`` directory, read back as a stream, counted from the image headers.

What a streaming user needs beyond :class:`~lightning_vlmbalance.PackedStreamLoader`: records
from parquet (:func:`hf_stream`, Hugging Face ``datasets`` in streaming mode, split by node) and
from LitData (:func:`litdata_stream`), any in-memory list as a sharded stream
(:class:`ShardedRecords`), image sizes from encoded headers with no pixel decoded
(:func:`header_sizes`), and a small synthetic dataset in this format (for tests and the
streaming main job, ``examples/streaming.py``).

A *record* (the same in every format) is::

    {"uid": int, "text": int32 token ids (BOS first), "images": bytes (PNG files, concatenated),
     "image_ends": byte offset where each PNG ends}

Its lengths come from the PNG headers (:func:`record_tokens`: no pixel is decoded), its sample
from decoding them (:func:`decode_record`): one image token per ``PATCH`` (2 x 4 pixels, 8
features, the example VLM's ``patch_dim``), placeholder id 1 after the BOS token.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_vlmbalance.synthetic import synthetic_length_table

__all__ = [
    "PATCH",
    "ShardedRecords",
    "decode_record",
    "header_sizes",
    "hf_stream",
    "litdata_stream",
    "record_tokens",
    "stream_loader",
    "synthetic_records",
    "write_litdata",
    "write_parquet",
]

PATCH = (2, 4)  # pixels (height, width) per image token: 8 features
IMAGE_TOKEN_ID = 1


def _png(height: int, width: int, rng: np.random.Generator) -> bytes:
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(out, format="PNG")
    return out.getvalue()


def synthetic_records(n: int, *, seed: int = 0, vocab_size: int = 64) -> list[dict[str, Any]]:
    """``n`` records shaped like the example's length table (images of 4-64 tokens, 1-3 per
    sample, a fifth text-only), each image a random PNG of the right size."""
    table = synthetic_length_table(
        n, seed=seed, tile_tokens=8, max_text_tokens=160, image_sizes=(8, 128)
    )
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        text = int(table.total_tokens[i] - table.image_tokens[i])
        ids = (rng.integers(0, vocab_size - 2, text) + 2).astype(np.int32)
        blobs: list[bytes] = []
        image_tokens = int(table.image_tokens[i])
        images = max(int(table.images[i]), 1) if image_tokens else 0
        for k in range(images):
            tokens = image_tokens // images + (image_tokens % images if k == images - 1 else 0)
            # a PATCH-aligned image of exactly ``tokens`` patches: one row of patches
            blobs.append(_png(PATCH[0], PATCH[1] * tokens, rng))
        ends = np.cumsum([len(b) for b in blobs]).astype(np.int64)
        records.append(
            {"uid": i, "text": ids, "images": b"".join(blobs), "image_ends": ends.tolist()}
        )
    return records


def _images(record: dict[str, Any]) -> list[bytes]:
    blob, start, out = bytes(record["images"]), 0, []
    for end in record["image_ends"]:
        out.append(blob[start : int(end)])
        start = int(end)
    return out


def header_sizes(blobs: list[bytes]) -> list[tuple[int, int]]:
    """``(height, width)`` of each encoded image (PNG, JPEG, any format PIL reads) from its
    header alone: no pixel is decoded."""
    from PIL import Image

    out = []
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as im:  # lazy: reads the header only
            width, height = im.size
        out.append((height, width))
    return out


def record_tokens(record: dict[str, Any]) -> tuple[int, int]:
    """``(total_tokens, image_tokens)`` of a synthetic record from its PNG headers (nothing
    decoded): one image token per ``PATCH`` of pixels."""
    image = sum((h // PATCH[0]) * (w // PATCH[1]) for h, w in header_sizes(_images(record)))
    return len(record["text"]) + image, image


def decode_record(record: dict[str, Any]) -> dict[str, Any]:
    """The sample dict of a record (:mod:`lightning_vlmbalance.packing.collate`): its PNGs
    decoded and cut into patches."""
    from PIL import Image

    text = torch.as_tensor(np.asarray(record["text"], dtype=np.int64))
    rows, sizes = [], []
    for png in _images(record):
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float32) / 255.0
        h, w = pixels.shape[0] // PATCH[0], pixels.shape[1] // PATCH[1]
        patches = pixels[: h * PATCH[0], : w * PATCH[1]].reshape(h, PATCH[0], w, PATCH[1])
        rows.append(torch.from_numpy(patches.transpose(0, 2, 1, 3).reshape(h * w, -1).copy()))
        sizes.append(h * w)
    if not sizes:
        return {"input_ids": text}
    n_image = sum(sizes)
    placeholders = torch.full((n_image,), IMAGE_TOKEN_ID, dtype=torch.long)
    return {
        "input_ids": torch.cat([text[:1], placeholders, text[1:]]),
        "pixel_values": torch.cat(rows),
        "image_sizes": torch.tensor(sizes),
        "image_positions": torch.arange(1, 1 + n_image),
    }


def stream_loader(source: Any, seq_len: int, **options: Any) -> Any:
    """A ``PackedStreamLoader`` over a stream of these records: lengths from the PNG headers,
    samples decoded for packed records only, packs of ``seq_len`` tokens; ``options``: its
    other arguments (``buffer``, ``trainer``, ``num_workers``, ...) or other defaults."""
    import lightning_vlmbalance as vb

    defaults = {
        "lengths": record_tokens,
        "transform": decode_record,
        "collate_fn": vb.PackCollator(seq_len, image_feature_shape=(PATCH[0] * PATCH[1],)),
    }
    return vb.PackedStreamLoader(source, seq_len=seq_len, **{**defaults, **options})


class ShardedRecords(IterableDataset):
    """Any in-memory list of records as a stream: rank ``rank`` of ``world`` takes the records
    of its share (``shares``: the fraction of the records each rank holds, so shards can
    differ in size), and a ``DataLoader`` worker every ``num_workers``-th of those."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        rank: int = 0,
        world: int = 1,
        shares: list[float] | None = None,
    ) -> None:
        self.records, self.rank, self.world = records, rank, world
        shares = shares or [1.0] * world
        bounds = np.concatenate([[0.0], np.cumsum(shares) / sum(shares)]) * len(records)
        self.lo, self.hi = round(bounds[rank]), round(bounds[rank + 1])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(self.lo + worker, self.hi, workers):
            yield self.records[i]


def write_parquet(records: list[dict[str, Any]], out: Path, shards: int) -> list[str]:
    """Writes ``records`` as ``shards`` parquet files (contiguous runs; the last ones smaller
    when ``len(records)`` does not divide); returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, part in enumerate(np.array_split(np.arange(len(records)), shards)):
        rows = [records[i] for i in part]
        table = pa.table(
            {
                "uid": pa.array([r["uid"] for r in rows], pa.int64()),
                "text": pa.array(
                    [np.asarray(r["text"]).tolist() for r in rows], pa.list_(pa.int32())
                ),
                "images": pa.array([r["images"] for r in rows], pa.binary()),
                "image_ends": pa.array([r["image_ends"] for r in rows], pa.list_(pa.int64())),
            }
        )
        path = out / f"part-{k:05d}.parquet"
        pq.write_table(table, path)
        paths.append(str(path))
    return paths


def hf_stream(paths: list[str], rank: int, world: int) -> Any:
    """The parquet shards as a Hugging Face ``datasets`` stream, split by node (whole shards
    per rank when they divide evenly), split again by ``DataLoader`` worker inside each."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stream = load_dataset("parquet", data_files=paths, split="train", streaming=True)
    return split_dataset_by_node(stream, rank=rank, world_size=world)


def _litdata_item(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "uid": int(record["uid"]),
        "text": np.asarray(record["text"], dtype=np.int32),
        "images": bytes(record["images"]),
        "image_ends": np.asarray(record["image_ends"], dtype=np.int64),
    }


def write_litdata(records: list[dict[str, Any]], out: Path, chunk_bytes: str = "64KB") -> str:
    """Writes ``records`` with LitData's ``optimize()`` (one process) into ``out``."""
    from litdata import optimize

    optimize(
        fn=_litdata_item,
        inputs=records,
        output_dir=str(out),
        chunk_bytes=chunk_bytes,
        num_workers=1,
        mode="overwrite",
    )
    return str(out)


def litdata_stream(directory: str) -> Any:
    """A LitData ``StreamingDataset`` over ``directory`` (in order; it shards by rank and
    ``DataLoader`` worker itself)."""
    from litdata import StreamingDataset

    return StreamingDataset(directory, shuffle=False, drop_last=False)
