"""Runs a function on N spawned processes joined by a real gloo process group.

Each process calls ``target(rank, world_size, *args)`` after ``init_process_group("gloo")`` and
returns a picklable result; :func:`run_ranks` returns ``{rank: ("ok", result)}`` or
``{rank: ("error", "<ExceptionType>: message")}``. A process that dies without reporting
(killed, or stuck past ``timeout``) shows up as ``("missing", exitcode)``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import socket
import time
from collections.abc import Callable
from typing import Any


def _entry(target, rank, world, port, queue, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        queue.put((rank, "ok", target(rank, world, *args)))
    except BaseException as err:  # reported to the test, never swallowed
        queue.put((rank, "error", f"{type(err).__name__}: {err}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    target: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0
) -> dict[int, tuple[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, port, queue, args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = queue.get(timeout=0.5)
            out[rank] = (status, payload)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        out.setdefault(r, ("missing", p.exitcode))
    return out
