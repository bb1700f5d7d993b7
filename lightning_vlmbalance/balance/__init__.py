"""Cross-rank rebalancing: cost model and planner (pure numpy cores)."""

from lightning_vlmbalance.balance.cost import (
    FEATURES,
    PHASES,
    CostModel,
    FitReport,
    features_from_packs,
    nnls,
    read_monitor_jsonl,
)
from lightning_vlmbalance.balance.planner import (
    OBJECTIVES,
    RebalancePlan,
    naive_moved_packs,
    plan_rebalance,
)

__all__ = [
    "FEATURES",
    "OBJECTIVES",
    "PHASES",
    "CostModel",
    "FitReport",
    "RebalancePlan",
    "features_from_packs",
    "naive_moved_packs",
    "nnls",
    "plan_rebalance",
    "read_monitor_jsonl",
]
