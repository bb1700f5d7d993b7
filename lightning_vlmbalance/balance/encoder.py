"""Encoder balancing at run time: each rank encodes the images planned for it, and the
embeddings return to the rank whose pack holds them, with autograd through the return.

The plan (:mod:`lightning_vlmbalance.balance.images`) and the pixel transfer run off the step
path, in the :class:`~lightning_vlmbalance.RebalancingLoader`'s planning (its
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

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.timing.timer import ENCODER_RETURN, wait_phase

__all__ = [
    "ImageRoute",
    "ReturnChannel",
    "encode_images",
    "register_group",
    "return_home",
    "route_for",
    "time_returns",
]


class ReturnChannel:
    """Where the embeddings of routes return, and what times and keeps those returns: the
    process group (``None``: the world; a dedicated one, since the return runs in the training
    step while a rebalancing thread may run collectives on its own group), the step timers
    that time each return as the phase ``encoder_return``, and the returns of the micro-batch
    in progress (:meth:`returns_zero`). The strategy owns one per fit and hands it to its
    loader, whose routes carry it; nothing is kept at module level.

    Routes are copied with the batch (Lightning's batch transfer copies dataclasses): a
    channel's copy is the channel itself.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.timers: list[Any] = []  # ``start(phase)`` / ``stop(phase)`` step timers
        self._returns: list[torch.Tensor] = []

    def __copy__(self) -> ReturnChannel:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReturnChannel:
        return self

    def time_with(self, timer: Any, *, on: bool = True) -> None:
        """Times every return of embeddings (and of their gradients) as ``encoder_return`` of
        ``timer`` (a :class:`~lightning_vlmbalance.timing.StepTimer`), or stops that."""
        if on and timer not in self.timers:
            self.timers.append(timer)
        elif not on and timer in self.timers:
            self.timers.remove(timer)

    def begin_micro_batch(self) -> None:
        """Forgets the returns of a micro-batch that had no backward (the strategy calls it
        before each training step)."""
        self._returns.clear()

    def returns_zero(self) -> torch.Tensor | None:
        """A scalar zero that depends on every return of this micro-batch (``None``: none), so
        that the backward of each return runs on every rank, whatever the model did with the
        embeddings (a pack whose embeddings the model uses only when it has image tokens)."""
        if not self._returns:
            return None
        zero = sum(r.sum() for r in self._returns) * 0.0
        self._returns.clear()
        return zero

    def kept(self, returned: torch.Tensor) -> None:
        """A return whose backward (an ``all_to_all`` every rank of the group enters) must run
        even if the model leaves its embeddings out of the loss."""
        self._returns.append(returned)


# deprecated: channels named by a string (``register_group``), for routes made by hand
_NAMED: dict[str, ReturnChannel] = {}


def register_group(name: str, group: dist.ProcessGroup | None) -> None:
    """Deprecated: give :func:`route_for` a :class:`ReturnChannel` instead. Names the process
    group the embeddings of routes carrying ``name`` return on (``None``: the world)."""
    warnings.warn(
        "`register_group` is deprecated: pass `route_for(group=ReturnChannel(group))`",
        DeprecationWarning,
        stacklevel=2,
    )
    _NAMED[name] = ReturnChannel(group)


def time_returns(timer: Any, *, on: bool = True) -> None:
    """Deprecated: :meth:`ReturnChannel.time_with` (the strategy times its channel's returns
    with the fit's StragglerMonitor). Times the returns of routes named by
    :func:`register_group`."""
    warnings.warn(
        "`time_returns` is deprecated: a route's `ReturnChannel.time_with(timer)` times it",
        DeprecationWarning,
        stacklevel=2,
    )
    for channel in _NAMED.values():
        channel.time_with(timer, on=on)


def _channel(route: ImageRoute) -> ReturnChannel:
    if isinstance(route.group, ReturnChannel):
        return route.group
    if route.group not in _NAMED:
        raise ValueError(
            f"an encoder route names the return group {route.group!r}, which no"
            " `register_group` named: give `route_for(group=ReturnChannel(...))`"
        )
    return _NAMED[route.group]


@dataclass
class ImageRoute:
    """Where the images of one packed batch are encoded (plain lists and ints: Lightning's
    batch transfer leaves it as it is).

    Attributes:
        group: the :class:`ReturnChannel` the embeddings return on (a name given to the
            deprecated :func:`register_group`, for routes made by hand).
        rank: this rank in that group; ``world``: its size.
        own_sizes: rows (image tokens) of each of the pack's own images, in pack order.
        keep: the own images encoded here, in pack order.
        send: per rank of the group, the own images it encodes (empty for this rank).
        recv_sizes: per rank of the group, the rows of each image received from it.
    """

    group: ReturnChannel | str
    rank: int
    world: int
    own_sizes: list[int]
    keep: list[int]
    send: list[list[int]]
    recv_sizes: list[list[int]]
    # prepared with the route, off the step path (the step only indexes with them; numpy under
    # torch.compile's tracing gave an uninitialised permutation): the kept images' rows in the
    # pack's image rows, and the permutation that puts [kept rows, returned rows] in pack order
    kept_index: torch.Tensor | None = None
    home_index: torch.Tensor | None = None
    # a few of the pack's own image values as the loader made them, ``{field: (positions,
    # values)}``: preprocessing that changes them before the encoder is refused
    # (:func:`check_unchanged`)
    probe: dict[str, tuple[list[int], list[float]]] | None = None
    # whether any image of this micro-step is encoded on another rank than its pack's, on any
    # rank of the group (the plan knows): if none is, the return is skipped on every rank, and
    # the step is DDP's exactly (no collective, no zero term, so a parameter no rank used keeps
    # a None gradient, which a stateful optimizer skips)
    moved_any: bool = True

    def __post_init__(self) -> None:
        if self.kept_index is None:
            kept = self.kept_rows(self.own_sizes)
            self.kept_index = torch.from_numpy(kept)
            self.home_index = torch.from_numpy(_home_permutation(self, kept))

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
        channel: ReturnChannel,
    ) -> torch.Tensor:
        ctx.splits, ctx.channel = (send_splits, recv_splits), channel
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        with wait_phase(channel.timers, ENCODER_RETURN):
            dist.all_to_all_single(
                out, rows.contiguous(), recv_splits, send_splits, group=channel.group
            )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        with wait_phase(ctx.channel.timers, ENCODER_RETURN):
            dist.all_to_all_single(
                out, grad.contiguous(), send_splits, recv_splits, group=ctx.channel.group
            )
        return out, None, None, None


