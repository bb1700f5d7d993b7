"""lightning_vlmbalance: faster multimodal (vision-language) training on many GPUs, same math.

Public API (everything else is private):

- Packing-aware sampling: :class:`PackingSampler` with :class:`PackingConfig` and, to balance
  at the source, :class:`SourceBalance`; :class:`PackedDataLoader`, :class:`PackCollator`
  (``IGNORE_INDEX`` for masked labels), :func:`pack_greedy` and :class:`Packs`,
  :func:`packing_efficiency`, :func:`build_epoch_plan` and its :class:`EpochPlan` (see
  ``docs/packing.md``); the baseline packers are in ``lightning_vlmbalance.packing``.
- Streaming datasets: :class:`PackedStreamLoader` (see ``docs/streaming.md``).
- Packed attention: :func:`packed_attention`, :func:`attention_backend`,
  :func:`flash_attn_available` (see ``docs/packed_attention.md``).
- The loss contract: :func:`packed_cross_entropy`, :class:`PackedLoss`; every batch's
  ``loss_weight`` makes each optimizer step's gradient that of the token-mean loss over the
  whole global batch (see ``docs/loss.md``).
- Straggler timing: :class:`StragglerMonitor` (see ``docs/straggler_monitor.md``); in a
  Lightning Fabric loop, :class:`FabricStragglerMonitor` (``lightning_vlmbalance.fabric``; the
  Trainer-only strategy names are registered in Fabric's registry as refusals that say why).
- Activation offload: :class:`ActivationOffload` (callback), :class:`ActivationOffloader`,
  :func:`offload_activations` (see ``docs/activation_offload.md``).
- MoE routing: :class:`CompiledMoERouting` (callback); the core in
  ``lightning_vlmbalance.moe`` (see ``docs/moe_routing.md``).
- Rebalancing: ``Trainer(strategy="vlmbalance")`` / :class:`VLMBalanceStrategy` and
  ``"fsdp_vlmbalance"`` / :class:`FSDPVLMBalanceStrategy` (importing the package registers the
  names), their options :class:`RebalanceConfig` (online calibration of the cost model:
  :class:`Calibration`), the loader :class:`RebalancingLoader` (users
  may wrap their loader in it) and the error it raises, :class:`ExchangeError`; the core:
  :class:`CostModel`, :func:`plan_rebalance`, :class:`RebalancePlan` (see
  ``docs/rebalancing.md``); the encoder call of a model under encoder balancing,
  :func:`encode_images` (``RebalanceConfig(encoder=True)``, ``docs/two_level_balancing.md``).
  The component a strategy owns, ``Rebalancer``, is in ``lightning_vlmbalance.strategy``; the
  data-parallel world in ``lightning_vlmbalance.parallel``.

Length tables (``read_length_csv`` for the shared CSVs, ``synthetic_length_table``) and the
synthetic dataset the examples and tests train on are in ``lightning_vlmbalance.synthetic``.
"""

from lightning_vlmbalance.attention import attention_backend, flash_attn_available, packed_attention
from lightning_vlmbalance.balance import (
    Calibration,
    CostModel,
    ExchangeError,
    RebalanceConfig,
    RebalancePlan,
    SourceBalance,
    plan_rebalance,
)
from lightning_vlmbalance.balance.encoder import encode_images
from lightning_vlmbalance.callbacks import ActivationOffload, CompiledMoERouting, StragglerMonitor
from lightning_vlmbalance.fabric import FabricStragglerMonitor
from lightning_vlmbalance.loaders import (
    PackedDataLoader,
    PackedStreamLoader,
    PackingSampler,
    RebalancingLoader,
)
from lightning_vlmbalance.loss import PackedLoss, packed_cross_entropy
from lightning_vlmbalance.offload import ActivationOffloader, offload_activations
from lightning_vlmbalance.packing import (
    IGNORE_INDEX,
    EpochPlan,
    PackCollator,
    PackingConfig,
    Packs,
    build_epoch_plan,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.strategy import FSDPVLMBalanceStrategy, VLMBalanceStrategy

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "ActivationOffload",
    "ActivationOffloader",
    "Calibration",
    "CompiledMoERouting",
    "CostModel",
    "EpochPlan",
    "ExchangeError",
    "FSDPVLMBalanceStrategy",
    "FabricStragglerMonitor",
    "PackCollator",
    "PackedDataLoader",
    "PackedLoss",
    "PackedStreamLoader",
    "PackingConfig",
    "PackingSampler",
    "Packs",
    "RebalanceConfig",
    "RebalancePlan",
    "RebalancingLoader",
    "SourceBalance",
    "StragglerMonitor",
    "VLMBalanceStrategy",
    "attention_backend",
    "build_epoch_plan",
    "encode_images",
    "flash_attn_available",
    "offload_activations",
    "pack_greedy",
    "packed_attention",
    "packed_cross_entropy",
    "packing_efficiency",
    "plan_rebalance",
]
