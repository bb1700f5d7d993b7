"""``attn_implementation="vlmbalance"``: packed attention for any Hugging Face model.

Registered with transformers' ``AttentionInterface`` when :mod:`lightning_vlmbalance.hf` is
imported. Every attention layer of a transformers model calls the registered function with its
``(batch, heads, tokens, head_dim)`` queries, keys and values and passes the forward call's extra
keyword arguments through. The pack's document boundaries arrive under transformers' own varlen
names, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``max_length_q`` / ``max_length_k`` (what
:func:`~lightning_vlmbalance.hf.model_inputs` passes), and the function runs
:func:`~lightning_vlmbalance.packed_attention` on them: every document of the packed row sees only
itself, whatever ``position_ids`` say and whatever the cache setting.

Layers that are not causal (vision towers) and calls without boundaries (generation, a plain
unpacked forward) go to transformers' SDPA implementation unchanged. No attention mask is built
for ``"vlmbalance"``: transformers skips mask creation for an implementation that has no mask
function registered, so a packed step never materialises a ``T x T`` mask.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vlmbalance.attention import packed_attention

__all__ = ["ATTN_IMPLEMENTATION", "register", "vlmbalance_attention"]

ATTN_IMPLEMENTATION = "vlmbalance"


def vlmbalance_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: document-masked attention over a packed row.

    Args follow transformers' attention interface: ``query`` ``(B, H, T, Dh)``, ``key`` and
    ``value`` ``(B, Hkv, T, Dh)``. Returns ``((B, T, H, Dh), None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cu = kwargs.get("cu_seq_lens_q")
    packed = cu is not None and causal and query.shape[2] == key.shape[2]
    if not packed:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation='vlmbalance': a packed batch is one row, got {query.shape[0]}"
            " rows; pass the pack as input_ids of shape (1, T)"
        )
    if dropout and module.training:
        raise ValueError(
            f"attn_implementation='vlmbalance' has no attention dropout ({type(module).__name__}"
            f" asks for {dropout}); set the model config's attention_dropout to 0"
        )
    if torch.compiler.is_compiling():
        # no host reads (graph breaks), and no python int that changes from pack to pack (a
        # recompilation): packed_attention needs only an upper bound of the longest document
        max_len = query.shape[2]
    else:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu and not torch.equal(cu_k.cpu(), cu.cpu()):
            raise ValueError(
                "attn_implementation='vlmbalance': cu_seq_lens_k must equal cu_seq_lens_q"
            )
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())  # a host sync: pass max_length_q to avoid it
        max_len = int(max_len)
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"attn_implementation='vlmbalance' has no attention logit soft-capping"
            f" ({type(module).__name__} asks for softcap={kwargs['softcap']})"
        )
    window = kwargs.get("sliding_window")
    blocks = kwargs.get("vlmbalance_image_blocks")
    if window is None and kwargs.get("vlmbalance_blocks_sliding_only"):
        blocks = None
    out = packed_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu,
        max_len,
        causal=True,
        softmax_scale=scaling,
        window=None if window is None else int(window),
        blocks=blocks,
    )  # (T, H, Dh)
    return out.unsqueeze(0), None


def register() -> None:
    """Registers ``"vlmbalance"`` with transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, vlmbalance_attention)
