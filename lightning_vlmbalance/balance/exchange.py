"""Pack exchange: send and receive only the packs that move, as raw tensor bytes, on a group.

A pack is any nested ``dict`` / ``list`` / ``tuple`` of tensors and plain values (``int``,
``float``, ``bool``, ``str``, ``None``), e.g. a ``PackedBatch``. :func:`encode_pack` flattens it
into two ``uint8`` tensors: a JSON *spec* (the structure, plain values, and dtype/shape/offset of
each tensor) and one *payload* with every tensor's bytes. No pickle on the data path: a receiver
only ever interprets bytes as the dtypes and shapes the spec names.

:func:`exchange_packs` moves one global batch's packs over a process group (meant to be a
dedicated one, so the exchange never interleaves with DDP's gradient all-reduce): for every move
``(pack, src, dst)`` of the plan, ``src`` sends a 2-integer header (spec and payload sizes),
then the spec, then the payload; ``dst`` posts the matching receives. Point-to-point tags are
derived from the pack index, so messages between the same two ranks never mix. Every wait has a
deadline: a peer that died or stopped sending turns into :class:`ExchangeError` on this rank
within ``timeout_s``, never a hang.

On GPUs the headers and specs (a few hundred bytes) still travel on the CPU ``group`` (gloo),
while the payloads travel as device tensors on ``payload_group`` (NCCL): the sender copies the
payload host-to-device and every send and receive is posted on a side CUDA ``stream``. The host
does not wait for the payloads: pack by pack, the side stream waits for that pack's own
transfer and records the pack's CUDA event right then, so the training loop's stream, which
waits on a pack's event when the pack is handed to it (:func:`wait_pack_ready`), can start on
the first pack while later ones are still in flight, and never waits on the side stream as a
whole. A sent payload is kept for the side stream until its send is done (``record_stream``).
A peer that dies mid-transfer is caught by the NCCL group's own timeout (the strategy sets it
to ``exchange_timeout_s``), not by this host. NCCL ignores tags and runs one pair's operations
in order: both ends post a pair's messages in the order of ``moves``, the lower rank its sends
first, so a swap cannot deadlock. After a timeout the NCCL payload group may still hold queued
operations: the fit fails.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExchangeError", "decode_pack", "encode_pack", "exchange_packs", "wait_pack_ready"]

_DTYPES = {
    str(dt): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


_ALIGN = 16  # bytes: the largest element size (complex128)
_Works = list[tuple[Any, str]]  # (work, what it waits for), as _wait_all names them
_ByPeer = dict[int, list[tuple[int, torch.Tensor]]]  # peer -> [(pack, payload)], in move order


class ExchangeError(RuntimeError):
    """A pack exchange failed or timed out (a peer died, raised, or never sent)."""


def encode_pack(pack: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spec, payload)``: two CPU ``uint8`` tensors that :func:`decode_pack` turns back into
    ``pack`` (tensors contiguous, on the CPU, same dtypes and shapes).

    Raises:
        TypeError: for a value that is not a tensor, a plain value, or a dict/list/tuple of them
            (naming where in the pack it is), or a dict with a non-string key.
    """
    chunks: list[torch.Tensor] = []
    offset = 0

    def walk(obj: Any, where: str) -> Any:
        nonlocal offset
        if isinstance(obj, torch.Tensor):
            if str(obj.dtype) not in _DTYPES:
                raise TypeError(f"encode_pack: {where} has unsupported dtype {obj.dtype}")
            flat = obj.detach().to("cpu").contiguous().reshape(-1)
            raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
            pad = -offset % _ALIGN  # decode views the bytes as the dtype: keep it aligned
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            chunks.append(raw)
            node = {"T": str(obj.dtype), "s": list(obj.shape), "o": offset, "n": raw.numel()}
            offset += raw.numel()
            return node
        if obj is None or isinstance(obj, bool | int | float | str):
            return {"v": obj}
        if isinstance(obj, Mapping):
            bad = [k for k in obj if not isinstance(k, str)]
            if bad:
                raise TypeError(f"encode_pack: {where} has a non-string key {bad[0]!r}")
            return {"d": {k: walk(v, f"{where}[{k!r}]") for k, v in obj.items()}}
        if isinstance(obj, list | tuple):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return {"t" if isinstance(obj, tuple) else "l": items}
        raise TypeError(
            f"encode_pack: {where} is a {type(obj).__name__}; a pack holds tensors, plain values"
            " and dicts/lists/tuples of them"
        )

    spec = walk(pack, "pack")
    spec_bytes = torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return spec_bytes, payload


