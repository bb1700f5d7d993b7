"""A reused pool of host buffers (pinned on CUDA machines) for offloaded activations."""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["HostPool"]

_GRAIN = 512  # bytes: sizes are rounded up to this, so near-equal activations share buffers


class HostPool:
    """Free host buffers by size; :meth:`take` reuses one or allocates, :meth:`give` returns it.

    Args:
        pin: allocate page-locked memory (needed for truly asynchronous copies; CUDA only).
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0  # everything this pool ever allocated and still holds
        self.in_use_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        free = self._free.get(size)
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated_bytes += size
        self.in_use_bytes += size
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        self._free[buf.numel()].append(buf)

    @property
    def free_bytes(self) -> int:
        return self.allocated_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drops the free buffers (buffers in use stay with their owners)."""
        self.allocated_bytes -= sum(b.numel() for bufs in self._free.values() for b in bufs)
        self._free.clear()
