"""lightning_vlmbalance: faster multimodal (vision-language) training on many GPUs, same math.

Public API (everything else is private):

- Packing-aware sampling: :class:`PackingSampler`, :class:`PackedDataLoader`,
  :class:`PackCollator`, :func:`pack_greedy` (see ``docs/packing.md``).
- Packed attention: :func:`packed_attention` (see ``docs/packed_attention.md``).
- The loss contract: :func:`packed_cross_entropy`, :class:`PackedLoss`; every batch's
  ``loss_weight`` makes each optimizer step's gradient that of the token-mean loss over the
  whole global batch (see ``docs/loss.md``).
- Straggler timing: :class:`StragglerMonitor` (see ``docs/straggler_monitor.md``).
- Activation offload: :class:`ActivationOffload` (callback), :class:`ActivationOffloader`,
  :func:`offload_activations` (see ``docs/activation_offload.md``).
- MoE routing: :class:`CompiledMoERouting` (callback); the core in
  ``lightning_vlmbalance.moe`` (see ``docs/moe_routing.md``).
- Rebalancing: ``Trainer(strategy="vlmbalance")`` / :class:`VLMBalanceStrategy` (importing
  the package registers the names), its options :class:`RebalanceConfig`, the component a
  strategy owns :class:`Rebalancer`, the loader :class:`RebalancingLoader` (users may wrap their
  loader in it) and the error it raises, :class:`ExchangeError`; the core: :class:`CostModel`,
  :func:`plan_rebalance`, :class:`RebalancePlan` (see ``docs/rebalancing.md``).
- Synthetic data for examples and tests: :func:`synthetic_length_table`,
  :class:`SyntheticVLMDataset`, :func:`read_length_csv`.
"""

from lightning_vlmbalance.attention import attention_backend, flash_attn_available, packed_attention
from lightning_vlmbalance.balance import (
    CostModel,
    ExchangeError,
    RebalanceConfig,
    RebalancePlan,
    RebalancingLoader,
    plan_rebalance,
)
from lightning_vlmbalance.callbacks import ActivationOffload, CompiledMoERouting, StragglerMonitor
from lightning_vlmbalance.loss import PackedLoss, packed_cross_entropy
from lightning_vlmbalance.offload import ActivationOffloader, offload_activations
from lightning_vlmbalance.packing import (
    IGNORE_INDEX,
    EpochPlan,
    PackCollator,
    PackedDataLoader,
    PackingConfig,
    PackingSampler,
    Packs,
    build_epoch_plan,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.strategy import FSDPVLMBalanceStrategy, Rebalancer, VLMBalanceStrategy
from lightning_vlmbalance.synthetic import (
    LengthTable,
    SyntheticVLMDataset,
    read_length_csv,
    synthetic_length_table,
)

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "ActivationOffload",
    "ActivationOffloader",
    "CompiledMoERouting",
    "CostModel",
    "EpochPlan",
    "ExchangeError",
    "FSDPVLMBalanceStrategy",
    "LengthTable",
    "PackCollator",
    "PackedDataLoader",
    "PackedLoss",
    "PackingConfig",
    "PackingSampler",
    "Packs",
    "RebalanceConfig",
    "RebalancePlan",
    "Rebalancer",
    "RebalancingLoader",
    "StragglerMonitor",
    "SyntheticVLMDataset",
    "VLMBalanceStrategy",
    "attention_backend",
    "build_epoch_plan",
    "flash_attn_available",
    "offload_activations",
    "pack_best_fit_decreasing",
    "pack_greedy",
    "packed_attention",
    "packed_cross_entropy",
    "packing_efficiency",
    "plan_rebalance",
    "read_length_csv",
    "synthetic_length_table",
]