def decode_pack(spec: torch.Tensor, payload: torch.Tensor) -> Any:
    """The pack encoded by :func:`encode_pack` (its tensors are views of ``payload``)."""
    tree = json.loads(bytes(spec.numpy().tobytes()).decode())

    def build(node: dict[str, Any]) -> Any:
        if "T" in node:
            dtype = _DTYPES[node["T"]]
            raw = payload[node["o"] : node["o"] + node["n"]]
            flat = raw.view(dtype) if node["n"] else payload.new_empty(0, dtype=dtype)
            return flat.reshape(node["s"])
        if "v" in node:
            return node["v"]
        if "d" in node:
            return {k: build(v) for k, v in node["d"].items()}
        if "t" in node:
            return tuple(build(v) for v in node["t"])
        return [build(v) for v in node["l"]]

    return build(tree)


def exchange_packs(
    packs: Mapping[int, Any],
    moves: Sequence[tuple[int, int, int]],
    *,
    rank: int,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 300.0,
    payload_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    stream: Any = None,
    ready_events: dict[int, Any] | None = None,
) -> dict[int, Any]:
    """Sends this rank's outgoing packs and receives its incoming ones.

    Args:
        packs: this rank's packs that move out, by pack index (others may be present).
        moves: every move of the plan, ``(pack, from_rank, to_rank)``, identical on all ranks.
        rank: this rank's rank *in* ``group``.
        group: the process group (default: the world).
        timeout_s: deadline for the whole exchange.
        payload_group: the group for the payloads (default: ``group``); on CUDA an NCCL group.
        device: where payloads travel and received packs land (default: the CPU).
        stream: on CUDA, the side stream the exchange runs on (default: a new one).
        ready_events: on CUDA, filled with one event per received pack, recorded on ``stream``
            when that pack is complete (see :func:`wait_pack_ready`).

    Returns:
        The received packs, by pack index (their tensors on ``device``).

    Raises:
        ExchangeError: when a peer fails, dies or does not send within ``timeout_s``; names the
            packs and peers still pending.
    """
    deadline = time.monotonic() + timeout_s
    device = torch.device("cpu") if device is None else torch.device(device)
    on_cuda = device.type == "cuda"
    if payload_group is None:
        payload_group = group
    outgoing = [(p, dst) for p, src, dst in moves if src == rank and dst != rank]
    incoming = [(p, src) for p, src, dst in moves if dst == rank and src != rank]
    encoded = {p: encode_pack(packs[p]) for p, _ in outgoing}
    if on_cuda and stream is None:
        stream = torch.cuda.Stream(device)
    try:
        # 1) headers: sizes of each pack's spec and payload (CPU group)
        headers = _exchange_headers(encoded, outgoing, incoming, group, deadline, timeout_s)
        # 2) specs (CPU group) and payloads (payload group, on ``device``)
        with on_stream(device, stream):
            works, send_to = _send_specs(encoded, outgoing, group, device)
            recv_works, buffers, recv_from = _recv_specs(headers, incoming, group, device)
            works += recv_works
            payload_works, pending, sends = _post_payloads(send_to, recv_from, rank, payload_group)
            _wait_all(works, deadline, timeout_s)
            if on_cuda:  # no host wait: each received pack's event follows its own transfer
                _keep_until_sent(sends, stream)
            else:
                _wait_all(payload_works, deadline, timeout_s)
            received = _decode_received(incoming, buffers, pending, on_cuda, stream, ready_events)
    except RuntimeError as err:
        if isinstance(err, ExchangeError):
            raise
        # posting a send or receive to a peer that is already gone fails at once (gloo:
        # "Connection closed by peer"), before any wait: name what this rank was exchanging
        moving = [f"pack {p} from {src}" for p, src in incoming]
        moving += [f"pack {p} to {dst}" for p, dst in outgoing]
        more = f" and {len(moving) - 4} more" if len(moving) > 4 else ""
        raise ExchangeError(
            f"pack exchange failed within exchange_timeout_s={timeout_s:g}: a peer is gone"
            f" while exchanging {', '.join(moving[:4])}{more} (rank {rank};"
            f" {type(err).__name__}: {err})"
        ) from err
    del encoded  # the payloads being sent stay alive until every transfer is done
    return received


