"""A reused pool of host buffers (pinned on CUDA machines) for offloaded activations."""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch

__all__ = ["HostPool"]

_GRAIN = 512  # bytes: sizes are rounded up to this, so near-equal activations share buffers


class HostPool:
    """Free host buffers by size; :meth:`take` reuses the smallest free buffer that holds the
    request (at most twice its size, so small tensors do not pin big buffers) or allocates one;
    :meth:`give` returns it. Activations whose sizes vary from pack to pack (vision tokens) thus
    share buffers instead of each new size pinning new memory.

    Args:
        pin: allocate page-locked memory (needed for truly asynchronous copies; CUDA only).
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._sizes: list[int] = []  # sorted sizes that have a free buffer
        self.allocated_bytes = 0  # everything this pool ever allocated and still holds
        self.in_use_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        i = bisect.bisect_left(self._sizes, size)
        if i < len(self._sizes) and self._sizes[i] <= 2 * size:
            fit = self._sizes[i]
            buf = self._free[fit].pop()
            if not self._free[fit]:
                del self._sizes[i]
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated_bytes += size
        self.in_use_bytes += buf.numel()
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        if not self._free[buf.numel()]:
            bisect.insort(self._sizes, buf.numel())
        self._free[buf.numel()].append(buf)

    @property
    def free_bytes(self) -> int:
        return self.allocated_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drops the free buffers (buffers in use stay with their owners)."""
        self.allocated_bytes -= sum(b.numel() for bufs in self._free.values() for b in bufs)
        self._free.clear()
        self._sizes.clear()
