"""Hugging Face ``transformers`` VLMs on packed batches (optional extra ``hf``).

Importing this module registers ``attn_implementation="vlmbalance"`` with transformers' attention
interface. See ``docs/hugging_face.md``.

Example::

    import lightning_vlmbalance.hf as vbhf

    model = AutoModelForImageTextToText.from_config(config, attn_implementation="vlmbalance")
    collate = vbhf.HFPackCollator(model.config, seq_len=4096)
    ...
    loss = model(**vbhf.model_inputs(model, batch, module=self)).loss
"""

from lightning_vlmbalance.hf.attention import ATTN_IMPLEMENTATION, register, vlmbalance_attention
from lightning_vlmbalance.hf.families import SUPPORTED_FAMILIES, Family, family_of
from lightning_vlmbalance.hf.inputs import (
    HFPackCollator,
    ItemLengths,
    item_lengths,
    model_inputs,
    prepare_model,
)
from lightning_vlmbalance.hf.lengths import header_lengths
from lightning_vlmbalance.hf.records import ChatRecords

register()

_LAZY = {"DocumentCheck", "PackingReport", "check_packing"}


def __getattr__(name: str) -> object:
    # imported on first use, so that ``python -m lightning_vlmbalance.hf.check`` runs the module
    # without it being imported twice (runpy warns about a module already in sys.modules)
    if name in _LAZY:
        from lightning_vlmbalance.hf import check

        return getattr(check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_FAMILIES",
    "ChatRecords",
    "DocumentCheck",
    "Family",
    "HFPackCollator",
    "ItemLengths",
    "PackingReport",
    "check_packing",
    "family_of",
    "header_lengths",
    "item_lengths",
    "model_inputs",
    "prepare_model",
    "register",
    "vlmbalance_attention",
]
