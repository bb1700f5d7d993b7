"""Packing: whole samples into fixed-length packs (the same plan on every rank), the collation
of a pack into tensors, and the stream packing core. Pure: it imports nothing from the rest of
the package but the loss contract's constants (``balance/`` builds on it, never the reverse).

The loaders of packs (:class:`~lightning_vlmbalance.PackingSampler`,
:class:`~lightning_vlmbalance.PackedDataLoader`,
:class:`~lightning_vlmbalance.PackedStreamLoader`) are in :mod:`lightning_vlmbalance.loaders`,
the former that balances at the source (:class:`~lightning_vlmbalance.SourceBalance`) in
:mod:`lightning_vlmbalance.balance.source`; their old names here, and the old modules
``packing.sampler``, ``packing.streaming`` and ``packing.source``, still work with a
``DeprecationWarning``.
"""

from lightning_vlmbalance._moved import moved
from lightning_vlmbalance.packing.binpack import (
    Packs,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.packing.collate import IGNORE_INDEX, PackCollator
from lightning_vlmbalance.packing.plan import EpochPlan, PackingConfig, build_epoch_plan

__all__ = [
    "IGNORE_INDEX",
    "EpochPlan",
    "PackCollator",
    "PackingConfig",
    "Packs",
    "build_epoch_plan",
    "pack_best_fit_decreasing",
    "pack_greedy",
    "packing_efficiency",
]

# moved names (release 0.2), found on first use: ``packing``'s own modules import nothing above
# it (the package's ``__init__`` imports every layer, as any import of a submodule runs it)
__getattr__ = moved(
    __name__,
    {
        "PackingSampler": "lightning_vlmbalance.loaders.map_style",
        "PackedDataLoader": "lightning_vlmbalance.loaders.map_style",
        "PackedStreamLoader": "lightning_vlmbalance.loaders.streaming",
        "SourceBalance": "lightning_vlmbalance.balance.source",
    },
    globals(),
)
