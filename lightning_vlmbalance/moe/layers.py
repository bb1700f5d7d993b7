"""Sorted-dispatch MoE forwards, and the patching of existing MoE modules to use them.

Two module layouts are recognised:

- **expert list** (the example VLM's ``MoEFeedForward``, which declares
  ``vlmbalance_moe = {"act": "gelu", "renormalize": True}``): a bias-free ``router``
  ``nn.Linear``, a ``topk`` attribute and ``experts``, an ``nn.ModuleList`` of modules with
  ``up`` and ``down`` ``nn.Linear`` layers (GELU between). The experts' weights are stacked
  per forward, a copy of E x (2 x H x F) elements, so that the grouped products see one
  (E, out, in) tensor; the parameters, and so checkpoints and optimizers, stay as they are.
- **fused experts** (Hugging Face transformers 5 sparse-MoE blocks such as Mixtral and Qwen3-MoE):
  an ``experts`` module with 3-D ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F) called as
  ``experts(hidden, top_k_index, top_k_weights)`` with the default ``act(gate) * up`` gating, no
  biases, no post-expert norm and no expert parallelism (anything else is left alone); the
  block's own router (softmax or sigmoid, top-k, renormalisation) is kept, only the expert
  dispatch and compute are replaced.

:func:`unsupported_moe_modules` names the modules that look like MoE layers but are left alone,
each with the reason.

Both forwards are one function shared by every layer (weights are arguments), so
``torch.compile`` builds one graph for all layers instead of one per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vlmbalance.moe.grouped import grouped_mlp
from lightning_vlmbalance.moe.routing import (
    SCORES,
    combine,
    dispatch,
    gather,
    load_balancing_loss,
    route,
)

__all__ = [
    "PatchedMoE",
    "expert_list_moe",
    "fused_experts_moe",
    "patch_moe_modules",
    "unpatch_moe_modules",
    "unsupported_moe_modules",
]

log = logging.getLogger(__name__)

# Hugging Face ``hidden_act`` names -> grouped_mlp activations
_ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "relu": "relu",
    "gelu_pytorch_tanh": "gelu_tanh",
}

# what an expert-list module declares (class attribute ``vlmbalance_moe``) to be patched
_EXPERT_LIST_SPEC: dict[str, Any] = {"act": "gelu", "renormalize": True}

# 3-D expert weights of transformers fused experts, (E, out, in) or (E, in, out)
_FUSED_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj")

# transformers top-k routers that score with a sigmoid (DeepSeek-V3's, and those copied from it);
# matched by class name in a ``transformers.`` module, and only while ``forward`` is theirs.
# Others are taken as softmax routers (Mixtral, Qwen2/3-MoE, OLMoE: transformers' default),
# unless the router or its config declares ``scoring_func``.
_SIGMOID_ROUTERS = frozenset(
    {
        "DeepseekV3TopkRouter",
        "Dots1TopkRouter",
        "ExaoneMoeTopkRouter",
        "Glm4MoeTopkRouter",
        "Glm4vMoeTextTopkRouter",
        "KimiLinearTopkRouter",
        "MiMoV2FlashTopkRouter",
        "MiniMaxM2TopKRouter",
        "SolarOpenTopkRouter",
    }
)


def expert_list_moe(
    x_ND: torch.Tensor,
    router_w: torch.Tensor,
    up_w: list[torch.Tensor],
    up_b: list[torch.Tensor],
    down_w: list[torch.Tensor],
    down_b: list[torch.Tensor],
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The example's MoE (softmax top-k, renormalised, GELU experts with biases), sorted.

    Returns ``(out_ND, counts_E, scores_NE)``."""
    E = len(up_w)
    weights_NK, experts_NK, scores_NE = route(
        F.linear(x_ND, router_w), top_k, renormalize=True, score_dtype=None
    )
    d = dispatch(experts_NK, E)
    xs = gather(x_ND, d)
    y = grouped_mlp(
        xs,
        torch.stack(up_w),
        torch.stack(up_b),
        torch.stack(down_w),
        torch.stack(down_b),
        d.offsets,
        act="gelu",
        gated=False,
    )
    return combine(y, d, weights_NK), d.counts, scores_NE.detach()


