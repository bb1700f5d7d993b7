"""From records on disk to the packed loader: ``ChatRecords``.

A record is a conversation and the images it shows, as JSON lines or a list of dicts::

    {"images": ["img/0001.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

The ``{"type": "image"}`` entries take the record's images in order. Each item is what the
model's own processor returns for the record through its chat template (the family's image
placeholders expanded), plus ``labels``: the token ids of the assistant's turns and ``-100``
everywhere else (the prompt, the images, the system and user turns), which
:class:`~lightning_vlmbalance.hf.HFPackCollator` packs as they are.

Labels come from the chat template's ``{% generation %}`` markers where it has them
(``return_assistant_tokens_mask``); a template without them (most released ones) gets its
assistant spans by prefix: the tokens of the conversation up to each assistant turn with the
generation prompt, against those up to the end of that turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_vlmbalance.packing.collate import IGNORE_INDEX

__all__ = ["ChatRecords", "read_records"]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (one record per non-empty line)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON record ({e.msg})") from None
    return out


class ChatRecords(torch.utils.data.Dataset):
    """Records (see the module docstring) as processor outputs with assistant-only ``labels``.

    Args:
        records: a list of records, or the path of a JSON-lines file of them.
        processor: the model's processor (``AutoProcessor.from_pretrained(...)``, or
            :func:`~lightning_vlmbalance.hf.offline.processor_without_video`).
        root: the folder relative image paths start from (default: the JSON-lines file's
            folder, else the working directory).
        masks: ``"auto"`` (the template's ``{% generation %}`` markers if it has them, else by
            prefix), ``"generation"`` or ``"prefix"``.

    Raises (when an item is read):
        ValueError: naming the record, for image entries that do not match its images, a
            missing image file, or a conversation with no assistant tokens to train on.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]] | str | Path,
        processor: Any,
        *,
        root: str | Path | None = None,
        masks: str = "auto",
    ) -> None:
        if isinstance(records, str | Path):
            root = Path(records).parent if root is None else root
            records = read_records(records)
        if masks not in ("auto", "generation", "prefix"):
            raise ValueError(f"ChatRecords(masks={masks!r}): 'auto', 'generation' or 'prefix'")
        self.records = list(records)
        self.processor = processor
        self.root = Path(root) if root is not None else Path.cwd()
        template = getattr(processor, "chat_template", None) or ""
        self.masks = (
            ("generation" if "generation" in template else "prefix") if masks == "auto" else masks
        )

    def __len__(self) -> int:
        return len(self.records)

    def image_paths(self, index: int) -> list[Path]:
        """The record's image files (relative paths from ``root``)."""
        paths = [Path(p) for p in self.records[index].get("images") or []]
        return [p if p.is_absolute() else self.root / p for p in paths]

    def messages(self, index: int, images: Sequence[Any] | None = None) -> list[dict[str, Any]]:
        """The record's messages with its images (or ``images``) in its image entries."""
        record = self.records[index]
        paths = self.image_paths(index)
        images = list(paths if images is None else images)
        slots = sum(
            1
            for m in record["messages"]
            if not isinstance(m["content"], str)
            for c in m["content"]
            if c.get("type") == "image"
        )
        if slots != len(images):
            raise ValueError(
                f"record {index}: {slots} image entries in its messages, {len(images)} images"
            )
        it = iter(images)
        out = []
        for m in record["messages"]:
            content = m["content"]
            if not isinstance(content, str):
                content = [
                    {"type": "image", "image": next(it)} if c.get("type") == "image" else dict(c)
                    for c in content
                ]
            out.append({**m, "content": content})
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        from transformers.image_utils import load_image

        images = []
        for path in self.image_paths(index):
            if not path.is_file():
                raise ValueError(f"record {index}: image file {path} does not exist")
            try:
                images.append(load_image(str(path)))
            except Exception as e:  # PIL's own error names the file, not the record
                raise ValueError(f"record {index}: image file {path} cannot be read ({e})") from e
        messages = self.messages(index, images)
        out = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            return_assistant_tokens_mask=self.masks == "generation",
        )
        item = {k: v for k, v in out.items() if k != "assistant_masks"}
        ids = item["input_ids"]
        if self.masks == "generation":
            keep = torch.as_tensor(out["assistant_masks"], dtype=torch.bool)
        else:
            keep = self._prefix_mask(messages, ids.shape[-1])
        if not bool(keep.any()):
            raise ValueError(
                f"record {index}: no assistant tokens to train on (no assistant turn, or a chat"
                " template that renders none)"
            )
        item["labels"] = torch.where(keep.reshape(ids.shape), ids, IGNORE_INDEX)
        return item

    def _prefix_mask(self, messages: list[dict[str, Any]], length: int) -> torch.Tensor:
        """Assistant tokens by prefix: for each assistant turn, the tokens between the
        conversation before it (with the generation prompt) and the conversation through it."""
        keep = torch.zeros(length, dtype=torch.bool)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = self._length(messages[:k], generation_prompt=True)
            stop = self._length(messages[: k + 1], generation_prompt=False)
            keep[start:stop] = True
        return keep

    def _length(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> int:
        out = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            add_generation_prompt=generation_prompt,
        )
        return int(out["input_ids"].shape[-1])
