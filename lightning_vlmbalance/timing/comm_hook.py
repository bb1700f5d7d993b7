"""A DDP communication hook wrapper that marks when each gradient bucket is handed over.

It adds no collective: it calls the wrapped hook (the user's, or DDP's default all-reduce) and
records a mark before it. The last mark of a backward is when this rank's gradients were ready;
the time from there to the end of ``backward`` is the wait for the slowest rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["timed_comm_hook"]

CommHook = Callable[[Any, torch.distributed.GradBucket], torch.futures.Future]


def timed_comm_hook(on_bucket: Callable[[], None], inner: CommHook | None = None) -> CommHook:
    """Wraps ``inner`` (default: DDP's plain averaging all-reduce) so ``on_bucket`` runs first."""
    inner = inner or allreduce_hook

    def hook(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future:
        on_bucket()
        return inner(state, bucket)

    hook.__wrapped__ = inner  # type: ignore[attr-defined]
    hook.__name__ = f"timed_{getattr(inner, '__name__', 'hook')}"
    return hook
