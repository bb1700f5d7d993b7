"""Packed (document-masked) attention over a varlen batch.

Tokens of several documents are concatenated into one sequence; each token attends only to tokens
of its own document (causally or not). The boundaries come as ``cu_seqlens`` (int32, ``D + 1``
offsets) and ``max_seqlen`` (a python int), built once per batch by the collator and shared by every
layer, so no layer recomputes them and none needs a device-to-host sync.

Backends, chosen per call (``backend="auto"``) or named:

* ``"flash_attn"``: flash-attn's varlen kernel, on CUDA in fp16/bf16 when flash-attn is installed
  (the optional extra ``flash``);
* ``"varlen"``: PyTorch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch
  2.13+), on CUDA in fp16/bf16 without flash-attn: the GPU fast path with no source build;
* ``"sdpa"``: PyTorch's ``scaled_dot_product_attention`` on one of two layouts, chosen from shapes
  alone (python ints, no sync): documents gathered into a padded ``(D, max_seqlen)`` batch when
  that costs less than the dense layout, else the whole sequence with a block-diagonal mask. Runs
  everywhere (the CPU path).

Under ``torch.compile`` (``fullgraph=True`` works) the host-side metadata check is skipped (its
reads would be graph breaks) and the SDPA backend always takes the block-diagonal layout, whose
shapes are the pack's token count only; :func:`mark_pack_dynamic` marks the sizes that still change
from pack to pack (documents, images, image tokens) dynamic before the call, so a model compiles
at most twice (see ``docs/packed_attention.md``, "torch.compile").
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["attention_backend", "flash_attn_available", "mark_pack_dynamic", "packed_attention"]

_FLASH = importlib.util.find_spec("flash_attn") is not None
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_ARGS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # a torch without it
    _varlen_attn, _VARLEN_ARGS = None, frozenset()
BACKENDS = ("auto", "flash_attn", "varlen", "sdpa")


def flash_attn_available() -> bool:
    """Whether flash-attn is importable (it is an optional extra, CUDA only)."""
    return _FLASH


def attention_backend(q: torch.Tensor) -> str:
    """The backend ``packed_attention(backend="auto")`` uses for queries like ``q``."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if _FLASH:
            return "flash_attn"
        if _varlen_attn is not None:
            return "varlen"
    return "sdpa"


# a PackedBatch's tensors whose first dimension changes from pack to pack (the tokens do not)
_PACK_VARYING = ("cu_seqlens", "image_cu_seqlens", "pixel_values", "image_positions")