def _exchange_headers(
    encoded: dict[int, tuple[torch.Tensor, torch.Tensor]],
    outgoing: list[tuple[int, int]],
    incoming: list[tuple[int, int]],
    group: dist.ProcessGroup | None,
    deadline: float,
    timeout_s: float,
) -> dict[int, torch.Tensor]:
    """Sends each outgoing pack's spec and payload sizes, and waits for the incoming ones'."""
    works: _Works = []
    sent_headers = []
    for p, dst in outgoing:
        header = torch.tensor([encoded[p][0].numel(), encoded[p][1].numel()], dtype=torch.int64)
        sent_headers.append(header)  # keep alive until sent
        works.append(
            (dist.isend(header, dst, group=group, tag=3 * p), f"header of pack {p} to {dst}")
        )
    headers = {p: torch.zeros(2, dtype=torch.int64) for p, _ in incoming}
    for p, src in incoming:
        works.append(
            (dist.irecv(headers[p], src, group=group, tag=3 * p), f"header of pack {p} from {src}")
        )
    _wait_all(works, deadline, timeout_s)
    return headers


def _send_specs(
    encoded: dict[int, tuple[torch.Tensor, torch.Tensor]],
    outgoing: list[tuple[int, int]],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[_Works, _ByPeer]:
    """Posts each outgoing pack's spec; returns the works and the non-empty payloads to send.

    On CUDA each payload is first copied to ``device`` and replaces the host one in ``encoded``.
    """
    works: _Works = []
    send_to: _ByPeer = {}
    for p, dst in outgoing:
        spec, payload = encoded[p]
        works.append((dist.isend(spec, dst, group=group, tag=3 * p + 1), f"pack {p} to {dst}"))
        if payload.numel():
            if device.type == "cuda":  # keeps the (pinned) host copy alive until the copy ran
                payload = payload.pin_memory().to(device, non_blocking=True)
                encoded[p] = (spec, payload)
            send_to.setdefault(dst, []).append((p, payload))
    return works, send_to


def _recv_specs(
    headers: dict[int, torch.Tensor],
    incoming: list[tuple[int, int]],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[_Works, dict[int, tuple[torch.Tensor, torch.Tensor]], _ByPeer]:
    """Posts each incoming pack's spec receive into buffers sized by its header.

    Returns the works, each pack's ``(spec, payload)`` buffers (the payload on ``device``), and
    the non-empty payload buffers to receive.
    """
    works: _Works = []
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    recv_from: _ByPeer = {}
    for p, src in incoming:
        n_spec, n_payload = (int(x) for x in headers[p])
        spec = torch.empty(n_spec, dtype=torch.uint8)
        payload = torch.empty(n_payload, dtype=torch.uint8, device=device)
        buffers[p] = (spec, payload)
        works.append((dist.irecv(spec, src, group=group, tag=3 * p + 1), f"pack {p} from {src}"))
        if n_payload:
            recv_from.setdefault(src, []).append((p, payload))
    return works, buffers, recv_from


def _post_payloads(
    send_to: _ByPeer, recv_from: _ByPeer, rank: int, payload_group: dist.ProcessGroup | None
) -> tuple[_Works, dict[int, list[Any]], list[tuple[Any, torch.Tensor]]]:
    """Posts every payload send and receive, peer by peer: ``(works, receive works by pack,
    (send work, sent tensor) pairs)``."""
    # NCCL runs one pair's operations in posting order on one stream and ignores tags: if both
    # ends of a swap posted their send first, each send would wait for a receive queued behind
    # the other's send. The lower rank sends first, the higher receives first; within a pair
    # both follow the order of ``moves``.
    works: _Works = []
    pending: dict[int, list[Any]] = {}
    sends: list[tuple[Any, torch.Tensor]] = []

    def post_sends(peer: int) -> _Works:
        posted = []
        for p, t in send_to.get(peer, []):
            work = dist.isend(t, peer, group=payload_group, tag=3 * p + 2)
            sends.append((work, t))
            posted.append((work, f"pack {p} to {peer}"))
        return posted

    for peer in sorted(set(send_to) | set(recv_from)):
        if rank < peer:
            works += post_sends(peer)
        for p, t in recv_from.get(peer, []):
            work = dist.irecv(t, peer, group=payload_group, tag=3 * p + 2)
            pending.setdefault(p, []).append(work)
            works.append((work, f"pack {p} from {peer}"))
        if rank > peer:
            works += post_sends(peer)
    return works, pending, sends


def _keep_until_sent(sends: list[tuple[Any, torch.Tensor]], stream: Any) -> None:
    """On CUDA: the side ``stream`` waits for every send (``work.wait`` only queues that wait),
    and each sent tensor is marked as used on it, so the caching allocator does not hand its
    memory out again before the send is done, though this function returns at once."""
    for work, tensor in sends:
        work.wait()
        tensor.record_stream(stream)


def _decode_received(
    incoming: list[tuple[int, int]],
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]],
    pending: dict[int, list[Any]],
    on_cuda: bool,
    stream: Any,
    ready_events: dict[int, Any] | None,
) -> dict[int, Any]:
    """Decodes the received packs; on CUDA, ``stream`` waits for each pack's own transfer and
    records that pack's event before it waits for the next pack's."""
    received = {}
    for p, _ in incoming:
        if on_cuda:
            for work in pending.get(p, []):
                work.wait()  # the side stream waits for this pack's transfer
            if ready_events is not None:
                event = torch.cuda.Event()
                event.record(stream)
                ready_events[p] = event
        received[p] = decode_pack(*buffers[p])
    return received


