"""Runs a function on N spawned processes joined by a real gloo process group.

Each process calls ``target(rank, world_size, *args)`` after ``torch.set_num_threads(1)`` and
``init_process_group("gloo")`` on a free local port, and returns a picklable result;
:func:`run_ranks` returns ``{rank: ("ok", result)}`` or ``{rank: ("error", "<ExceptionType>:
message")}``. A process that dies without reporting (killed, ``os._exit``, or stuck past
``timeout`` and then killed) shows up as ``("missing", exitcode)``.

The tests (among them the exchange soak, ``tests/suites/soak_exchange.py``) and the
multi-process benchmark ``benchmarks/rebalance_e2e.py`` share this one harness; the keyword
options are what the soak and the benchmark need beyond the tests' defaults.

Ranks are spawned (fresh interpreters) by default. The tests of the loader, the exchange and the
sampler fork them instead (``start_method="forkserver"``) from multiprocessing's fork server,
which imports torch and the package once per test session, rather than paying that import in
every rank of every test: each rank is still a process of its own with its own gloo process
group. Forked ranks share the server's string-hash seed; that every rank computes the same plan
in interpreters started independently is what ``tests/packing/test_plan.py`` and
``tests/balance/test_planner.py`` check (spawned), and every Lightning job of the tests starts
each rank as an interpreter of its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

_JOIN_AFTER_FAILURE_S = 5.0  # how long a rank that outlived the grace period gets to exit
# what the fork server imports once, before it forks ranks (``start_method="forkserver"``)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "lightning_vlmbalance", "harness.ranks"]


def _entry(target, rank, world, port, pg_timeout_s, queue, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        init: dict[str, Any] = {}
        if pg_timeout_s is not None:
            init["timeout"] = timedelta(seconds=pg_timeout_s)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **init
        )
        queue.put((rank, "ok", target(rank, world, *args)))
    except BaseException as err:  # reported to the caller, never swallowed
        queue.put((rank, "error", f"{type(err).__name__}: {err}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def context(start_method: str = "spawn") -> Any:
    """The multiprocessing context of ``start_method``; for ``"forkserver"``, with the server
    importing :data:`FORKSERVER_PRELOAD` when it starts (once per process that uses it)."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
    return mp.get_context(start_method)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(extra: Mapping[str, str] | None) -> Iterator[None]:
    """``os.environ`` plus ``extra`` while the ranks start (a spawned process copies it then)."""
    saved = {k: os.environ.get(k) for k in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    pg_timeout_s: float | None = None,
    grace_s: float | None = None,
    daemon: bool = False,
    start_method: str = "spawn",
) -> dict[int, tuple[str, Any]]:
    """Runs ``target(rank, world, *args)`` on ``world`` spawned ranks; see the module docstring.

    Args:
        target: a module-level (picklable) function.
        world: number of ranks.
        *args: picklable arguments passed to every rank after ``rank, world``.
        timeout: deadline of the whole run in seconds; ranks still alive then are killed.
        env: extra environment variables of the ranks (set in the parent only while they start;
            e.g. ``MALLOC_MMAP_THRESHOLD_``, which glibc reads when a process starts).
        pg_timeout_s: timeout of the default process group (torch's default when ``None``).
        grace_s: once one rank has failed (reported an error, or died without reporting), how
            long the others get to report before they are killed; ``None``: until ``timeout``.
        daemon: start the ranks as daemon processes (killed if this process exits; a daemon
            rank cannot start processes of its own).
        start_method: ``"spawn"``: each rank a fresh interpreter. ``"forkserver"``: each rank a
            process of its own forked from multiprocessing's fork server, which imported torch
            and the package once (:data:`FORKSERVER_PRELOAD`) when this process first used it:
            the same code in the same kind of process, started without importing everything
            again (about 4 s of CPU per rank). Not with ``env``: a forked rank has the server's
            environment.
    """
    if env and start_method != "spawn":
        raise ValueError("`run_ranks(env=...)` needs start_method='spawn'")
    port = _free_port()
    ctx = context(start_method)
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry, args=(target, r, world, port, pg_timeout_s, queue, args), daemon=daemon
        )
        for r in range(world)
    ]
    with _environ(env):
        for p in procs:
            p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    gave_up = False
    while len(out) < world and time.monotonic() < deadline:
        if failed_at is not None and time.monotonic() > failed_at + grace_s:
            gave_up = True
            break
        try:
            rank, status, payload = queue.get(timeout=0.5)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            # a rank dead without a report (its report would have been queued) has failed
            if grace_s is not None and failed_at is None:
                if any(r not in out and not p.is_alive() for r, p in enumerate(procs)):
                    failed_at = time.monotonic()
            continue
        out[rank] = (status, payload)
        if status != "ok" and grace_s is not None and failed_at is None:
            failed_at = time.monotonic()
    for p in procs:
        wait = _JOIN_AFTER_FAILURE_S if gave_up else max(1.0, deadline - time.monotonic())
        p.join(timeout=wait)
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        out.setdefault(r, ("missing", p.exitcode))
    return out
