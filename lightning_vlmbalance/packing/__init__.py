"""Packing-aware sampling: whole samples into fixed-length packs, the same plan on all ranks."""

from lightning_vlmbalance.packing.binpack import (
    Packs,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.packing.collate import IGNORE_INDEX, PackCollator
from lightning_vlmbalance.packing.plan import EpochPlan, PackingConfig, build_epoch_plan
from lightning_vlmbalance.packing.sampler import PackedDataLoader, PackingSampler
from lightning_vlmbalance.packing.source import SourceBalance
from lightning_vlmbalance.packing.streaming import PackedStreamLoader

__all__ = [
    "IGNORE_INDEX",
    "EpochPlan",
    "PackCollator",
    "PackedDataLoader",
    "PackedStreamLoader",
    "PackingConfig",
    "PackingSampler",
    "Packs",
    "SourceBalance",
    "build_epoch_plan",
    "pack_best_fit_decreasing",
    "pack_greedy",
    "packing_efficiency",
]
