"""Sort-based MoE token dispatch that compiles with ``fullgraph=True``.

Framework-free core: :func:`route`, :func:`dispatch`, :func:`gather`, :func:`combine`,
:func:`load_balancing_loss`, :func:`grouped_mlp`, :func:`grouped_mm`,
:func:`patch_moe_modules` and :func:`unsupported_moe_modules`; the Lightning callback is
:class:`~lightning_vlmbalance.callbacks.CompiledMoERouting`.
"""

from lightning_vlmbalance.moe.grouped import (
    MLP_ACTIVATIONS,
    grouped_mlp,
    grouped_mm,
    native_grouped_mm_supported,
)
from lightning_vlmbalance.moe.layers import (
    PatchedMoE,
    expert_list_moe,
    fused_experts_moe,
    patch_moe_modules,
    unpatch_moe_modules,
    unsupported_moe_modules,
)
from lightning_vlmbalance.moe.routing import (
    SCORES,
    Dispatch,
    combine,
    dispatch,
    gather,
    load_balancing_loss,
    route,
)

__all__ = [
    "MLP_ACTIVATIONS",
    "SCORES",
    "Dispatch",
    "PatchedMoE",
    "combine",
    "dispatch",
    "expert_list_moe",
    "fused_experts_moe",
    "gather",
    "grouped_mlp",
    "grouped_mm",
    "load_balancing_loss",
    "native_grouped_mm_supported",
    "patch_moe_modules",
    "route",
    "unpatch_moe_modules",
    "unsupported_moe_modules",
]
