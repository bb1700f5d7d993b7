"""Grouped matrix product over the rows of each expert: ``out[rows of e] = x[rows of e] @ w[e]``.

``x`` (S, in) holds the routed rows sorted by expert, ``w`` (E, in, out) the experts' weights and
``offsets`` (E,) int32 the end of each expert's rows (see :mod:`.routing`). Two paths:

- ``torch._grouped_mm``: one kernel, no host sync, traced by ``torch.compile`` with
  ``fullgraph=True``. PyTorch's compile support for it is bfloat16 only, and it wants 16-byte
  aligned strides; used for bfloat16 on the CPU and on CUDA devices of compute capability 9.0+.
- ``vlmbalance::grouped_mm_loop``: a custom op that runs one ``mm`` per expert on its contiguous
  slice, writing into one output (never a weight copy per token), with its own backward. It reads
  the offsets on the host (no sync on the CPU; one per call on a GPU) inside the op, so
  ``torch.compile(fullgraph=True)`` still sees one opaque op and no graph break. It is the fastest
  float32 path measured on the CPU (``benchmarks/moe_routing.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MLP_ACTIVATIONS", "grouped_mlp", "grouped_mm", "native_grouped_mm_supported"]


@torch.library.custom_op("vlmbalance::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    if start < x.shape[0]:
        raise ValueError(f"grouped_mm: offsets end at {start} but x has {x.shape[0]} rows")
    return out


@_grouped_mm_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("vlmbalance::grouped_mm_loop_wgrad", mutates_args=())
def _grouped_mm_loop_wgrad(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    out = x.new_zeros(offsets.shape[0], x.shape[1], grad.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end].t(), grad[start:end], out=out[e])
        start = end
    return out


@_grouped_mm_loop_wgrad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    gx = _grouped_mm_loop(grad, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    gw = _grouped_mm_loop_wgrad(x, grad, offsets) if ctx.needs_input_grad[1] else None
    return gx, gw, None


_grouped_mm_loop.register_autograd(_backward, setup_context=_setup_context)


def native_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these (bfloat16, aligned, a capable device)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != x.dtype:
        return False
    if x.shape[-1] % 8 or w.shape[-1] % 8 or not x.is_contiguous():
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``(S, in) x (E, in, out) -> (S, out)`` by expert slices (see the module docstring)."""
    if native_grouped_mm_supported(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    return _grouped_mm_loop(x, w, offsets)


# -- a whole expert MLP per expert slice, forward and backward (cache-friendly on the CPU) --------
#
# Composing the MLP from two grouped products streams (S, F) activations through memory several
# times (act, gate * up, their backward, the cat of the halves' gradients); on the CPU that costs
# more than the products themselves once S = tokens x top-k is large. Here each expert's rows go
# through the whole MLP while they are in cache, in one op for the forward and one for the
# backward. ``w1`` (E, O1, H) and ``w2`` (E, H, F) are in nn.Linear (out, in) layout; gated: O1 =
# 2F, ``act(gate) * up`` with gate first. The forward also returns the pre-activation ``h``
# (S, O1), which the backward needs (autograd would save it too).


def _act(h: torch.Tensor, act: str, gated: bool) -> torch.Tensor:
    if gated:
        g, u = h.chunk(2, dim=-1)
        return _ACT_FNS[act](g) * u
    return _ACT_FNS[act](h)


def _act_and_backward(
    dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, act: str, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, dh)``: the activation recomputed from ``h`` (once) and the gradient of ``h`` for
    the upstream gradient ``dy`` of ``a @ w2.T``."""
    da = dy @ w2
    if gated:
        g, u = h.chunk(2, dim=-1)
        s = _ACT_FNS[act](g)
        return s * u, torch.cat([_ACT_GRADS[act](da * u, g), da * s], dim=-1)
    return _ACT_FNS[act](h), _ACT_GRADS[act](da, h)


_ACT_FNS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}
_ACT_GRADS = {
    "silu": lambda g, x: torch.ops.aten.silu_backward(g, x),
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "gelu_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "relu": lambda g, x: torch.ops.aten.threshold_backward(g, x, 0),
}
MLP_ACTIVATIONS: tuple[str, ...] = tuple(_ACT_FNS)


@torch.library.custom_op("vlmbalance::grouped_mlp", mutates_args=())
def _grouped_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],  # noqa: UP045 - custom_op's schema needs typing.Optional
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],  # noqa: UP045
    offsets: torch.Tensor,
    act: str,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    S = x.shape[0]
    h = x.new_empty(S, w1.shape[1])
    y = x.new_empty(S, w2.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            he = h[start:end]
            torch.mm(x[start:end], w1[e].t(), out=he)
            if b1 is not None:
                he += b1[e]
            torch.mm(_act(he, act, gated), w2[e].t(), out=y[start:end])
            if b2 is not None:
                y[start:end] += b2[e]
        start = end
    if start < S:
        raise ValueError(f"grouped_mlp: offsets end at {start} but x has {S} rows")
    return y, h


@_grouped_mlp.register_fake
def _(x, w1, b1, w2, b2, offsets, act, gated):
    return x.new_empty(x.shape[0], w2.shape[1]), x.new_empty(x.shape[0], w1.shape[1])


@torch.library.custom_op("vlmbalance::grouped_mlp_backward", mutates_args=())
def _grouped_mlp_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    act: str,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty_like(x)  # every row belongs to one expert: all written
    dw1 = torch.empty(w1.shape, dtype=w1.dtype, device=w1.device)
    dw2 = torch.empty(w2.shape, dtype=w2.dtype, device=w2.device)
    db1 = w1.new_empty(w1.shape[0], w1.shape[1])
    db2 = w2.new_empty(w2.shape[0], w2.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            xe, he, dye = x[start:end], h[start:end], dy[start:end]
            a, dh = _act_and_backward(dye, w2[e], he, act, gated)
            torch.mm(dye.t(), a, out=dw2[e])
            torch.sum(dye, dim=0, out=db2[e])
            torch.mm(dh.t(), xe, out=dw1[e])
            torch.sum(dh, dim=0, out=db1[e])
            torch.mm(dh, w1[e], out=dx[start:end])
        else:  # an expert without rows: zero gradients
            dw1[e].zero_()
            dw2[e].zero_()
            db1[e].zero_()
            db2[e].zero_()
        start = end
    return dx, dw1, db1, dw2, db2


@_grouped_mlp_backward.register_fake
def _(dy, x, h, w1, w2, offsets, act, gated):
    return (
        torch.empty_like(x),
        w1.new_empty(w1.shape),
        w1.new_empty(w1.shape[0], w1.shape[1]),
        w2.new_empty(w2.shape),
        w2.new_empty(w2.shape[0], w2.shape[1]),
    )


def _mlp_setup_context(ctx, inputs, output) -> None:
    x, w1, b1, w2, b2, offsets, act, gated = inputs
    ctx.save_for_backward(x, w1, w2, offsets, output[1])
    ctx.act, ctx.gated = act, gated
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None


def _mlp_backward(ctx, dy: torch.Tensor, _dh: torch.Tensor):
    x, w1, w2, offsets, h = ctx.saved_tensors
    dx, dw1, db1, dw2, db2 = _grouped_mlp_backward(
        dy.contiguous(), x, h, w1, w2, offsets, ctx.act, ctx.gated
    )
    return (
        dx,
        dw1,
        db1 if ctx.has_b1 else None,
        dw2,
        db2 if ctx.has_b2 else None,
        None,
        None,
        None,
    )


_grouped_mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup_context)


def grouped_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    offsets: torch.Tensor,
    *,
    act: str,
    gated: bool,
) -> torch.Tensor:
    """Each expert's MLP on its slice of the sorted rows: ``act(x @ w1[e].T + b1[e]) @ w2[e].T
    + b2[e]`` (gated: ``act(gate) * up`` from the two halves of ``x @ w1[e].T``).

    bfloat16 on a capable device: two ``torch._grouped_mm`` (compiles into one graph). Elsewhere:
    one custom op per direction that runs the whole MLP expert by expert (cache-friendly)."""
    if act not in _ACT_FNS:
        raise ValueError(f"grouped_mlp(act={act!r}): expected one of {MLP_ACTIVATIONS}")
    if native_grouped_mm_supported(x, w1) and w1.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0:
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        if b1 is not None:
            h = h + _rows_bias(b1, offsets, x.shape[0])
        y = torch._grouped_mm(_act(h, act, gated), w2.transpose(1, 2), offs=offsets)
        return y if b2 is None else y + _rows_bias(b2, offsets, x.shape[0])
    y, _ = _grouped_mlp(x.contiguous(), w1, b1, w2, b2, offsets, act, gated)
    return y


def _rows_bias(b: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """``b[expert of row]`` for each sorted row, without a host sync."""
    arange = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    expert = torch.searchsorted(offsets, arange, right=True)
    return b.index_select(0, expert)
