"""Cross-rank rebalancing: cost model and planner (numpy), pack exchange and loader (torch)."""

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
from lightning_vlmbalance.balance.loader import RebalancingLoader
from lightning_vlmbalance.balance.planner import (
    OBJECTIVES,
    RebalancePlan,
    naive_moved_packs,
    plan_rebalance,
)

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
    "RebalancingLoader",
    "Refit",
    "exchange_packs",
    "features_from_meta",
    "features_from_packs",
    "naive_moved_packs",
    "nnls",
    "plan_rebalance",
    "read_monitor_jsonl",
]
