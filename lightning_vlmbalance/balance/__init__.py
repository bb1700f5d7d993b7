"""Cross-rank rebalancing: cost model, planners and the former that balances at the source
(numpy), pack exchange and encoder balancing (torch). Built on ``packing/``; the loaders
(:mod:`lightning_vlmbalance.loaders`) and the strategies build on it."""

from lightning_vlmbalance._moved import moved
from lightning_vlmbalance.balance.calibration import Calibration, OnlineCalibrator, Refit
from lightning_vlmbalance.balance.config import MODES, RebalanceConfig
from lightning_vlmbalance.balance.cost import (
    FEATURES,
    MODELLED_PHASES,
    CostModel,
    FitReport,
    features_from_meta,
    features_from_packs,
    nnls,
    read_monitor_jsonl,
)
from lightning_vlmbalance.balance.exchange import ExchangeError, exchange_packs
from lightning_vlmbalance.balance.planner import (
    OBJECTIVES,
    RebalancePlan,
    naive_moved_packs,
    plan_rebalance,
)
from lightning_vlmbalance.balance.source import SourceBalance

__all__ = [
    "FEATURES",
    "MODELLED_PHASES",
    "MODES",
    "OBJECTIVES",
    "Calibration",
    "CostModel",
    "ExchangeError",
    "FitReport",
    "OnlineCalibrator",
    "RebalanceConfig",
    "RebalancePlan",
    "Refit",
    "SourceBalance",
    "exchange_packs",
    "features_from_meta",
    "features_from_packs",
    "naive_moved_packs",
    "nnls",
    "plan_rebalance",
    "read_monitor_jsonl",
]


# RebalancingLoader moved up to ``loaders`` (release 0.2), found on first use: ``balance``'s own
# modules import nothing above it
__getattr__ = moved(
    __name__, {"RebalancingLoader": "lightning_vlmbalance.loaders.rebalancing"}, globals()
)
