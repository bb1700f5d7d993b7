"""Linear-attention (recurrent) layers on packed rows: each document starts from a zero state.

Qwen3.5's Gated DeltaNet layers carry a short causal convolution and a recurrent state along the
row. In a packed row both would run from one document into the next: the convolution reads the
previous document's last ``kernel - 1`` tokens and the state carries its memory (measured on a
tiny Qwen3.5: 1.3e-2 on the next document's logits). transformers keeps documents apart there
only with the CUDA kernels of ``flash-linear-attention`` and ``causal-conv1d``, and refuses
``cu_seq_lens_q`` on the PyTorch path.

:func:`per_document` wraps such a layer: on a packed call (``cu_seq_lens_q`` given) it runs the
layer's own forward once per document, on that document's slice of the row with no cache, and
concatenates the outputs. Every document is then computed exactly as it is alone, on every
device and with every kernel; the price is one call per document per layer (the layers' own
varlen kernels would do it in one; see ``docs/hugging_face.md``).
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch

__all__ = ["LINEAR_ATTENTION", "is_linear_attention", "per_document"]

# class names of the linear-attention layers wrapped by prepare_model
LINEAR_ATTENTION = ("GatedDeltaNet",)
_PACKED_KEYS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
    "vlmbalance_doc_bounds",
)


def is_linear_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith(LINEAR_ATTENTION)


def per_document(module: torch.nn.Module) -> None:
    """Makes ``module`` (a linear-attention layer) run each document of a packed row alone
    (idempotent). The wrapper is a method bound to ``module``: a ``copy.deepcopy`` of the model
    rebinds it to the copy (a closure would keep calling the original's weights)."""
    if getattr(module, "_vlmbalance_per_document", False):
        return
    module.forward = types.MethodType(_packed_forward, module)
    module._vlmbalance_per_document = True


# under torch.compile the per-document loop would recompile for every new document count (its
# bounds are python ints): the layer runs eagerly between the compiled parts
@torch.compiler.disable
def _packed_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    original = type(self).forward
    cu = kwargs.get("cu_seq_lens_q")
    # the boundaries as host ints, read once per forward by model_inputs (from cu_seq_lens_q
    # itself only if not given: a device-to-host read in every layer)
    bounds = kwargs.get("vlmbalance_doc_bounds")
    for key in _PACKED_KEYS:
        kwargs.pop(key, None)
    if cu is None:
        return original(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if cache is not None or hidden_states.shape[0] != 1:
        raise ValueError(
            f"{type(self).__name__}: a packed row is one row without a cache (got"
            f" {hidden_states.shape[0]} rows, cache {type(cache).__name__})"
        )
    parts = [
        original(self, hidden_states[:, a:b], cache=None, attention_mask=None, **kwargs)
        for a, b in itertools.pairwise(cu.tolist() if bounds is None else bounds)
    ]
    return torch.cat(parts, dim=1)
