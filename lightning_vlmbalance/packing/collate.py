"""Collation of one pack of samples into a ``PackedBatch`` (torch only, no Lightning).

A *sample* is a dict with

========================  ===============================================================
``input_ids``             ``LongTensor[L]`` (or ``[1, L]``), image tokens included as
                          placeholder ids
``labels`` (optional)     ``LongTensor[L]`` aligned with ``input_ids`` (``-100`` = no loss);
                          default: ``input_ids`` with ``-100`` at image tokens
``pixel_values``          ``Tensor[I, *feature]``: one row per image token, images concatenated
                          (absent or empty for a text-only sample)
``image_sizes``           image tokens of each image (list or tensor), summing to ``I``
``image_positions``       ``LongTensor[I]``: where each image token sits in ``input_ids``
``image_fields``          ``dict[str, Tensor]``, optional: per-image payloads whose first
                          dimension runs over the sample's images (or their rows), e.g. whole
                          images ``(n_images, C, H, W)`` of a model that encodes whole images,
                          their ``image_grid_thw`` or ``image_sizes``
``token_fields``          ``dict[str, Tensor[..., L]]``, optional: per-token tensors laid out like
                          ``input_ids`` (last dimension), e.g. multimodal rotary positions
``sample_fields``         ``dict[str, Tensor]``, optional: per-sample tensors, one entry (first
                          dimension) per sample
========================  ===============================================================

A sample has images when ``image_sizes`` is not empty; ``pixel_values``, if given, holds one row
per image token. A model that encodes whole images (or patches of another granularity) leaves
``pixel_values`` out and carries its pixels in ``image_fields``; the samples of one pack carry
their images the same way. A sample is refused, by its index, when its placeholders would be
trained as text or its images have no pixels: ``image_positions`` without ``image_sizes``,
``image_sizes`` with neither ``pixel_values`` nor ``image_fields``, an empty ``pixel_values`` with
``image_sizes``, or ``input_ids`` of more than one row.

A ``PackedBatch`` is a plain dict (Lightning moves its tensors to the device):

========================  ===============================================================
``input_ids``             ``LongTensor[1, T]``, ``T = seq_len``; the tail is padding
``labels``                ``LongTensor[1, T]``; the first token of each document is ``-100``
                          so a model that shifts labels never predicts across documents
``position_ids``          ``LongTensor[1, T]``, restarting at 0 in each document
``cu_seqlens``            ``IntTensor[D + 1]``: document boundaries (padding tail is its own
                          segment), for packed attention
``max_seqlen``            ``int``, longest segment, computed on the CPU (no device sync)
``pixel_values``          ``Tensor[I, *feature]``, every image of the pack
``image_cu_seqlens``      ``IntTensor[n_images + 1]``: image boundaries in ``pixel_values``
``image_max_seqlen``      ``int``
``image_positions``       ``LongTensor[I]``: index in the flattened ``T`` of each image token
``image_fields``          ``dict[str, Tensor]``: each sample's ``image_fields`` concatenated
                          along the first dimension, the other dimensions zero-padded to the
                          largest in the pack (``{}`` without any)
``token_fields``          ``dict[str, Tensor[..., T]]``: laid out like ``input_ids``, zeros in
                          the padding tail and for samples without the field
``sample_fields``         ``dict[str, Tensor]``: each sample's ``sample_fields`` concatenated
``loss_tokens``           ``int``: targets in this pack (``labels[1:] != -100``)
``global_loss_tokens``    ``int``: targets in the whole optimizer step (all ranks); equals
                          ``loss_tokens`` until a loader that knows the steps fills it in
``loss_weight``           ``float``: multiply the pack's summed token loss by it (see
                          :mod:`lightning_vlmbalance.loss`); ``1 / loss_tokens`` here
``meta``                  ``dict``: ``pack_id``, ``sample_ids``, ``total_tokens``,
                          ``image_tokens``, ``doc_lens``, ``images``, ``image_sizes``,
                          ``padding``, ``weighted_for`` (ranks, micro-steps of the weight)
========================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from lightning_vlmbalance.loss import IGNORE_INDEX, loss_weight

__all__ = ["IGNORE_INDEX", "PackCollator", "PackItem"]


class PackItem(NamedTuple):
    """One sample of a pack as :class:`~lightning_vlmbalance.PackedDataLoader` fetches it
    (``sample`` is ``None`` for the placeholder of a padding pack)."""

    pack_id: int
    index: int
    sample: Any


class _Layout(NamedTuple):
    """A pack's samples laid out in ``seq_len`` tokens, and their images."""

    input_ids: torch.Tensor  # (T,), padded
    labels: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (T,)
    doc_lens: list[int]
    pixels: list[torch.Tensor]  # each sample's image rows
    image_sizes: list[int]  # image tokens of each image, in pack order
    image_positions: list[torch.Tensor]  # each sample's, as indices into the pack's T tokens
    token_fields: dict[str, torch.Tensor]  # name -> (..., T)
    image_fields: dict[str, list[torch.Tensor]]  # name -> each sample's
    sample_fields: dict[str, list[torch.Tensor]]  # name -> each sample's