def encode_images(
    encoder: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], batch: dict[str, Any]
) -> torch.Tensor:
    """The pack's image embeddings, one row per image token in the pack's image order.

    Args:
        encoder: called as ``encoder(pixel_values, image_cu_seqlens, image_max_seqlen)`` on
            rows of whole images (attention within each image), returning one tensor with one
            embedding row per image token (per row of ``pixel_values``).
        batch: a packed batch; with an ``encoder_route`` (encoder balancing on) the encoder
            runs on this rank's planned set and the embeddings travel back.

    With a route, the encoder sees the pack's kept images and the images received from other
    ranks as the loader made them: preprocessing of ``pixel_values`` belongs in ``encoder``
    (or the dataset / collate function), where it reaches every image; preprocessing of the
    batch before this call reaches this rank's own images only, and is refused by name. The
    encoder must treat each image alone (no BatchNorm over the batch: warned).

    Under ``torch.compile`` the encoder call is compiled; the route's bookkeeping and the
    return's ``all_to_all`` run eagerly (graph breaks around them).

    Raises:
        ValueError: if the encoder's output does not have one row per input row (naming the
            encoder and both counts); if ``pixel_values`` changed between the loader and this
            call under a route (preprocessing that only this rank's own images would get).
        TypeError: if the encoder returns something other than one tensor.
    """
    route: ImageRoute | None = batch.get("encoder_route")
    if route is None:
        pixels = batch["pixel_values"]
        out = _one_tensor(
            encoder, encoder(pixels, batch["image_cu_seqlens"], batch["image_max_seqlen"])
        )
        check_rows(encoder, out, int(pixels.shape[0]), int(pixels.shape[0]))
        return out
    local, cu, max_seqlen = _local_set(encoder, route, batch)
    out = _one_tensor(encoder, encoder(local, cu, max_seqlen))
    check_rows(encoder, out, int(local.shape[0]), int(local.shape[0]))
    return return_home(route, out)


