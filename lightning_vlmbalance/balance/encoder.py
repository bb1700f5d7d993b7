"""Encoder balancing at run time: each rank encodes the images planned for it, and the
embeddings return to the rank whose pack holds them, with autograd through the return.

The plan (:mod:`lightning_vlmbalance.balance.images`) and the pixel transfer run off the step
path, in the :class:`~lightning_vlmbalance.balance.loader.RebalancingLoader`'s planning (its
background thread in ``"overlap"`` mode), which leaves on each packed batch:

``encoder_route``   an :class:`ImageRoute`: which of the pack's images this rank encodes, which
                    it sent to which rank, and the sizes of the images it received
``encoder_fields``  the received images' per-image tensors, ``{name: Tensor}`` (``pixel_values``
                    rows for packs of pixel rows), in the order of the route (by sending rank,
                    then that rank's image order), with ``encoder_field_rows`` (each image's
                    rows, per name)

In the model, :func:`encode_images` replaces the encoder call: it runs the encoder once on this
rank's set (its own kept images, then the received ones, each image attending only within
itself through ``image_cu_seqlens``), sends the received images' embeddings back in one
``all_to_all`` on the route's group, and returns the pack's image embeddings in the pack's own
image order, as the encoder would have returned them at home. The backward of the return sends
the embeddings' gradients to the ranks that encoded them. Every rank calls the encoder at every
micro-batch, with or without images (its parameters take part in the gradient reduction, and
sharded parameters are gathered by every rank).

The gradients are the same: an image's encoder gradient is computed on another rank, and the
data-parallel reduction sums over ranks (the order of a floating-point sum changes, nothing
else). Without a route (balancing off) :func:`encode_images` is the plain encoder call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.timing.timer import ENCODER_RETURN, wait_phase

__all__ = [
    "ImageRoute",
    "encode_images",
    "register_group",
    "return_home",
    "route_for",
    "time_returns",
]

# the process groups routes name: set by the strategy (or the user) before training
_GROUPS: dict[str, dist.ProcessGroup | None] = {}
# step timers (``start(phase)`` / ``stop(phase)``) that time the returns as ``encoder_return``
_TIMERS: list[Any] = []


def time_returns(timer: Any, *, on: bool = True) -> None:
    """Times every return of embeddings (and of their gradients) as the phase
    ``encoder_return`` of ``timer`` (a :class:`~lightning_vlmbalance.timing.StepTimer`; the
    StragglerMonitor registers its own), or stops that with ``on=False``."""
    if on and timer not in _TIMERS:
        _TIMERS.append(timer)
    elif not on and timer in _TIMERS:
        _TIMERS.remove(timer)


def register_group(name: str, group: dist.ProcessGroup | None) -> None:
    """Names the process group the embeddings of routes carrying ``name`` return on (``None``:
    the world). A dedicated group: the return runs in the training step, while the
    rebalancing thread may run collectives on its own group."""
    _GROUPS[name] = group


@dataclass
class ImageRoute:
    """Where the images of one packed batch are encoded (plain lists and ints: Lightning's
    batch transfer leaves it as it is).

    Attributes:
        group: the registered name of the return's process group.
        rank: this rank in that group; ``world``: its size.
        own_sizes: rows (image tokens) of each of the pack's own images, in pack order.
        keep: the own images encoded here, in pack order.
        send: per rank of the group, the own images it encodes (empty for this rank).
        recv_sizes: per rank of the group, the rows of each image received from it.
    """

    group: str
    rank: int
    world: int
    own_sizes: list[int]
    keep: list[int]
    send: list[list[int]]
    recv_sizes: list[list[int]]

    @property
    def moved_images(self) -> int:
        """Own images encoded elsewhere."""
        return sum(len(s) for s in self.send)

    @property
    def received_images(self) -> int:
        return sum(len(s) for s in self.recv_sizes)

    @property
    def rows(self) -> int:
        """Rows (image tokens) of the pack's own images."""
        return sum(self.own_sizes)

    @property
    def local_sizes(self) -> list[int]:
        """Rows of each image this rank encodes: its kept images, then the received ones."""
        kept = [self.own_sizes[i] for i in self.keep]
        return [*kept, *(n for per_rank in self.recv_sizes for n in per_rank)]

    def kept_rows(self, rows_per_image: Sequence[int]) -> np.ndarray:
        """Indices of the kept images' rows in a per-image tensor of the pack whose image
        ``i`` has ``rows_per_image[i]`` rows (the embeddings, or an input field), in
        ``keep`` order."""
        sizes = np.asarray(rows_per_image, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return _rows_of(np.asarray(self.keep, dtype=np.int64), starts, sizes)


class _ReturnEmbeddings(torch.autograd.Function):
    """``all_to_all`` of embedding rows; the backward sends the gradients the other way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        with wait_phase(_TIMERS, ENCODER_RETURN):
            dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        with wait_phase(_TIMERS, ENCODER_RETURN):
            dist.all_to_all_single(
                out, grad.contiguous(), send_splits, recv_splits, group=ctx.group
            )
        return out, None, None, None


def encode_images(
    encoder: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], batch: dict[str, Any]
) -> torch.Tensor:
    """The pack's image embeddings, one row per image token in the pack's image order.

    Args:
        encoder: called as ``encoder(pixel_values, image_cu_seqlens, image_max_seqlen)`` on
            rows of whole images (attention within each image), returning one embedding row
            per image token (per row of ``pixel_values``).
        batch: a packed batch; with an ``encoder_route`` (encoder balancing on) the encoder
            runs on this rank's planned set and the embeddings travel back.

    Raises:
        ValueError: if the encoder's output does not have one row per input row (naming the
            encoder and both counts).
    """
    pixels = batch["pixel_values"]
    route: ImageRoute | None = batch.get("encoder_route")
    if route is None:
        out = encoder(pixels, batch["image_cu_seqlens"], batch["image_max_seqlen"])
        check_rows(encoder, out, int(pixels.shape[0]), int(pixels.shape[0]))
        return out
    if route.rows != int(pixels.shape[0]):
        raise ValueError(
            f"encoder_route: the pack's images have {route.rows} rows but pixel_values has"
            f" {int(pixels.shape[0])}"
        )
    received = batch["encoder_fields"]["pixel_values"].to(device=pixels.device, dtype=pixels.dtype)
    kept = route.kept_rows(route.own_sizes)
    local = torch.cat([pixels.index_select(0, _index(kept, pixels)), received])
    local_sizes = route.local_sizes
    cu = torch.zeros(len(local_sizes) + 1, dtype=torch.int32)
    if local_sizes:
        cu[1:] = torch.cumsum(torch.tensor(local_sizes, dtype=torch.int32), 0)
    out = encoder(local, cu.to(pixels.device), max(local_sizes, default=0))
    check_rows(encoder, out, sum(local_sizes), int(local.shape[0]))
    return return_home(route, out)


def return_home(route: ImageRoute, out: torch.Tensor) -> torch.Tensor:
    """The pack's own image rows, in the pack's image order, from ``out``: the rows this rank
    encoded (its kept images in ``keep`` order, then the received images in the route's
    order, ``route.local_sizes``), after the received images' rows are sent back to their
    owners and the own images encoded elsewhere come back (one ``all_to_all``, with autograd:
    its backward sends the gradients the other way). Every rank of the route's group must call
    it, with or without images."""
    sizes = np.asarray(route.own_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    kept_rows = route.kept_rows(route.own_sizes)
    sent = np.asarray([i for per_rank in route.send for i in per_rank], dtype=np.int64)
    send_back = [sum(per_rank) for per_rank in route.recv_sizes]  # to each image's owner
    expect = [int(sizes[per_rank].sum()) for per_rank in route.send]  # from each encoder
    n = len(kept_rows)
    returned = _ReturnEmbeddings.apply(out[n:], send_back, expect, _GROUPS.get(route.group))
    # [kept images' rows, returned rows] -> the pack's own row order, in one gather (its
    # backward one scatter). ``returned`` always joins it, even with no row: its backward (a
    # collective every rank of the group must enter) then runs on every rank
    position = np.empty(int(starts[-1]), dtype=np.int64)
    position[np.concatenate([kept_rows, _rows_of(sent, starts, sizes)])] = np.arange(len(position))
    return torch.cat([out[:n], returned]).index_select(0, _index(position, out))


def _rows_of(images: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The rows of ``images`` (in that order) of a pack whose image ``i`` has rows
    ``starts[i] : starts[i] + sizes[i]``."""
    if not len(images):
        return np.zeros(0, dtype=np.int64)
    counts = sizes[images]
    first = np.repeat(starts[images] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return first + np.arange(int(counts.sum()))


def _index(rows: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(rows).to(like.device, non_blocking=True)


def check_rows(
    encoder: Any, out: torch.Tensor, expected: int, given: int, *, unit: str = "input rows"
) -> None:
    """Refuses an encoder output without one row per image token, naming the encoder (module
    class) and the counts: ``given`` inputs (``unit``) of ``expected`` image tokens."""
    if int(out.shape[0]) != expected:
        raise ValueError(
            f"the vision encoder {type(encoder).__name__} returned {int(out.shape[0])} rows for"
            f" {given} {unit} of {expected} image tokens: encoder balancing needs one output"
            " row per image token, in input order"
        )


def route_for(
    *,
    group: str,
    rank: int,
    world: int,
    own_sizes: Sequence[int],
    own_encoder: Sequence[int],
    foreign: Sequence[tuple[int, int]],
) -> ImageRoute:
    """This rank's :class:`ImageRoute` for one micro-step, from the plan.

    Args:
        own_sizes: rows of each of this rank's pack's images.
        own_encoder: the rank that encodes each of them.
        foreign: ``(owner rank, rows)`` of every image this rank encodes for another, in the
            order they are received (by owner rank, then the owner's image order).
    """
    send: list[list[int]] = [[] for _ in range(world)]
    keep: list[int] = []
    for i, e in enumerate(own_encoder):
        (keep if e == rank else send[e]).append(i)
    recv: list[list[int]] = [[] for _ in range(world)]
    for owner, rows in foreign:
        recv[owner].append(int(rows))
    return ImageRoute(
        group=group,
        rank=rank,
        world=world,
        own_sizes=[int(s) for s in own_sizes],
        keep=keep,
        send=send,
        recv_sizes=recv,
    )
