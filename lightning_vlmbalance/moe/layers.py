"""Sorted-dispatch MoE forwards, and the patching of existing MoE modules to use them.

Two module layouts are recognised:

- **expert list** (the example VLM's ``MoEFeedForward``, which declares
  ``vlmbalance_moe = {"act": "gelu", "renormalize": True}`` for its forward; a subclass that
  overrides ``forward`` must declare it again): a bias-free ``router``
  ``nn.Linear``, a ``topk`` attribute and ``experts``, an ``nn.ModuleList`` of modules with
  ``up`` and ``down`` ``nn.Linear`` layers (GELU between). The experts' weights are stacked
  per forward, a copy of E x (2 x H x F) elements, so that the grouped products see one
  (E, out, in) tensor; the parameters, and so checkpoints and optimizers, stay as they are.
- **fused experts** (Hugging Face transformers 5 sparse-MoE blocks such as Mixtral and Qwen3-MoE):
  an ``experts`` module with 3-D ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F) called as
  ``experts(hidden, top_k_index, top_k_weights)``, whose forward is transformers' own (not a
  subclass's, another library's or a model's own), with the default ``act(gate) * up`` gating, no
  biases, no post-expert norm and no expert parallelism (anything else is left alone); the
  block's own router (softmax or sigmoid, top-k, renormalisation) is kept, only the expert
  dispatch and compute are replaced.

:func:`unsupported_moe_modules` names the modules that look like MoE layers but are left alone,
each with the reason.

Both forwards are one function shared by every layer (weights are arguments), so
``torch.compile`` builds one graph for all layers instead of one per layer.

A patched module's forward is bound to its :class:`PatchedMoE` record, which ``copy.deepcopy``
copies along with the module: a copy made after patching (a frozen reference or a teacher)
computes with its own weights into its own record, and :func:`unpatch_moe_modules` restores
the copies that are still alive together with the original.
"""

from __future__ import annotations