def wait_pack_ready(pack: Any, event: Any) -> None:
    """Makes the current CUDA stream wait for ``event`` (a received pack's, from
    :func:`exchange_packs`) and tells the caching allocator that the pack's tensors, allocated
    on the exchange's side stream, are used on the current stream."""
    current = torch.cuda.current_stream()
    current.wait_event(event)

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                obj.record_stream(current)
        elif isinstance(obj, Mapping):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                visit(v)

    visit(pack)


def on_stream(device: torch.device, stream: Any) -> Any:
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))  # the thread's current device
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _wait_all(works: list[tuple[Any, str]], deadline: float, timeout_s: float) -> None:
    """Waits for every (gloo) work by ``deadline``."""
    for i, (work, _) in enumerate(works):
        left = deadline - time.monotonic()
        try:
            if left <= 0 or not work.wait(timedelta(seconds=left)):
                raise TimeoutError("deadline passed")
        except Exception as err:  # a dead peer: a gloo connection error; a silent one: timeout
            pending = ", ".join(w for _, w in works[i : i + 4])
            more = f" and {len(works) - i - 4} more" if len(works) - i > 4 else ""
            raise ExchangeError(
                f"pack exchange failed within exchange_timeout_s={timeout_s:g}: waiting for"
                f" {pending}{more} ({type(err).__name__}: {err})"
            ) from err