def fused_experts_moe(
    x_NH: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    transposed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face fused experts (gated: ``act(gate) * up``), sorted. ``transposed``: weights
    stored (E, in, out) rather than (E, out, in). Returns ``(out_NH, counts_E)``."""
    E = gate_up.shape[0]
    d = dispatch(top_k_index, E)
    xs = gather(x_NH, d)
    w1 = gate_up.transpose(1, 2) if transposed else gate_up  # (E, 2F, H)
    w2 = down.transpose(1, 2) if transposed else down  # (E, H, F)
    y = grouped_mlp(xs, w1, None, w2, None, d.offsets, act=_ACTIVATIONS[act], gated=True)
    return combine(y, d, top_k_weights).to(x_NH.dtype), d.counts


@dataclass
class PatchedMoE:
    """One patched module and its latest router statistics (tensors, never synced here)."""

    name: str
    kind: str  # "expert_list" or "fused_experts"
    module: nn.Module
    router: nn.Module | None = None
    score: str | None = "softmax"  # the router's scoring: "softmax", "sigmoid", None (unknown)
    counts: torch.Tensor | None = None  # tokens routed to each expert (int32, E)
    scores: torch.Tensor | None = None  # router scores (N, E), detached (expert list)
    logits: torch.Tensor | None = None  # router logits (N, E), detached (fused: from the hook)
    handles: list[Any] = field(default_factory=list)

    def load_balancing_loss(self) -> torch.Tensor | None:
        """From the last forward, with the router's own scoring: for fused experts the scores
        are recomputed from the router's logits (softmax as Mixtral and Qwen3-MoE route, sigmoid
        as DeepSeek-V3 routes). ``None`` before a forward, or when the scoring is unknown.

        Sigmoid scores are normalised per token before the Switch formula, as in DeepSeek-V3's
        sequence-wise balance loss (DeepSeek-V3 Technical Report, arXiv:2412.19437, Sec. 2.1.2:
        ``s'_{i,t} = s_{i,t} / sum_j s_{j,t}``, ``P_i = mean_t s'_{i,t}``). Here the mean runs
        over the micro-batch's tokens, and the scale stays the Switch one (``E * sum_e f_e P_e``,
        ``K`` when balanced at top-k), so softmax and sigmoid layers read on one scale."""
        if self.counts is None or self.score not in SCORES:
            return None
        scores_NE = self.scores
        if scores_NE is None and self.logits is not None:
            logits = self.logits.float()
            scores_NE = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        if scores_NE is None:
            return None
        scores_NE = scores_NE.float()
        if self.score == "sigmoid":
            scores_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return load_balancing_loss(scores_NE, self.counts)


def _looks_like_expert_list(m: nn.Module) -> bool:
    experts = getattr(m, "experts", None)
    return isinstance(experts, nn.ModuleList) and len(experts) > 0


def _expert_list_problems(m: nn.Module) -> list[str]:
    """Why ``m`` (an ``experts`` ModuleList) is not patched; empty when it is. It must be the
    example's ``MoEFeedForward``, or a module that opts in the same way: a class attribute
    ``vlmbalance_moe = {"act": "gelu", "renormalize": True}`` declaring that its forward is
    ``softmax top-k (renormalised) -> down(gelu(up(x)))`` per expert. The duck type alone is
    not enough: a lookalike with another activation would silently change its outputs."""
    problems = []
    spec = getattr(type(m), "vlmbalance_moe", None)
    if spec is None:
        problems.append(
            f"it does not declare `vlmbalance_moe = {_EXPERT_LIST_SPEC!r}` (what its forward"
            " computes)"
        )
    elif spec != _EXPERT_LIST_SPEC:
        problems.append(f"`vlmbalance_moe = {spec!r}` is not {_EXPERT_LIST_SPEC!r}")
    router = getattr(m, "router", None)
    if not isinstance(router, nn.Linear):
        problems.append("its `router` is not an nn.Linear")
    elif router.bias is not None:
        problems.append("a router bias is not supported")
    if not isinstance(getattr(m, "topk", None), int):
        problems.append("it has no integer `topk`")
    if not all(
        isinstance(getattr(e, "up", None), nn.Linear)
        and isinstance(getattr(e, "down", None), nn.Linear)
        and e.up.bias is not None
        and e.down.bias is not None
        for e in m.experts
    ):
        problems.append("its experts are not `up` and `down` nn.Linear layers with biases")
    return problems


def _is_expert_list(m: nn.Module) -> bool:
    return _looks_like_expert_list(m) and not _expert_list_problems(m)


def _fused_act(m: nn.Module) -> str | None:
    config = getattr(m, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if act in _ACTIVATIONS else None


def _default_gate(m: nn.Module) -> bool:
    """Whether the experts gate as ``act(gate) * up`` (transformers' default ``_apply_gate``);
    some models override it (clamps, shifted gates), and the sorted forward would change them."""
    apply_gate = getattr(type(m), "_apply_gate", None)
    if apply_gate is None:
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers without it has no override either
        return True
    return apply_gate is _default_apply_gate


def _looks_like_fused_experts(m: nn.Module) -> bool:
    return any(
        isinstance(w, torch.Tensor) and w.dim() == 3
        for w in (getattr(m, name, None) for name in _FUSED_WEIGHTS)
    )


def _fused_experts_problems(m: nn.Module) -> list[str]:
    """Why ``m`` (3-D expert weights) is not patched; empty when it is."""
    problems = []
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
    ):
        problems.append("it has no 3-D `gate_up_proj` and `down_proj`")
    if not getattr(m, "has_gate", True):
        problems.append("ungated experts (`has_gate=False`) are not supported")
    biases = [f"{w}_bias" for w in _FUSED_WEIGHTS if getattr(m, f"{w}_bias", None) is not None]
    if biases or getattr(m, "has_bias", False):
        problems.append(f"expert biases ({', '.join(biases) or 'has_bias=True'}) are not supported")
    if not getattr(m, "is_concatenated", True):
        problems.append("interleaved gate/up columns (`is_concatenated=False`) are not supported")
    if getattr(m, "has_post_expert_norm", False):
        problems.append("a post-expert norm is not supported")
    if getattr(m, "_is_expert_parallel", False):  # ids == E mark other ranks' experts
        problems.append("expert parallelism is not supported")
    if not _default_gate(m):
        problems.append(f"its own gating (`{type(m).__name__}._apply_gate`) is not supported")
    if _fused_act(m) is None:
        act = getattr(getattr(m, "config", None), "hidden_act", None)
        problems.append(f"`config.hidden_act={act!r}` is not one of {sorted(_ACTIVATIONS)}")
    return problems


def _is_fused_experts(m: nn.Module) -> bool:
    return _looks_like_fused_experts(m) and not _fused_experts_problems(m)


def unsupported_moe_modules(root: nn.Module) -> dict[str, str]:
    """The modules under ``root`` that look like MoE layers (an ``experts`` module list, 3-D
    expert weights, or ``experts`` of a layout it does not know) but that
    :func:`patch_moe_modules` leaves alone, each with the reason (``"; "``-joined)."""
    skipped: dict[str, str] = {}
    for name, m in root.named_modules():
        if _looks_like_expert_list(m):
            problems = _expert_list_problems(m)
        elif _looks_like_fused_experts(m):
            problems = _fused_experts_problems(m)
        elif (
            isinstance(getattr(m, "experts", None), nn.Module)
            and not isinstance(m.experts, nn.ModuleList)
            and not _looks_like_fused_experts(m.experts)
        ):
            problems = [f"its experts ({type(m.experts).__name__}) have a layout it does not know"]
        else:
            continue
        if "forward" in m.__dict__:
            problems.append("its forward is replaced on the instance (patched already?)")
        if problems:
            skipped[name or type(m).__name__] = "; ".join(problems)
    return skipped


def _router_score(router: nn.Module, *owners: nn.Module | None) -> str | None:
    """The scoring function of a fused-experts block's router: a ``scoring_func`` (or
    ``score_func``) declared by the router or the config of the router or its owners, if it is
    one of :data:`SCORES` (else ``None``: unknown); ``"sigmoid"`` for the transformers routers in
    ``_SIGMOID_ROUTERS``; otherwise ``"softmax"``."""
    for obj in (router, *(getattr(o, "config", None) for o in (router, *owners))):
        for attr in ("scoring_func", "score_func"):
            declared = getattr(obj, attr, None)
            if isinstance(declared, str):
                return declared if declared in SCORES else None
    for cls in type(router).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in _SIGMOID_ROUTERS:
            return "sigmoid" if type(router).forward is cls.forward else None
    return "softmax"


def patch_moe_modules(
    root: nn.Module, *, compile_kwargs: dict[str, Any] | None = None
) -> list[PatchedMoE]:
    """Replaces the forward of every recognised MoE module under ``root`` with the sorted
    dispatch (compiled with ``torch.compile(**compile_kwargs)`` when given). Returns what was
    patched; :func:`unpatch_moe_modules` restores it."""
    list_fn: Callable[..., Any] = expert_list_moe
    fused_fn: Callable[..., Any] = fused_experts_moe
    if compile_kwargs is not None:
        list_fn = torch.compile(expert_list_moe, **compile_kwargs)
        fused_fn = torch.compile(fused_experts_moe, **compile_kwargs)
    patched: list[PatchedMoE] = []
    for name, m in root.named_modules():
        if "forward" in m.__dict__:
            continue  # patched already (or someone else's instance forward)
        if _is_expert_list(m):
            p = PatchedMoE(name, "expert_list", m)
            m.forward = _expert_list_forward(p, list_fn)
            patched.append(p)
        elif _is_fused_experts(m):
            p = PatchedMoE(name, "fused_experts", m)
            m.forward = _fused_forward(p, fused_fn)
            parent = _parent(root, name)
            router = getattr(parent, "gate", None) if parent is not None else None
            if isinstance(router, nn.Module):
                p.router = router
                p.score = _router_score(router, m, parent)
                p.handles.append(router.register_forward_hook(_record_router(p)))
            patched.append(p)
    return patched


def unpatch_moe_modules(patched: list[PatchedMoE]) -> None:
    """Restores the original forwards and removes the router hooks."""
    for p in patched:
        p.module.__dict__.pop("forward", None)
        for h in p.handles:
            h.remove()
        p.handles.clear()


def _expert_list_forward(p: PatchedMoE, fn: Callable[..., Any]) -> Callable[..., Any]:
    m = p.module

    def forward(x_TD: torch.Tensor) -> torch.Tensor:
        out, p.counts, p.scores = fn(
            x_TD,
            m.router.weight,
            [e.up.weight for e in m.experts],
            [e.up.bias for e in m.experts],
            [e.down.weight for e in m.experts],
            [e.down.bias for e in m.experts],
            m.topk,
        )
        return out

    return forward


def _fused_forward(p: PatchedMoE, fn: Callable[..., Any]) -> Callable[..., Any]:
    m = p.module
    act = _fused_act(m)
    transposed = bool(getattr(m, "is_transposed", False))

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out, p.counts = fn(
            hidden_states, top_k_index, top_k_weights, m.gate_up_proj, m.down_proj, act, transposed
        )
        return out

    return forward


def _record_router(p: PatchedMoE) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        if isinstance(logits, torch.Tensor):
            p.logits = logits.detach()

    return hook


def _parent(root: nn.Module, name: str) -> nn.Module | None:
    if not name:
        return None
    parent_name = name.rpartition(".")[0]
    return root.get_submodule(parent_name) if parent_name else root