import copy
import logging
import types
import weakref
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
    """One patched module and its latest router statistics (tensors, never synced here).

    The module's forward and its router's hook are bound to this record, so a deep copy of the
    module copies the record with it (see :meth:`__deepcopy__`)."""

    name: str
    kind: str  # "expert_list" or "fused_experts"
    module: nn.Module
    router: nn.Module | None = None
    score: str | None = "softmax"  # the router's scoring: "softmax", "sigmoid", None (unknown)
    counts: torch.Tensor | None = None  # tokens routed to each expert (int32, E)
    scores: torch.Tensor | None = None  # router scores (N, E), detached (expert list)
    logits: torch.Tensor | None = None  # router logits (N, E), detached (fused: from the hook)
    handles: list[Any] = field(default_factory=list)
    # the sorted dispatch (compiled or not), shared by every layer and every copy
    dispatch_fn: Callable[..., Any] | None = field(default=None, repr=False, compare=False)
    # the deep copies of the module made while patched (shared by the record and its copies)
    copies: list[weakref.ref[PatchedMoE]] = field(default_factory=list, repr=False, compare=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> PatchedMoE:
        """The record of a deep copy of the patched module (a frozen reference or a teacher
        copied from a patched model): it points at the copy's module, router and hook handles,
        so the copy computes with its own weights and records its own statistics (none yet).
        It is registered with the original, whose :func:`unpatch_moe_modules` restores it."""
        new = copy.copy(self)  # name, kind, score, dispatch_fn and the shared `copies`
        memo[id(self)] = new  # before the module: its forward leads back to this record
        new.module = copy.deepcopy(self.module, memo)
        new.router = copy.deepcopy(self.router, memo)
        new.handles = copy.deepcopy(self.handles, memo)  # to the copied router's hook dicts
        new.counts = new.scores = new.logits = None
        self.copies.append(weakref.ref(new))
        return new

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
    not enough: a lookalike with another activation would silently change its outputs. The
    declaration covers the forward of the class that makes it: a subclass inherits it only
    while it keeps that forward (one that overrides ``forward`` declares it again)."""
    problems = []
    cls = type(m)
    declarer = next((c for c in cls.__mro__ if "vlmbalance_moe" in vars(c)), None)
    spec = vars(declarer)["vlmbalance_moe"] if declarer is not None else None
    if spec is None:
        problems.append(
            f"it does not declare `vlmbalance_moe = {_EXPERT_LIST_SPEC!r}` (what its forward"
            " computes)"
        )
    elif spec != _EXPERT_LIST_SPEC:
        problems.append(f"`vlmbalance_moe = {spec!r}` is not {_EXPERT_LIST_SPEC!r}")
    elif cls.forward is not declarer.forward:
        problems.append(
            f"its forward (`{_name_of(cls.forward)}`) is not `{_name_of(declarer.forward)}`,"
            f" the forward `{declarer.__qualname__}.vlmbalance_moe` describes (a subclass with"
            " its own forward must declare `vlmbalance_moe` itself)"
        )
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


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _transformers_forward(cls: type) -> bool:
    """Whether the forward that instances of ``cls`` run is transformers' own: defined by a
    class of a ``transformers.`` module, and not a function from elsewhere assigned to it."""
    owner = next((c for c in cls.__mro__ if "forward" in vars(c)), None)
    return (
        owner is not None
        and owner.__module__.startswith("transformers.")
        and str(getattr(owner.forward, "__module__", "")).startswith("transformers.")
    )


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
    """Why ``m`` (3-D expert weights) is not patched; empty when it is. Its forward must be
    transformers' own: the layout flags checked here describe that forward, and a subclass's,
    another library's or a model's own may compute anything with the same weights."""
    problems = []
    if not _transformers_forward(type(m)):
        problems.append(
            f"its forward (`{_name_of(type(m).forward)}`) is not a transformers experts forward"
            " (only those are known to compute `act(gate) * up` per expert)"
        )
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
            p = PatchedMoE(name, "expert_list", m, dispatch_fn=list_fn)
            m.forward = types.MethodType(_expert_list_forward, p)
            patched.append(p)
        elif _is_fused_experts(m):
            p = PatchedMoE(name, "fused_experts", m, dispatch_fn=fused_fn)
            m.forward = types.MethodType(_fused_forward, p)
            parent = _parent(root, name)
            router = getattr(parent, "gate", None) if parent is not None else None
            if isinstance(router, nn.Module):
                p.router = router
                p.score = _router_score(router, m, parent)
                hook = types.MethodType(_record_router_logits, p)
                p.handles.append(router.register_forward_hook(hook))
            patched.append(p)
    return patched


def unpatch_moe_modules(patched: list[PatchedMoE]) -> None:
    """Restores the original forwards and removes the router hooks, of the patched modules and
    of their deep copies that are still alive."""
    for p in patched:
        for ref in p.copies:
            c = ref()
            if c is not None:
                _unpatch(c)
        p.copies.clear()
        _unpatch(p)


def _unpatch(p: PatchedMoE) -> None:
    forward = p.module.__dict__.get("forward")
    if getattr(forward, "__self__", None) is p:  # not a forward someone set since
        del p.module.__dict__["forward"]
    for h in p.handles:
        h.remove()
    p.handles.clear()


def _expert_list_forward(p: PatchedMoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The forward of a patched expert-list module, bound to its record ``p``."""
    m = p.module
    out, p.counts, p.scores = p.dispatch_fn(
        x_TD,
        m.router.weight,
        [e.up.weight for e in m.experts],
        [e.up.bias for e in m.experts],
        [e.down.weight for e in m.experts],
        [e.down.bias for e in m.experts],
        m.topk,
    )
    return out


def _fused_forward(
    p: PatchedMoE,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The forward of patched fused experts, bound to their record ``p``."""
    m = p.module
    out, p.counts = p.dispatch_fn(
        hidden_states,
        top_k_index,
        top_k_weights,
        m.gate_up_proj,
        m.down_proj,
        _fused_act(m),
        bool(getattr(m, "is_transposed", False)),
    )
    return out


def _record_router_logits(p: PatchedMoE, module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a fused-experts block's router, bound to the record ``p``."""
    logits = output[0] if isinstance(output, tuple) else output
    if isinstance(logits, torch.Tensor):
        p.logits = logits.detach()


def _parent(root: nn.Module, name: str) -> nn.Module | None:
    if not name:
        return None
    parent_name = name.rpartition(".")[0]
    return root.get_submodule(parent_name) if parent_name else root
