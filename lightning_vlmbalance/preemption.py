"""Preemption: a SIGTERM stops every rank at the same agreed step, with status 143, and no
DataLoader worker dies of it on its own.

Lightning's own SIGTERM handler runs a broadcast on the world group inside the signal handler,
wherever the main thread was interrupted, and raises on each rank as soon as that rank saw the
signal: collectives are left unpaired and ranks hang. :class:`SigtermAgreement` makes the handler
only set a flag; the ranks agree on it with one all-reduce at the point where Lightning would
broadcast its flag (the first micro-batch of each optimizer step, or every micro-batch when the
ranks meet there anyway), and all raise Lightning's ``SIGTERMException`` there together, after
the owner's ``on_stop`` (the rebalancing strategy stops and joins its exchange pass). Every rank
then exits with status 143 (:meth:`SigtermAgreement.release`), and DataLoader workers ignore a
SIGTERM their parent did not send (:class:`WorkersIgnoreSigterm`): a signal to the whole process
group reaches them too, and the main process decides.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context as mpc
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lightning_vlmbalance import _lightning as seam
from lightning_vlmbalance.loaders.map_style import PackedDataLoader
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.loaders.streaming import PackedStreamLoader
from lightning_vlmbalance.parallel import StepSpec

__all__ = ["SigtermAgreement", "WorkersIgnoreSigterm"]

log = logging.getLogger(__name__)


class SigtermAgreement:
    """The ranks of one fit agree on a SIGTERM at a synchronisation point, and stop there.

    Args:
        device: where the agreement's one-element flag lives (the strategy's root device).
        on_stop: called on every rank at the agreed stop, before ``SIGTERMException`` is raised
            (stop work that would run collectives after the stop).
    """

    def __init__(self, device: Callable[[], torch.device], on_stop: Callable[[], None]) -> None:
        self._device = device
        self._on_stop = on_stop
        self._trainer: Any = None
        self._pending = False
        self._spec: StepSpec | None = None

    def install(self, trainer: Any, spec: StepSpec) -> None:
        """Takes Lightning's SIGTERM handler and its per-micro-batch sync point for ``trainer``'s
        fit: the flag is agreed on at each optimizer step's first micro-batch, or at every
        micro-batch when the ranks meet there (``spec.meets_every_micro_batch``)."""
        seam.own_sigterm_handler(trainer, self._on_sigterm)
        self._trainer, self._pending, self._spec = trainer, False, spec

        def agree_on_sigterm() -> None:
            if not spec.meets_every_micro_batch and seam.micro_batch_index(trainer) % (
                spec.micro_steps
            ):
                return  # only at the first micro-batch of an optimizer step
            flag = torch.tensor([int(self._pending)], device=self._device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank, same point: paired
            if int(flag.item()):
                seam.set_received_sigterm(trainer)
                self._on_stop()  # e.g. the pass in progress ends on every rank
                # every rank exits 143 now: rank 0's launcher must not SIGKILL it when one does
                seam.stop_watching_launched_ranks()
                raise SIGTERMException()

        seam.loop_seam(trainer).replace_sync_point(self, agree_on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler: no collective and no exception here, only a flag."""
        world = self._spec.world if self._spec is not None else None
        log.info("rank %d received SIGTERM (%s)", 0 if world is None else world.global_rank, signum)
        if world is None or world.world_size <= 1:  # alone: Lightning's flag (it raises later)
            seam.set_received_sigterm(self._trainer)
        else:  # agreed on by every rank at the next synchronisation point
            self._pending = True

    def release(self) -> None:
        """At the strategy's teardown: gives Lightning its handler and sync point back, and
        makes a ``SIGTERMException`` in flight exit with status 143."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        seam.release_sigterm_handler(trainer)
        seam.leave_loop_seam(trainer, self)
        # Lightning tears the strategy down inside its `except`, then re-raises: a
        # SIGTERMException (ours at the agreed stop, or Lightning's own in one process) is a
        # bare SystemExit, status 0, which torchrun, a Kubernetes Job or a SLURM requeue script
        # reads as "finished"; 143 (128 + SIGTERM) reads as "terminated"
        stopping = sys.exc_info()[1]
        if isinstance(stopping, SIGTERMException) and not stopping.code:
            stopping.code = 128 + signal.SIGTERM


class WorkersIgnoreSigterm:
    """A DataLoader ``worker_init_fn``: the worker ignores a SIGTERM that its parent did not send,
    then the loader's own ``worker_init_fn`` runs (the user's, Lightning's seeding).

    SLURM at the time limit and ``kill`` of a process group signal every process, DataLoader
    workers included; torch's worker handler dies of a SIGTERM that its parent did not send, and
    the main process then raises "DataLoader worker ... killed" wherever it is, not the agreed
    stop. Ignoring it leaves the decision to the main process, which ends its workers as at the
    end of any pass (torch's watchdog ends them if the main process is gone).

    A SIGTERM from the parent still ends the worker, as torch's handler does (exit status 0):
    Python's exit handler stops daemonic processes that way (``multiprocessing`` terminates and
    joins them at interpreter exit, where torch no longer shuts its workers down itself), so a
    worker that ignored every SIGTERM kept its rank waiting forever after ``fit`` (persistent
    workers, or an iterator a traceback still held). The sender is known only to
    ``sigwaitinfo``: SIGTERM stays blocked in the worker and a thread waits for it.
    """

    def __init__(self, init_fn: Any) -> None:
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        # blocked in every thread (a worker started by _sigterm_blocked_start has it blocked
        # already; the threads started from here inherit the mask): only the waiting thread
        # takes it, with its sender. One sent since the fork is still pending and taken now.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(
            target=_take_sigterm,
            args=(os.getppid(),),
            name="vlmbalance-worker-sigterm",
            daemon=True,
        ).start()
        if self.init_fn is not None:
            self.init_fn(worker_id)

    @classmethod
    def install(cls, dataloader: Any, rank: int) -> None:
        """Wraps the ``worker_init_fn`` of the loader whose workers run (a torch ``DataLoader``
        or a ``PackedDataLoader``, alone or inside the strategy's ``RebalancingLoader``), once,
        Lightning's seeding added first; any other iterable has no workers to reach."""
        inner = dataloader.loader if isinstance(dataloader, RebalancingLoader) else dataloader
        if not isinstance(inner, DataLoader | PackedDataLoader | PackedStreamLoader):
            return
        if isinstance(inner.worker_init_fn, cls):
            return
        seam.add_lightning_worker_init_fn(inner, rank)
        inner.worker_init_fn = cls(inner.worker_init_fn)
        # a worker lives from its fork to its worker_init_fn with torch's SIGTERM handler, which
        # dies of a signal its parent did not send: at every pass's start (new workers) a signal
        # to the process group would kill one. Workers start with SIGTERM blocked instead.
        if inner.num_workers > 0:
            inner.multiprocessing_context = _sigterm_blocked_start(inner.multiprocessing_context)


def _take_sigterm(parent: int) -> None:
    """A DataLoader worker's SIGTERM, taken by a thread: from the parent, the worker ends (exit
    status 0, as torch's own handler does); from anyone else (a signal to the process group),
    nothing happens."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)


class _BlockSigtermAtStart:
    """A ``multiprocessing`` process whose ``start`` blocks SIGTERM in the calling thread for the
    fork: the child inherits the mask (a SIGTERM to the parent meanwhile is delivered right
    after)."""

    def start(self) -> None:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            super().start()  # type: ignore[misc]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _ForkProcess(_BlockSigtermAtStart, mpc.ForkProcess):
    pass


class _SpawnProcess(_BlockSigtermAtStart, mpc.SpawnProcess):
    pass


class _ForkServerProcess(_BlockSigtermAtStart, mpc.ForkServerProcess):
    pass


class _ForkContext(mpc.ForkContext):
    Process = _ForkProcess
    _sigterm_blocked = True


class _SpawnContext(mpc.SpawnContext):
    Process = _SpawnProcess
    _sigterm_blocked = True


class _ForkServerContext(mpc.ForkServerContext):
    Process = _ForkServerProcess
    _sigterm_blocked = True


_BLOCKED = {"fork": _ForkContext, "spawn": _SpawnContext, "forkserver": _ForkServerContext}


def _sigterm_blocked_start(context: Any) -> Any:
    """``context`` (a multiprocessing context, its name, or ``None`` for the default) whose
    processes start with SIGTERM blocked. ``WorkersIgnoreSigterm`` unblocks it in the worker
    once it ignores the signal. A context of another kind is returned as it is."""
    if getattr(context, "_sigterm_blocked", False):
        return context
    method = context if isinstance(context, str) or context is None else None
    if method is None:
        method = getattr(context, "_name", None)
    blocked = _BLOCKED.get(method or multiprocessing.get_start_method())
    return context if blocked is None else blocked()