def mark_pack_dynamic(batch: dict[str, Any]) -> dict[str, Any]:
    """Marks the sizes of ``batch`` that change from pack to pack as dynamic for ``torch.compile``.

    Call it on every batch before the compiled model (the example VLM does in
    ``on_after_batch_transfer``). Without it, dynamo compiles the first pack with static sizes and
    recompiles for each size that changes, then dynamically, so the count depends on the order
    of the packs; with it the model compiles once for packs with images and once for packs
    without (a size of 0 or 1 is always specialised). Marking is a hint: no cost in eager runs.

    Args:
        batch: a ``PackedBatch``; the first dimension of ``cu_seqlens``, ``image_cu_seqlens``,
            ``pixel_values`` and ``image_positions`` is marked, where present.

    Returns:
        ``batch`` itself.
    """
    for key in _PACK_VARYING:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim():
            torch._dynamo.maybe_mark_dynamic(value, 0)
    return batch


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    *,
    window: int | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each document of a packed sequence.

    Args:
        q: ``(T, H, Dh)`` queries of all documents, concatenated.
        k: ``(T, Hkv, Dh)`` keys; ``Hkv`` divides ``H`` (grouped-query attention).
        v: ``(T, Hkv, Dh)`` values.
        cu_seqlens: ``(D + 1,)`` int32 document offsets, ``cu_seqlens[-1] == T``.
        max_seqlen: length of the longest document (python int); under ``torch.compile`` it is
            not read (``T`` bounds it), so a changing value recompiles nothing.
        causal: mask future tokens of the same document.
        softmax_scale: defaults to ``Dh ** -0.5``.
        backend: ``"auto"`` (see :func:`attention_backend`), or ``"flash_attn"``, ``"varlen"``,
            ``"sdpa"`` to force one (the first two need CUDA and fp16/bf16).
        window: a causal sliding window (transformers' ``sliding_window``): a query at ``i``
            sees keys at ``j > i - window`` only (of its own document).
        blocks: ``(T,)`` integer block ids; tokens with the same positive id see each other in
            both directions (Gemma's attention within an image), still within their document
            and ``window``; ``0`` (or less) is no block. The varlen kernels have no such mask:
            with ``blocks`` the SDPA backend runs.

    Returns:
        ``(T, H, Dh)`` attention output.
    """
    T, H = q.shape[:2]
    if k.shape[0] != T or v.shape != k.shape or H % k.shape[1]:
        raise ValueError(
            f"packed_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do"
            " not fit (T must match, k and v must have the same shape, Hkv must divide H)"
        )
    compiling = torch.compiler.is_compiling()
    # checking costs no device sync on the CPU; under torch.compile the reads would be graph
    # breaks (``Tensor.item()``), so a compiled model is checked in eager runs only
    if cu_seqlens.device.type == "cpu" and not compiling:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[-1]) != T or (lens.numel() and int(lens.max()) > max_seqlen):
            raise ValueError(
                f"packed_attention: cu_seqlens end at {int(cu_seqlens[-1])} for {T} tokens and"
                f" the longest document has {int(lens.max()) if lens.numel() else 0} tokens,"
                f" `max_seqlen={max_seqlen}`: the metadata does not describe this batch"
            )
    if T == 0:  # an empty batch (e.g. a pack with no images): keep k and v in the graph
        return q + (k.sum() + v.sum()) * 0
    if backend not in BACKENDS:
        raise ValueError(f"packed_attention: `backend={backend!r}` is not one of {BACKENDS}")
    if window is not None and window < 1:
        raise ValueError(f"packed_attention: `window={window}` must be a positive token count")
    if blocks is not None and (blocks.dim() != 1 or blocks.shape[0] != T):
        raise ValueError(
            f"packed_attention: `blocks` has shape {tuple(blocks.shape)}, expected ({T},)"
        )
    if blocks is not None and not causal:
        blocks = None  # every token already sees its whole document
    if backend == "auto":
        backend = "sdpa" if blocks is not None else attention_backend(q)
    elif blocks is not None and backend != "sdpa":
        raise ValueError(
            f"packed_attention: `backend={backend!r}` has no block mask; `blocks` needs 'sdpa'"
        )
    elif backend != "sdpa" and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(
            f"packed_attention: `backend={backend!r}` needs CUDA fp16/bf16 tensors, got"
            f" {q.device.type} {q.dtype}"
        )
    if compiling:
        # an upper bound serves the varlen kernels (only their grid grows) and, unlike the pack's
        # own int, is no guard that recompiles when the longest document changes
        max_seqlen = T
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        extra = {} if window is None else {"window_size": (window - 1, window - 1)}
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            causal=causal,
            softmax_scale=softmax_scale,
            **extra,
        )
    if backend == "varlen":
        if _varlen_attn is None:
            raise ValueError("packed_attention: this torch has no torch.nn.attention.varlen")
        return _torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, window)
    if k.shape[1] != H:  # SDPA's enable_gqa is not on every backend: expand explicitly
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    D = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    if compiling:
        # the padded layout's shapes (D, max_seqlen) change from pack to pack and each change
        # would recompile; the block-diagonal mask's shapes are the pack's T only
        return _block_diagonal(q, k, v, cu, causal, softmax_scale, window, blocks)
    if D * max_seqlen * max_seqlen <= T * T:
        return _padded_documents(q, k, v, cu, D, max_seqlen, causal, softmax_scale, window, blocks)
    return _block_diagonal(q, k, v, cu, causal, softmax_scale, window, blocks)


def _torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``, across the torch versions that have it (2.13
    names causality ``window_size=(-1, 0)`` and takes ``enable_gqa``; earlier ones ``is_causal``
    and need the key/value heads expanded)."""
    kwargs: dict = {"scale": scale}
    if "window_size" in _VARLEN_ARGS:
        left = -1 if window is None else window - 1
        kwargs["window_size"] = (left, 0) if causal else (left, left)
    elif window is not None:
        raise ValueError("packed_attention: this torch's varlen_attn has no sliding window")
    else:
        kwargs["is_causal"] = causal
    H = q.shape[1]
    if k.shape[1] != H:
        if "enable_gqa" in _VARLEN_ARGS:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(H // k.shape[1], dim=1)
            v = v.repeat_interleave(H // v.shape[1], dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _padded_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    D: int,
    M: int,
    causal: bool,
    scale: float | None,
    window: int | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Legend: T tokens, D documents, M = max_seqlen, H heads, Dh head dim.
    T, H, Dh = q.shape
    starts_D1 = cu[:-1, None]
    lens_D1 = cu[1:, None] - starts_D1
    offs_1M = torch.arange(M, device=q.device)[None, :]
    valid_DM = offs_1M < lens_D1
    src_DM = torch.where(valid_DM, starts_D1 + offs_1M, 0)

    def gather(x: torch.Tensor) -> torch.Tensor:  # (T, H, Dh) -> (D, H, M, Dh)
        return x[src_DM.reshape(-1)].reshape(D, M, H, Dh).transpose(1, 2)

    mask = None
    if not causal:  # padded keys must not be attended; with causal they come after every query
        mask = valid_DM[:, None, None, :]
    if window is not None or blocks is not None:
        i_M1, j_1M = offs_1M.reshape(M, 1), offs_1M
        block_DM = None if blocks is None else torch.where(valid_DM, blocks[src_DM], 0)
        allowed = _allowed(i_M1, j_1M, causal, window, block_DM)  # (D or 1, M, M)
        # a padded query row keeps its first key (no all-masked row: NaN in the backward)
        allowed = allowed & valid_DM[:, None, :] | (~valid_DM[:, :, None] & (j_1M == 0))
        mask, causal = allowed[:, None], False
    out_DHMd = F.scaled_dot_product_attention(
        gather(q), gather(k), gather(v), attn_mask=mask, is_causal=causal, scale=scale
    )
    # back to (T, H, Dh): token t sits in document doc(t) at offset t - start(doc(t))
    t = torch.arange(T, device=q.device)
    doc_T = torch.searchsorted(cu, t, right=True) - 1
    flat_T = doc_T * M + (t - cu[doc_T])
    return out_DHMd.transpose(1, 2).reshape(D * M, H, Dh)[flat_T]


def _allowed(
    i: torch.Tensor,
    j: torch.Tensor,
    causal: bool,
    window: int | None,
    block: torch.Tensor | None,
) -> torch.Tensor:
    """Which keys ``j`` each query ``i`` may see within one document (query offsets ``(M, 1)``,
    key offsets ``(1, M)``; ``block`` ``(B, M)`` per-token block ids or ``None``): causal or in
    the same positive block, and inside the causal window (transformers' masks:
    ``and(window, or(causal, same block))``). Returns ``(B or 1, M, M)``."""
    ok = (i >= j) if causal else torch.ones_like(i >= j)
    ok = ok[None]
    if block is not None:
        ok = ok | ((block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0))
    if window is not None:
        ok = ok & (j > i - window)[None]
    return ok


def _block_diagonal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: int | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    T = q.shape[0]
    t = torch.arange(T, device=q.device)
    doc_T = torch.searchsorted(cu, t, right=True) - 1
    mask_TT = doc_T[:, None] == doc_T[None, :]
    if causal or window is not None:
        mask_TT &= _allowed(
            t[:, None], t[None, :], causal, window, None if blocks is None else blocks[None]
        )[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask_TT,
        scale=scale,
    )  # (1, H, T, Dh)
    return out[0].transpose(0, 1)