class _Sample(NamedTuple):
    """One sample, checked and read."""

    ids: torch.Tensor  # (L,)
    labels: torch.Tensor  # (L,), a copy
    image_positions: torch.Tensor  # (I,)
    image_sizes: list[int]  # image tokens of each image
    pixels: torch.Tensor | None  # (I, *feature): one row per image token, or None
    token_fields: dict[str, torch.Tensor]  # name -> (..., L)
    image_fields: dict[str, torch.Tensor]
    sample_fields: dict[str, torch.Tensor]


class PackCollator:
    """Turns the samples of one pack into a ``PackedBatch`` of fixed length ``seq_len``.

    Args:
        seq_len: tokens per pack (the batch is padded to it, so shapes are static).
        pad_token_id: id used for the padding tail.
        image_feature_shape: trailing shape of ``pixel_values`` rows (e.g. ``(patch_dim,)``), used
            to give a pack without images an empty ``pixel_values`` of the right shape. If
            ``None``, it is learnt from the first sample with images.
        pixel_dtype: dtype of ``pixel_values``.
        truncate_text: cut text-only samples longer than ``seq_len`` (the ``overlong="truncate"``
            policy; ``PackedDataLoader`` sets it from its sampler). Otherwise they are an error.

    Example::

        collate = PackCollator(seq_len=512, image_feature_shape=(48,))
        batch = collate([dataset[0], dataset[1]])
    """

    def __init__(
        self,
        seq_len: int,
        *,
        pad_token_id: int = 0,
        image_feature_shape: Sequence[int] | None = None,
        pixel_dtype: torch.dtype = torch.float32,
        truncate_text: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"`PackCollator(seq_len={seq_len!r})` must be >= 1")
        self.seq_len = seq_len
        self.pad_token_id = pad_token_id
        self.image_feature_shape = (
            None if image_feature_shape is None else tuple(image_feature_shape)
        )
        self.pixel_dtype = pixel_dtype
        self.truncate_text = truncate_text

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        """Collates one pack.

        ``items`` are sample dicts, or :class:`PackItem` triples as produced by
        :class:`~lightning_vlmbalance.PackedDataLoader` (``sample`` is ``None`` for a padding pack).
        """
        pack_id, sample_ids, samples = _unpack_items(items)
        T = self.seq_len
        layout = self._lay_out(pack_id, sample_ids, samples)
        input_ids, labels, position_ids, doc_lens, pixels, image_sizes, image_positions = layout[:7]
        offset = sum(doc_lens)  # tokens used; the rest is padding
        segments = doc_lens + ([T - offset] if offset < T else [])
        cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)

        pixel_values = self._pixel_values(pixels)
        image_cu = torch.zeros(len(image_sizes) + 1, dtype=torch.int32)
        if image_sizes:
            image_cu[1:] = torch.cumsum(torch.tensor(image_sizes, dtype=torch.int32), 0)
        loss_tokens = int((labels[1:] != IGNORE_INDEX).sum())
        return {
            "input_ids": input_ids.unsqueeze(0),
            "labels": labels.unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max(segments),
            "pixel_values": pixel_values,
            "image_cu_seqlens": image_cu,
            "image_max_seqlen": max(image_sizes, default=0),
            "image_positions": (
                torch.cat(image_positions) if image_positions else torch.zeros(0, dtype=torch.long)
            ),
            "image_fields": {k: cat_padded(v, k) for k, v in layout.image_fields.items()},
            "token_fields": layout.token_fields,
            "sample_fields": {k: cat_padded(v, k) for k, v in layout.sample_fields.items()},
            "loss_tokens": loss_tokens,
            "global_loss_tokens": loss_tokens,
            "loss_weight": loss_weight(1, 1, loss_tokens),
            "meta": {
                "pack_id": pack_id,
                "sample_ids": sample_ids,
                "total_tokens": offset,
                "image_tokens": sum(image_sizes),
                "doc_lens": doc_lens,
                "images": len(image_sizes),
                "image_sizes": image_sizes,
                "padding": not samples,
                "weighted_for": (1, 1),
            },
        }

    @staticmethod
    def sample_lengths(sample: Any, sid: int) -> tuple[int, int]:
        """``(total_tokens, image_tokens)`` of sample ``sid`` as this collator counts them (what
        the sampler's length table must say); raises ``ValueError`` naming a malformed sample."""
        check_sample(sample, sid)
        n = _row(sample["input_ids"], sid, "input_ids").numel()
        return n, sum(_image_fields(sample, sid, n)[1])

    def _lay_out(self, pack_id: int, sample_ids: list[int], samples: list[dict]) -> _Layout:
        """Places the samples one after another in ``seq_len`` tokens, the tail as padding."""
        T = self.seq_len
        input_ids = torch.full((T,), self.pad_token_id, dtype=torch.long)
        labels = torch.full((T,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(T, dtype=torch.long)
        doc_lens: list[int] = []
        pixels: list[torch.Tensor] = []
        image_sizes: list[int] = []
        image_positions: list[torch.Tensor] = []
        token_fields: dict[str, torch.Tensor] = {}
        image_fields: dict[str, list[torch.Tensor]] = {}
        sample_fields: dict[str, list[torch.Tensor]] = {}
        offset = 0
        without_rows: list[int] = []  # samples whose images are in image_fields only
        with_rows: list[int] = []
        for sid, sample in zip(sample_ids, samples):
            read = self._read_sample(sample, sid)
            ids, lab, pos, sizes, pix = read[:5]
            n = ids.numel()
            if offset + n > T:
                raise ValueError(
                    f"pack {pack_id}: sample {sid} ({n} tokens) does not fit, {offset} of"
                    f" `seq_len={T}` tokens are used already; the packing plan does not match"
                    " the dataset"
                )
            if sizes:
                lab[pos] = IGNORE_INDEX
                if pix is not None:
                    pixels.append(pix)
                (without_rows if pix is None else with_rows).append(sid)
                image_sizes.extend(sizes)
                image_positions.append(pos + offset)
            for name, value in read.token_fields.items():
                if name not in token_fields:
                    token_fields[name] = value.new_zeros((*value.shape[:-1], T))
                _check_token_field(token_fields[name], value, name, sid, n)
                token_fields[name][..., offset : offset + n] = value[..., :n]
            for name, value in read.image_fields.items():
                image_fields.setdefault(name, []).append(value)
            for name, value in read.sample_fields.items():
                sample_fields.setdefault(name, []).append(value)
            lab[0] = IGNORE_INDEX  # never predict the first token of a document from the last one
            input_ids[offset : offset + n] = ids
            labels[offset : offset + n] = lab
            position_ids[offset : offset + n] = torch.arange(n)
            doc_lens.append(n)
            offset += n
        if with_rows and without_rows:
            raise ValueError(
                f"pack {pack_id}: sample(s) {without_rows} have images without 'pixel_values' rows"
                f" (in 'image_fields') and sample(s) {with_rows} have pixel rows; the pack's"
                " pixel_values would miss images: give every sample's images the same way"
            )
        if offset < T:
            position_ids[offset:] = torch.arange(T - offset)
        return _Layout(
            input_ids,
            labels,
            position_ids,
            doc_lens,
            pixels,
            image_sizes,
            image_positions,
            token_fields,
            image_fields,
            sample_fields,
        )

    def _read_sample(self, sample: Any, sid: int) -> _Sample:
        """Checks sample ``sid`` and reads its tokens, labels (a copy) and image fields."""
        T = self.seq_len
        check_sample(sample, sid)
        ids = _row(sample["input_ids"], sid, "input_ids")
        lab = sample.get("labels")
        # a copy: the sample's own tensors are never modified
        lab = (ids if lab is None else _row(lab, sid, "labels")).clone()
        if lab.shape != ids.shape:
            raise ValueError(
                f"sample {sid}: labels have {lab.numel()} tokens, input_ids {ids.numel()}"
            )
        pos, sizes, pix = _image_fields(sample, sid, ids.numel())
        if ids.numel() > T:
            if sizes or not self.truncate_text:
                raise ValueError(
                    f"sample {sid} has {ids.numel()} tokens{' with images' if sizes else ''},"
                    f" more than `seq_len={T}`"
                    + (
                        ": a sample with images is never cut"
                        if sizes
                        else "; pass `truncate_text=True` to cut text-only samples"
                    )
                )
            ids, lab = ids[:T], lab[:T]  # text-only truncation (overlong="truncate")
        return _Sample(
            ids,
            lab,
            pos,
            sizes,
            pix,
            _tensor_fields(sample, "token_fields", sid),
            _tensor_fields(sample, "image_fields", sid),
            _tensor_fields(sample, "sample_fields", sid),
        )

    def _pixel_values(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """The pack's image rows, or an empty ``(0, *image_feature_shape)`` tensor without any."""
        if pixels:
            pixel_values = torch.cat(pixels).to(self.pixel_dtype)
            if self.image_feature_shape is None:
                self.image_feature_shape = tuple(pixel_values.shape[1:])
            return pixel_values
        return torch.zeros((0, *(self.image_feature_shape or ())), dtype=self.pixel_dtype)


def check_sample(sample: Any, sid: int) -> None:
    """Raises ``ValueError`` naming sample ``sid`` if it is not a dict with the fields a pack
    needs: ``input_ids`` (and ``labels``) of one row, and with images ``image_positions``,
    ``image_sizes`` and their pixels (``pixel_values`` rows or ``image_fields``); image positions
    without images are refused too (their placeholder tokens would be trained as text)."""
    if not isinstance(sample, Mapping):
        raise ValueError(
            f"sample {sid} is a {type(sample).__name__}; a dataset item must be a dict with"
            " 'input_ids' (and optional 'labels', 'pixel_values', 'image_sizes',"
            " 'image_positions'; see lightning_vlmbalance.packing.collate)"
        )
    missing = [] if "input_ids" in sample else ["input_ids"]
    pix, sizes = sample.get("pixel_values"), sample.get("image_sizes")
    has_images = _has(pix) or _has(sizes)
    if has_images:
        missing += [k for k in ("image_sizes", "image_positions") if k not in sample]
    if missing:
        raise ValueError(
            f"sample {sid} has no {', '.join(repr(k) for k in missing)} (it has"
            f" {sorted(map(str, sample))}); a sample with 'pixel_values' also needs"
            " 'image_sizes' and 'image_positions' (see lightning_vlmbalance.packing.collate)"
        )
    _row(sample["input_ids"], sid, "input_ids")
    if sample.get("labels") is not None:
        _row(sample["labels"], sid, "labels")
    positions = sample.get("image_positions")
    if not has_images and positions is not None and torch.as_tensor(positions).numel():
        raise ValueError(
            f"sample {sid} has {torch.as_tensor(positions).numel()} 'image_positions' but no"
            " images (no 'image_sizes'): its image tokens would be trained as text; give"
            " 'image_sizes' and the pixels, or drop 'image_positions'"
        )
    if not _has(sizes):
        return
    sizes = torch.as_tensor(sizes).reshape(-1).tolist()
    if pix is not None and not len(pix):
        raise ValueError(
            f"sample {sid}: 'pixel_values' has 0 rows but 'image_sizes' {sizes} lay out"
            f" {sum(sizes)} image tokens; give one row per image token, or leave"
            " 'pixel_values' out and carry the images in 'image_fields'"
        )
    if pix is None and not sample.get("image_fields"):
        raise ValueError(
            f"sample {sid} has 'image_sizes' {sizes} but no pixels: give 'pixel_values' (one row"
            " per image token) or the images in 'image_fields'"
        )


def _unpack_items(items: Sequence[Any]) -> tuple[int, list[int], list[dict]]:
    if items and isinstance(items[0], PackItem):
        pack_id = items[0].pack_id
        if items[0].sample is None:  # a padding pack
            return pack_id, [], []
        return pack_id, [int(it.index) for it in items], [it.sample for it in items]
    return -1, list(range(len(items))), list(items)


def _has(value: Any) -> bool:
    return value is not None and len(value) > 0


def _row(value: Any, sid: int, name: str) -> torch.Tensor:
    """A per-token field of one sample as ``LongTensor[L]``, without a leading batch dimension of
    1; more rows are refused (fused, they would be one document)."""
    t = torch.as_tensor(value, dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        batch = f", a batch of {t.shape[0]}" if t.dim() == 2 else ""
        raise ValueError(
            f"sample {sid}: {name} has shape {tuple(t.shape)}{batch}; a sample is one row of"
            " tokens (process samples one at a time)"
        )
    return t


def _image_fields(
    sample: dict, sid: int, n_tokens: int
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    pix = sample.get("pixel_values")
    if not _has(pix):
        pix = None
        if not _has(sample.get("image_sizes")):
            return torch.zeros(0, dtype=torch.long), [], None
    pos = torch.as_tensor(sample["image_positions"], dtype=torch.long).reshape(-1)
    sizes = [int(s) for s in torch.as_tensor(sample["image_sizes"]).reshape(-1).tolist()]
    rows = len(pos) if pix is None else len(pix)
    if sum(sizes) != rows or len(pos) != rows:
        raise ValueError(
            f"sample {sid}: {'no' if pix is None else len(pix)} pixel rows, {len(pos)} image"
            f" positions and image sizes {sizes} disagree"
        )
    if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= n_tokens):
        raise ValueError(f"sample {sid}: an image position lies outside its {n_tokens} tokens")
    return pos, sizes, None if pix is None else torch.as_tensor(pix)


def _tensor_fields(sample: dict, key: str, sid: int) -> dict[str, torch.Tensor]:
    fields = sample.get(key) or {}
    if not isinstance(fields, Mapping):
        raise ValueError(f"sample {sid}: {key!r} must be a dict of tensors")
    out = {}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"sample {sid}: {key}[{name!r}] is a {type(value).__name__}, not a tensor"
            )
        out[str(name)] = value
    return out


def _check_token_field(
    out: torch.Tensor, value: torch.Tensor, name: str, sid: int, n_tokens: int
) -> None:
    if value.shape[:-1] != out.shape[:-1] or value.shape[-1] < n_tokens or value.dtype != out.dtype:
        raise ValueError(
            f"sample {sid}: token_fields[{name!r}] has shape {tuple(value.shape)} and dtype"
            f" {value.dtype}; expected (*{tuple(out.shape[:-1])}, {n_tokens}) of {out.dtype} like"
            " the pack's other samples"
        )


def cat_padded(values: list[torch.Tensor], name: str) -> torch.Tensor:
    """Concatenates along dim 0, zero-padding every other dimension to the largest."""
    if any(v.dim() != values[0].dim() or v.dtype != values[0].dtype for v in values):
        raise ValueError(
            f"field {name!r}: the pack's samples disagree in rank or dtype"
            f" ({[(tuple(v.shape), v.dtype) for v in values]})"
        )
    if values[0].dim() == 0:
        return torch.stack(values)
    trailing = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        if list(v.shape[1:]) != trailing:
            grown = v.new_zeros((v.shape[0], *trailing))
            grown[tuple(slice(0, n) for n in v.shape)] = v
            v = grown
        padded.append(v)
    return torch.cat(padded)
