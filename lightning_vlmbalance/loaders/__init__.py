"""The loaders Lightning iterates: packs grouped into optimizer steps (global batches) with their
loss weights, rebalanced across ranks when the strategy asks. Built on ``packing/`` (plans,
collation) and ``balance/`` (cost model, planners, exchange); the strategies build on them.

- :class:`PackingSampler` and :class:`PackedDataLoader`: map-style datasets with a length table;
- :class:`PackedStreamLoader`: streams (no length table);
- :class:`RebalancingLoader`: what ``strategy="vlmbalance"`` wraps the training loader in.
"""

from lightning_vlmbalance.loaders.map_style import PackedDataLoader, PackingSampler
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.loaders.streaming import PackedStreamLoader

__all__ = ["PackedDataLoader", "PackedStreamLoader", "PackingSampler", "RebalancingLoader"]