@torch.compiler.disable
def _local_set(
    encoder: Any, route: ImageRoute, batch: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's images to encode under ``route``: the pack's kept images' rows, then the
    received ones, with their ``cu_seqlens`` and longest image (eager under torch.compile)."""
    pixels = batch["pixel_values"]
    if route.rows != int(pixels.shape[0]):
        raise ValueError(
            f"encoder_route: the pack's images have {route.rows} rows but pixel_values has"
            f" {int(pixels.shape[0])}"
        )
    check_unchanged(route, "pixel_values", pixels)
    warn_batch_norm(encoder)
    received = batch["encoder_fields"]["pixel_values"].to(device=pixels.device, dtype=pixels.dtype)
    kept = route.kept_index.to(pixels.device, non_blocking=True)  # type: ignore[union-attr]
    local = torch.cat([pixels.index_select(0, kept), received])
    local_sizes = route.local_sizes
    cu = torch.zeros(len(local_sizes) + 1, dtype=torch.int32)
    if local_sizes:
        cu[1:] = torch.cumsum(torch.tensor(local_sizes, dtype=torch.int32), 0)
    return local, cu.to(pixels.device), max(local_sizes, default=0)


def _one_tensor(encoder: Any, out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the vision encoder {type(encoder).__name__} returned a {type(out).__name__}:"
            " `encode_images` needs one tensor with a row per image token; pass a function"
            " that picks it (e.g. `lambda *a: encoder(*a)[0]`)"
        )
    return out


# the check of the last call on an accelerator, read at the next call (no wait for the device)
_PENDING_CHECK: list[tuple[torch.Tensor, str, torch.Tensor, list[int], list[float]]] = []


def probe_fields(fields: dict[str, tuple[torch.Tensor, Any]], count: int = 32) -> dict:
    """``{name: (positions, values)}``: ``count`` values of each floating-point image field,
    spread over the tensor, as the loader made it (for :func:`check_unchanged`)."""
    probe = {}
    for name, (tensor, _) in fields.items():
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        flat = tensor.detach().reshape(-1)
        positions = np.unique(np.linspace(0, flat.numel() - 1, count).astype(np.int64))
        values = flat.index_select(0, torch.from_numpy(positions)).double().tolist()
        probe[name] = (positions.tolist(), values)
    return probe


def check_unchanged(route: ImageRoute, name: str, tensor: torch.Tensor) -> None:
    """Refuses a pack's image field that changed between the loader and the encoder under
    encoder balancing: the images received from other ranks are encoded as the loader made
    them, so preprocessing applied to the batch would reach this rank's own images only (the
    parameters then differ from DDP's). A cast (the precision plugin's ``bf16-true``, a
    ``.double()``) is not a change: the loader's values are cast the same way and compared
    exactly. Every call is checked; on an accelerator the comparison is read at the next call,
    so the step never waits for the device (the error then comes one micro-batch later)."""
    _raise_pending()
    probe = (route.probe or {}).get(name)
    if probe is None:
        return
    positions, loaded = probe
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= positions[-1]:
        _refuse(name, f"has {flat.numel()} values, the loader made {positions[-1] + 1} or more")
    index = torch.tensor(positions, dtype=torch.int64).to(flat.device, non_blocking=True)
    now = flat.index_select(0, index)
    expected = torch.tensor(loaded, dtype=torch.float64).to(now.dtype).to(now.device)
    differs = (now != expected).any()
    if now.device.type == "cpu":
        if bool(differs):
            _refuse(name, _first_difference(now, expected, positions))
    else:
        _PENDING_CHECK.append((differs, name, now, positions, loaded))


def _raise_pending() -> None:
    while _PENDING_CHECK:
        differs, name, now, positions, loaded = _PENDING_CHECK.pop(0)
        if bool(differs):
            _PENDING_CHECK.clear()
            expected = torch.tensor(loaded, dtype=torch.float64).to(now.dtype)
            _refuse(name, _first_difference(now.cpu(), expected, positions))


def _first_difference(now: torch.Tensor, expected: torch.Tensor, positions: list[int]) -> str:
    i = int(torch.nonzero(now != expected)[0])
    return f"value {positions[i]} is {float(now[i]):.6g}, the loader made {float(expected[i]):.6g}"


def _refuse(name: str, what: str) -> None:
    raise ValueError(
        f"encoder balancing: the pack's image field {name!r} changed between the loader and"
        f" the encoder ({what}). Preprocessing applied to the batch (in"
        " `on_after_batch_transfer` or `training_step`) reaches only this rank's own images;"
        " the images received from other ranks are encoded as the loader made them, and the"
        " model would learn something else than under DDP. Preprocess inside the encoder given"
        " to `encode_images` (it runs on every image this rank encodes), or in the dataset or"
        " collate function"
    )


_WARNED_BATCH_NORM: set[int] = set()


def warn_batch_norm(encoder: Any) -> None:
    """Warns (once per encoder) when ``encoder`` has a BatchNorm layer in training mode: its
    statistics mix the images of one call, and encoder balancing changes which images share a
    call, so the result is not the one of encoding at home."""
    if id(encoder) in _WARNED_BATCH_NORM:
        return
    _WARNED_BATCH_NORM.add(id(encoder))
    norms = [
        name or type(module).__name__
        for module in _modules_of(encoder)
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if norms:
        warnings.warn(
            f"encoder balancing: the vision encoder {type(encoder).__name__} has BatchNorm in"
            f" training mode ({', '.join(norms[:3])}): its batch statistics mix the images"
            " encoded together, and balancing changes which images those are, so the"
            " parameters will not equal DDP's. Encoder balancing reproduces DDP for encoders"
            " that treat each image alone (LayerNorm, attention within each image); use"
            " `eval()` BatchNorm, GroupNorm or LayerNorm, or turn `encoder` off",
            stacklevel=3,
        )


def _modules_of(encoder: Any) -> list[torch.nn.Module]:
    """The modules an encoder callable runs: itself, a bound method's owner, or the modules a
    function closes over (``lambda *a: vision(*a)[0]``, as the tuple error suggests)."""
    if isinstance(encoder, torch.nn.Module):
        return [encoder]
    owner = getattr(encoder, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return [owner]
    cells = getattr(encoder, "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.nn.Module)]


@torch.compiler.disable
def return_home(route: ImageRoute, out: torch.Tensor) -> torch.Tensor:
    """The pack's own image rows, in the pack's image order, from ``out``: the rows this rank
    encoded (its kept images in ``keep`` order, then the received images in the route's
    order, ``route.local_sizes``), after the received images' rows are sent back to their
    owners and the own images encoded elsewhere come back (one ``all_to_all``, with autograd:
    its backward sends the gradients the other way). Every rank of the route's group must call
    it, with or without images; under autograd the strategy makes every rank run its backward
    too (:meth:`ReturnChannel.returns_zero`). Eager under torch.compile."""
    channel = _channel(route)
    if not route.moved_any:  # every image of the micro-step is encoded at home, on every rank
        return out
    sizes = np.asarray(route.own_sizes, dtype=np.int64)
    send_back = [sum(per_rank) for per_rank in route.recv_sizes]  # to each image's owner
    expect = [int(sizes[per_rank].sum()) for per_rank in route.send]  # from each encoder
    n = len(route.kept_index)  # type: ignore[arg-type]
    returned = _ReturnEmbeddings.apply(out[n:], send_back, expect, channel)
    if returned.requires_grad:
        channel.kept(returned)
    # [kept images' rows, returned rows] -> the pack's own row order, in one gather (its
    # backward one scatter). ``returned`` always joins it, even with no row
    home = route.home_index.to(out.device, non_blocking=True)  # type: ignore[union-attr]
    return torch.cat([out[:n], returned]).index_select(0, home)


def _home_permutation(route: ImageRoute, kept_rows: np.ndarray) -> np.ndarray:
    """Where each of the pack's own image rows is in ``[kept images' rows, returned rows]``."""
    sizes = np.asarray(route.own_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    sent = np.asarray([i for per_rank in route.send for i in per_rank], dtype=np.int64)
    position = np.empty(int(starts[-1]), dtype=np.int64)
    position[np.concatenate([kept_rows, _rows_of(sent, starts, sizes)])] = np.arange(len(position))
    return position


def _rows_of(images: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The rows of ``images`` (in that order) of a pack whose image ``i`` has rows
    ``starts[i] : starts[i] + sizes[i]``."""
    if not len(images):
        return np.zeros(0, dtype=np.int64)
    counts = sizes[images]
    first = np.repeat(starts[images] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return first + np.arange(int(counts.sum()))


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
    group: ReturnChannel | str,
    rank: int,
    world: int,
    own_sizes: Sequence[int],
    own_encoder: Sequence[int],
    foreign: Sequence[tuple[int, int]],
    moved_any: bool = True,
) -> ImageRoute:
    """This rank's :class:`ImageRoute` for one micro-step, from the plan.

    Args:
        own_sizes: rows of each of this rank's pack's images.
        own_encoder: the rank that encodes each of them.
        foreign: ``(owner rank, rows)`` of every image this rank encodes for another, in the
            order they are received (by owner rank, then the owner's image order).
        moved_any: whether any rank of the group encodes an image of another's pack in this
            micro-step (``False``: the return is skipped on every rank).
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
        moved_any=moved_any,
    )
