"""Saved-tensor hooks that offload activations to host memory and bring them back in time.

During forward, every activation autograd saves (not parameters or buffers, at least
``min_bytes``) is copied into a reused host buffer on an *offload* side stream; the device copy
is released once that copy has finished (the compute stream never waits for it). During
backward, when autograd asks for a saved tensor, it is brought back on a *reload* side stream and
the next ``prefetch`` tensors, in reverse order of saving (the order backward needs them), are
started too: double buffering, so the copy of the next tensor runs while the current backward
computes. The compute stream waits on the one event of the tensor it is about to use. A host
buffer goes back to the pool only when its handle is gone and its reload has finished (checked
without blocking; a buffer whose reload still runs waits in a queue).

A saved tensor that is still alive on the device when backward needs it (the last layers'
activations whose copy is still running, or a tensor someone else keeps) is used directly, with
no reload. A tensor saved twice (or two identical views) is offloaded once.

``test_mode=True`` runs the same machinery on the CPU (unpinned buffers, synchronous copies): the
tests use it, and it is of no use for speed.

Without offload, autograd reports an in-place change of a saved tensor; saved-tensor hooks bypass
that check, so the offloader keeps it: the tensor's version counter is compared while the tensor
is still alive (as long as autograd's own check would see it), and backward then raises the same
error. A change made after the last reference is gone cannot be seen (nor can it affect anyone).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lightning_vlmbalance.offload.pool import HostPool

__all__ = ["OFFLOAD_MODES", "ActivationOffloader", "offload_activations"]

OFFLOAD_MODES: tuple[str, ...] = ("all", "checkpoint")


class _Sequence:
    """The handles of one forward, in the order they were saved (weak references)."""

    __slots__ = ("handles",)

    def __init__(self) -> None:
        self.handles: list[weakref.ref[_Handle]] = []


class _Handle:
    """What autograd keeps instead of a device tensor."""

    __slots__ = (
        "__weakref__",
        "buf",
        "copied",
        "device_copy",
        "dtype",
        "host",
        "index",
        "modified",
        "owner",
        "reloaded",
        "seq",
        "shape",
        "src",
        "src_ref",
        "stride",
        "version",
    )

    def __del__(self) -> None:
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner._release(self)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` elements of storage (any dimension order)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class ActivationOffloader:
    """Offloads saved activations while active (``with offloader: loss = model(x)``).

    Reusable: enter it around each forward; the backward may run after the ``with`` block.

    Args:
        mode: ``"all"`` (every saved activation) or ``"checkpoint"`` (only tensors passed to
            :meth:`mark`, e.g. the inputs of checkpointed blocks: one tensor per block).
        min_bytes: smaller tensors stay on the device.
        prefetch: tensors reloaded ahead of the one backward needs (0: reload on demand).
        device: the compute device (default: the current CUDA device; the CPU in test mode).
        test_mode: run the machinery on the CPU (synchronous copies), for tests.
        exclude: tensors never offloaded (parameters and buffers; matched by storage).

    Raises:
        ValueError: for a bad setting, or without CUDA outside test mode.
    """

    def __init__(
        self,
        *,
        mode: str = "all",
        min_bytes: int = 1 << 16,
        prefetch: int = 2,
        device: torch.device | str | None = None,
        test_mode: bool = False,
        exclude: Iterable[torch.Tensor] = (),
    ) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"`ActivationOffloader(mode={mode!r})`: expected {OFFLOAD_MODES}")
        if min_bytes < 0 or prefetch < 0:
            raise ValueError(
                f"`ActivationOffloader(min_bytes={min_bytes}, prefetch={prefetch})` must be >= 0"
            )
        if not test_mode and not torch.cuda.is_available():
            raise ValueError(
                "ActivationOffloader needs a CUDA device (there is nothing faster to offload"
                " from on the CPU); `test_mode=True` runs the hook machinery on the CPU"
            )
        self.mode = mode
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.test_mode = test_mode
        if device is None:
            device = "cpu" if test_mode else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0"
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != ("cpu" if test_mode else "cuda"):
            raise ValueError(
                f"`ActivationOffloader(device={self.device})`: expected a"
                f" {'CPU' if test_mode else 'CUDA'} device{' in test mode' if test_mode else ''}"
            )
        self.pool = HostPool(pin=not test_mode)
        cuda = not test_mode
        self._offload_stream = torch.cuda.Stream(self.device) if cuda else None
        self._reload_stream = torch.cuda.Stream(self.device) if cuda else None
        self._lock = threading.RLock()
        self._excluded: set[int] = set()
        self.exclude(exclude)
        self._marked: dict[tuple, weakref.ref[torch.Tensor]] = {}
        self._seq = _Sequence()
        self._by_key: dict[tuple, weakref.ref[_Handle]] = {}
        self._in_flight: deque[_Handle] = deque()  # device-to-host copies maybe still running
        self._deferred: deque[tuple[Any, torch.Tensor]] = deque()  # (reload event, buffer)
        self._hooks: Any = None
        self.live_handles = 0
        self.counters = {"offloaded_tensors": 0, "offloaded_bytes": 0, "reloaded_tensors": 0}
        self.counters.update(prefetched_tensors=0, kept_on_device=0)

    # -- configuration ----------------------------------------------------------------------

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never offload these tensors or views of their storage (parameters, buffers)."""
        for t in tensors:
            local = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2, tensor parallel): its shard
            try:
                self._excluded.add(local.untyped_storage().data_ptr())
            except RuntimeError:  # no storage to point at (FSDP2's freed unsharded parameters)
                continue

    def mark(self, t: torch.Tensor) -> None:
        """In ``"checkpoint"`` mode: offload ``t`` when autograd saves it (during this forward)."""
        if isinstance(t, torch.Tensor) and self._hooks is not None:
            self._marked[self._key(t)] = weakref.ref(t)

    # -- the context ------------------------------------------------------------------------

    def __enter__(self) -> ActivationOffloader:
        if self._hooks is not None:
            raise RuntimeError("ActivationOffloader is already active (not re-entrant)")
        self._seq = _Sequence()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)
        self._by_key.clear()
        self._marked.clear()
        self._retire()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def stats(self) -> dict[str, int]:
        """Counters since creation, and the current pool and handle sizes."""
        return {
            **self.counters,
            "live_handles": self.live_handles,
            "pool_bytes": self.pool.allocated_bytes,
            "pool_in_use_bytes": self.pool.in_use_bytes,
        }

    def close(self) -> None:
        """Leaves the context if active, waits for copies in flight, frees the free buffers."""
        if self._hooks is not None:
            self.__exit__(None, None, None)
        if self._offload_stream is not None:
            self._offload_stream.synchronize()
            self._reload_stream.synchronize()  # type: ignore[union-attr]
        self._retire()  # every copy has finished: returns all deferred buffers
        self.pool.clear()

    # -- hooks ------------------------------------------------------------------------------

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t._version,
        )

    def _eligible(self, t: torch.Tensor) -> bool:
        return (
            type(t) is torch.Tensor  # not a Parameter, nor a subclass (DTensor, fake tensors)
            and not (t.is_leaf and t.requires_grad)
            and t.layout == torch.strided
            and t.device == self.device
            and t.numel() * t.element_size() >= max(self.min_bytes, 1)
            and t.untyped_storage().data_ptr() not in self._excluded
        )

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._eligible(t):
            return t
        key = self._key(t)
        if self.mode == "checkpoint" and not _alive(self._marked.get(key)):
            return t  # not marked (a dead mark's memory may hold a new tensor: not that one)
        ref = self._by_key.get(key)
        same = ref() if ref is not None else None
        # saved twice, or an identical view: one copy. Only while the first tensor lives: after
        # that its memory may hold a new tensor with the same address and shape.
        if same is not None and (same.src is not None or _alive(same.src_ref)):
            return same
        with self._lock:
            self._retire()
            h = self._offload(t)
        self._by_key[key] = weakref.ref(h)
        return h

    def _offload(self, t: torch.Tensor) -> _Handle:
        nbytes = t.numel() * t.element_size()
        h = _Handle()
        h.shape, h.dtype, h.version = tuple(t.shape), t.dtype, t._version
        h.stride = tuple(t.stride()) if _dense(t) else None  # keep layouts: same kernels later
        h.buf = self.pool.take(nbytes)
        flat = h.buf[:nbytes].view(t.dtype)
        h.host = flat.as_strided(h.shape, h.stride) if h.stride else flat.view(h.shape)
        h.device_copy = h.reloaded = h.src_ref = None
        h.modified = False
        h.seq, h.index = self._seq, len(self._seq.handles)
        self._seq.handles.append(weakref.ref(h))
        h.owner = self
        self.live_handles += 1
        if self._offload_stream is None:
            h.host.copy_(t)
            h.copied, h.src, h.src_ref = None, None, weakref.ref(t)
        else:
            self._offload_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._offload_stream):
                h.host.copy_(t, non_blocking=True)
                h.copied = torch.cuda.Event()
                h.copied.record()
            h.src = t  # released once the copy is known to be done (_retire)
            self._in_flight.append(h)
        self.counters["offloaded_tensors"] += 1
        self.counters["offloaded_bytes"] += nbytes
        return h

    def _retire(self) -> None:
        """Drops the device tensors whose copy to the host has finished (FIFO on one stream),
        and returns the buffers whose reload has finished to the pool."""
        with self._lock:
            while self._deferred and self._deferred[0][0].query():
                self.pool.give(self._deferred.popleft()[1])
            while self._in_flight and self._in_flight[0].copied.query():
                h = self._in_flight.popleft()
                self._check_version(h, h.src)
                h.src_ref, h.src = weakref.ref(h.src), None

    @staticmethod
    def _check_version(h: _Handle, src: torch.Tensor | None) -> None:
        if src is not None and src._version != h.version:
            h.modified = True

    def _unpack(self, h: Any) -> Any:
        if not isinstance(h, _Handle):
            return h
        with self._lock:
            self._retire()
            src = h.src if h.src is not None else (h.src_ref() if h.src_ref else None)
            self._check_version(h, src)
            if h.modified:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by"
                    f" an inplace operation: [{h.dtype} {list(h.shape)}] is at version"
                    f" {src._version if src is not None else '?'}; expected version {h.version}"
                    " (seen by ActivationOffload; without offload autograd raises the same)"
                )
            if src is not None:  # still on the device: no copy needed
                self.counters["kept_on_device"] += 1
                out = src
            else:
                if h.reloaded is None:
                    self._reload(h)
                else:
                    self.counters["prefetched_tensors"] += 1
                out = h.device_copy
                if h.reloaded is not True:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(h.reloaded)
                    out.record_stream(current)
            self._prefetch(h)
            return out

    def _reload(self, h: _Handle) -> None:
        if self._reload_stream is None:
            h.device_copy = torch.empty_strided(
                h.shape, h.stride or _contiguous_strides(h.shape), dtype=h.dtype
            )
            h.device_copy.copy_(h.host)
            h.reloaded = True
        else:
            self._reload_stream.wait_event(h.copied)
            with torch.cuda.stream(self._reload_stream):
                h.device_copy = torch.empty_strided(
                    h.shape,
                    h.stride or _contiguous_strides(h.shape),
                    dtype=h.dtype,
                    device=self.device,
                )
                h.device_copy.copy_(h.host, non_blocking=True)
                h.reloaded = torch.cuda.Event()
                h.reloaded.record()
        self.counters["reloaded_tensors"] += 1

    def _prefetch(self, h: _Handle) -> None:
        """Starts the reload of the next ``prefetch`` live handles saved before ``h``."""
        todo, j = self.prefetch, h.index - 1
        handles = h.seq.handles
        while todo > 0 and j >= 0:
            other = handles[j]()
            j -= 1
            if other is None:
                continue
            todo -= 1
            if other.reloaded is None and other.src is None and not _alive(other.src_ref):
                self._reload(other)

    def _release(self, h: _Handle) -> None:
        """A handle is gone: its host buffer returns to the pool once no stream reads it (a
        reload still running defers it; never a host wait here, on the autograd thread)."""
        with self._lock:
            self.live_handles -= 1
            if isinstance(h.reloaded, torch.cuda.Event) and not h.reloaded.query():
                self._deferred.append((h.reloaded, h.buf))
            else:
                self.pool.give(h.buf)


def _alive(ref: weakref.ref | None) -> bool:
    return ref is not None and ref() is not None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@contextlib.contextmanager
def offload_activations(
    offloader: ActivationOffloader | None = None, **kwargs: Any
) -> Iterator[ActivationOffloader]:
    """``with offload_activations(test_mode=True) as off: loss = model(x)`` then
    ``loss.backward()``. Pass a long-lived ``offloader`` to reuse its pool across steps."""
    off = offloader if offloader is not None else ActivationOffloader(**kwargs)
    with off:
        yield off
