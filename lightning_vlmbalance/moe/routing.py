"""Sort-based top-k MoE dispatch: one stable sort by expert id and one count, no host sync.

Legend: N tokens, K experts per token, S = N*K routed rows, E experts, H hidden.

:func:`route` picks each token's experts; :func:`dispatch` sorts the N*K (token, expert) pairs
by expert with one stable ``argsort`` and counts the rows per expert with one ``scatter_add_``
(fixed shapes: no ``bincount``, ``nonzero``, boolean indexing, ``.item()`` or ``.tolist()``),
so the rows of expert ``e`` are the contiguous slice ``offsets[e-1]:offsets[e]`` of the sorted
order; :func:`combine` puts the expert outputs back in token order and sums them with their
weights. Everything here compiles with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["SCORES", "Dispatch", "combine", "dispatch", "load_balancing_loss", "route"]

SCORES: tuple[str, ...] = ("softmax", "sigmoid")


def route(
    logits_NE: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    renormalize: bool = False,
    bias_E: torch.Tensor | None = None,
    score_dtype: torch.dtype | None = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        logits_NE: router logits.
        top_k: experts per token.
        score: ``"softmax"`` or ``"sigmoid"`` scores.
        renormalize: divide the chosen scores by their sum.
        bias_E: added to the scores for the *selection* only (auxiliary-loss-free balancing:
            the weights stay the unbiased scores).
        score_dtype: dtype the scores are computed in (``None``: the logits' dtype).

    Returns:
        ``(weights_NK, experts_NK, scores_NE)``: chosen scores, expert ids (int64), all scores.
    """
    if score not in SCORES:
        raise ValueError(f"route(score={score!r}): expected one of {SCORES}")
    x = logits_NE if score_dtype is None else logits_NE.to(score_dtype)
    scores_NE = x.softmax(dim=-1) if score == "softmax" else x.sigmoid()
    select_NE = scores_NE if bias_E is None else scores_NE + bias_E.to(scores_NE.dtype)
    _, experts_NK = select_NE.topk(top_k, dim=-1)
    weights_NK = scores_NE.gather(-1, experts_NK)
    if renormalize:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK, experts_NK, scores_NE


class Dispatch(NamedTuple):
    """The routed rows sorted by expert.

    ``order`` (S,): routed slot (``token * K + k``) of each sorted row; ``token`` (S,): its
    token; ``expert`` (S,): its expert (non-decreasing); ``counts`` (E,): rows per expert
    (int32); ``offsets`` (E,): cumulative counts, the end of each expert's slice (int32, as
    ``torch._grouped_mm`` takes them); ``inverse`` (S,): sorted position of each routed slot.
    """

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor


def dispatch(experts_NK: torch.Tensor, num_experts: int) -> Dispatch:
    """One stable sort and one count (see the module docstring)."""
    K = experts_NK.shape[-1]
    flat_S = experts_NK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=flat_S.device)
    counts_E = counts_E.scatter_add(0, flat_S, torch.ones_like(flat_S, dtype=torch.int32))
    offsets_E = counts_E.cumsum(0, dtype=torch.int32)
    arange_S = torch.arange(order_S.numel(), device=order_S.device)
    inverse_S = torch.empty_like(order_S).scatter_(0, order_S, arange_S)
    return Dispatch(order_S, order_S // K, flat_S[order_S], counts_E, offsets_E, inverse_S)


def combine(y_SH: torch.Tensor, d: Dispatch, weights_NK: torch.Tensor) -> torch.Tensor:
    """``out[n] = sum_k weights[n, k] * y[row of (n, k)]`` in the dtype of ``y``: (N, H)."""
    N, K = weights_NK.shape
    y_NKH = y_SH.index_select(0, d.inverse).view(N, K, -1)
    return (y_NKH * weights_NK.unsqueeze(-1).to(y_NKH.dtype)).sum(dim=1)


def load_balancing_loss(scores_NE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``E * sum_e f_e * P_e`` with ``f_e`` the routed
    rows of expert ``e`` per token and ``P_e`` its mean score (1 when perfectly balanced at
    top-1; ``K`` at top-k). The same value as Hugging Face's ``load_balancing_loss_func``."""
    N, E = scores_NE.shape
    f_E = counts_E.to(scores_NE.dtype) / N
    return E * (f_E * scores_NE.mean(dim=0)).sum()
