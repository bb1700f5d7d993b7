"""The one module that touches Lightning's (and torch's) private attributes.

Lightning has no public hook at three points this package needs, so it reaches into private
attributes there; every such access lives here, behind a small function, and is checked by
:func:`check_lightning` at set-up (and by ``tests/test_lightning_seam.py``, which fails when an
attribute disappears or changes meaning):

==========================================================  =======================================
``_TrainingEpochLoop._broadcast_sigterm_tensor``            the per-micro-batch sync point: the
                                                            strategy replaces it (SIGTERM
                                                            agreement once per optimizer step),
                                                            the StragglerMonitor times it
``_TrainingEpochLoop._on_before_fetch`` / ``_on_after_fetch``  data-fetch timing (bound into the
                                                            data fetcher at ``on_run_start``,
                                                            after ``on_fit_start``)
``_TrainingEpochLoop.batch_progress.current.ready``         index of the micro-batch about to run
``Trainer._signal_connector`` (``_sigterm_notifier_fn``,    the SIGTERM handler Lightning composes
``received_sigterm``)                                       in ``register_signal_handlers``
``DDPStrategy._ddp_comm_hook``                              the comm hook Lightning registers on
                                                            CUDA (the monitor wraps it)
``torch._C._current_graph_task_id``                         "is autograd running a backward?"
``_FitLoop.epoch_progress.current.processed``               the epoch the fit loop runs next (what
                                                            it passes to ``set_epoch``)
``_FitLoop.max_batches``, ``_combined_loader`` (its         the training batches of the epoch,
``limits`` and ``_iterator.limits``), ``_data_fetcher``     read once from ``len`` before
(``length``), ``Trainer.val_check_batch``                   ``set_epoch``: re-read when an epoch's
                                                            plan has another pack count
``_ChildProcessObserver._child_processes``                  the ranks rank 0's launcher watches
                                                            (it SIGKILLs rank 0 when one exits
                                                            non-zero): emptied at the agreed stop
``fabric.utilities.data._auto_add_worker_init_fn``          Lightning's worker seeding, added
                                                            after ``process_dataloader`` if the
                                                            loader has no ``worker_init_fn``
``ModelParallelStrategy._data_parallel_size`` /             the mesh sizes as given (``"auto"``):
``_tensor_parallel_size``                                   ``fsdp_vlmbalance`` decides them first
``Strategy._forward_redirection`` (reads                    a term added to ``training_step``'s
``training_step`` off the module at call time)              loss inside DDP's forward, where DDP
                                                            finds its unused parameters
==========================================================  =======================================

Several listeners can share one loop point: :func:`loop_seam` installs one dispatcher per point
on the loop instance and keeps a registry of who listens, so the strategy's replacement and the
monitor's timing compose in a fixed order whatever Lightning's call order, and each owner removes
only its own listener.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.data import _auto_add_worker_init_fn, sized_len
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.connectors.data_connector import (
    _parse_num_batches,
    _process_dataloader,
)
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import RunningStage
from packaging.version import Version

__all__ = [
    "SUPPORTED_LIGHTNING",
    "LoopSeam",
    "add_lightning_worker_init_fn",
    "adding_to_training_loss",
    "check_lightning",
    "ddp_comm_hook",
    "epoch_to_train",
    "in_backward",
    "leave_loop_seam",
    "loop_seam",
    "micro_batch_index",
    "model_parallel_sizes",
    "own_sigterm_handler",
    "refresh_epoch_batches",
    "release_sigterm_handler",
    "resume_position",
    "set_ddp_comm_hook",
    "set_model_parallel_sizes",
    "set_received_sigterm",
    "stop_watching_launched_ranks",
]

# keep in step with pyproject.toml's dependency range
SUPPORTED_LIGHTNING = (">=2.5", "<2.7")

_LOOP_POINTS = ("_broadcast_sigterm_tensor", "_on_before_fetch", "_on_after_fetch")


@functools.cache
def _problems() -> tuple[str, ...]:
    """What the package needs from Lightning's privates and does not find (empty: all there)."""
    problems = []
    for name in _LOOP_POINTS:
        if not callable(getattr(_TrainingEpochLoop, name, None)):
            problems.append(f"`_TrainingEpochLoop.{name}` is missing")
    if "_broadcast_sigterm_tensor()" not in inspect.getsource(_TrainingEpochLoop.advance):
        problems.append("`_TrainingEpochLoop.advance` no longer calls `_broadcast_sigterm_tensor`")
    if "_on_before_fetch" not in inspect.getsource(_TrainingEpochLoop.on_run_start):
        problems.append("`_TrainingEpochLoop.on_run_start` no longer binds `_on_before_fetch`")
    if "batch_progress.current.ready" not in inspect.getsource(
        _TrainingEpochLoop._accumulated_batches_reached
    ):
        problems.append("accumulation is no longer keyed on `batch_progress.current.ready`")
    if not callable(getattr(_SignalConnector, "_sigterm_notifier_fn", None)):
        problems.append("`_SignalConnector._sigterm_notifier_fn` is missing")
    elif "self._sigterm_notifier_fn" not in inspect.getsource(
        _SignalConnector.register_signal_handlers
    ):
        problems.append("`register_signal_handlers` no longer uses `_sigterm_notifier_fn`")
    if "_ddp_comm_hook" not in inspect.getsource(DDPStrategy._register_ddp_hooks):
        problems.append("`DDPStrategy._register_ddp_hooks` no longer reads `_ddp_comm_hook`")
    mesh_sizes = inspect.getsource(ModelParallelStrategy.__init__)
    for name in ("_data_parallel_size", "_tensor_parallel_size"):
        if f"self.{name}" not in mesh_sizes:
            problems.append(f"`ModelParallelStrategy` no longer keeps `{name}`")
    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        problems.append("`torch._C._current_graph_task_id` is missing")
    setup_data = inspect.getsource(_FitLoop.setup_data)
    for needed in ("_parse_num_batches(", "combined_loader.limits", "self.max_batches", "iter("):
        if needed not in setup_data:
            problems.append(f"`_FitLoop.setup_data` no longer uses `{needed}`")
    if "epoch_progress.current.processed" not in inspect.getsource(_FitLoop.on_advance_start):
        problems.append("`_FitLoop.on_advance_start` no longer sets the epoch it processes")
    if "self.length" not in inspect.getsource(_DataFetcher.__next__):
        problems.append("`_DataFetcher.__next__` no longer ends the epoch at its `length`")
    if "self._child_processes" not in inspect.getsource(_ChildProcessObserver._run):
        problems.append("`_ChildProcessObserver._run` no longer reads `_child_processes`")
    process = inspect.getsource(_process_dataloader)
    if not 0 <= process.find("process_dataloader(") < process.find("_auto_add_worker_init_fn("):
        problems.append("Lightning no longer adds its `worker_init_fn` after `process_dataloader`")
    if "worker_init_fn is None" not in inspect.getsource(_auto_add_worker_init_fn):
        problems.append("`_auto_add_worker_init_fn` no longer keeps a loader's `worker_init_fn`")
    if "getattr(original_module, method_name)" not in inspect.getsource(
        _ForwardRedirection.__call__
    ):
        problems.append("`_ForwardRedirection` no longer reads the method at call time")
    return tuple(problems)


def check_lightning() -> None:
    """Raises ``RuntimeError`` naming the supported Lightning range and what is missing if this
    Lightning lacks a private attribute the package relies on (run at set-up); a version outside
    the tested range that has them all gets a warning."""
    version = Version(lightning.__version__)
    problems = _problems()
    if problems:
        raise RuntimeError(
            f"lightning_vlmbalance supports lightning {','.join(SUPPORTED_LIGHTNING)}; lightning"
            f" {version} lacks what it relies on: " + "; ".join(problems)
        )
    low, high = (Version(bound.lstrip("<>=")) for bound in SUPPORTED_LIGHTNING)
    if not low <= version < high:
        warnings.warn(
            f"lightning_vlmbalance is tested with lightning {','.join(SUPPORTED_LIGHTNING)},"
            f" found {version}",
            stacklevel=2,
        )


# -- the training loop's private points ---------------------------------------------------------


class LoopSeam:
    """Dispatchers for the epoch loop's private points, with a registry of listeners.

    ``sync_point``: the loop calls it at the start of every micro-batch (Lightning broadcasts
    its SIGTERM flag there when ``world_size > 1``). At most one owner *replaces* it
    (:meth:`replace_sync_point`); any number *wrap* it (:meth:`wrap_sync_point`, outermost
    first in registration order). ``fetch``: ``before()`` / ``after()`` around each fetch.
    """

    def __init__(self, loop: Any) -> None:
        self._loop = weakref.ref(loop)
        self._replacement: tuple[object, Callable[[], None]] | None = None
        self._wrappers: list[tuple[object, Callable[[Callable[[], None]], None]]] = []
        self._fetch: list[tuple[object, Callable[[], None], Callable[[], None]]] = []
        self._original = {name: getattr(type(loop), name).__get__(loop) for name in _LOOP_POINTS}
        loop._broadcast_sigterm_tensor = self._sync_point
        loop._on_before_fetch = self._before_fetch
        loop._on_after_fetch = self._after_fetch

    def replace_sync_point(self, owner: object, fn: Callable[[], None]) -> None:
        if self._replacement is not None and self._replacement[0] is not owner:
            raise RuntimeError(
                f"the loop's sync point is replaced by {type(self._replacement[0]).__name__}"
                f" already; {type(owner).__name__} cannot replace it too"
            )
        self._replacement = (owner, fn)

    def wrap_sync_point(self, owner: object, wrapper: Callable[[Callable[[], None]], None]) -> None:
        self._wrappers.append((owner, wrapper))

    def on_fetch(
        self, owner: object, before: Callable[[], None], after: Callable[[], None]
    ) -> None:
        self._fetch.append((owner, before, after))

    def remove(self, owner: object) -> None:
        """Drops ``owner``'s listeners; the last one out restores Lightning's methods."""
        if self._replacement is not None and self._replacement[0] is owner:
            self._replacement = None
        self._wrappers = [w for w in self._wrappers if w[0] is not owner]
        self._fetch = [f for f in self._fetch if f[0] is not owner]
        loop = self._loop()
        if loop is not None and not (self._replacement or self._wrappers or self._fetch):
            for name in _LOOP_POINTS:
                loop.__dict__.pop(name, None)
            _SEAMS.pop(id(loop), None)

    def _sync_point(self) -> None:
        call = self._replacement[1] if self._replacement else self._original[_LOOP_POINTS[0]]
        for _, wrapper in reversed(self._wrappers):
            call = _bind(wrapper, call)
        call()

    def _before_fetch(self) -> None:
        self._original["_on_before_fetch"]()
        for _, before, _after in self._fetch:
            before()

    def _after_fetch(self) -> None:
        for _, _before, after in reversed(self._fetch):
            after()
        self._original["_on_after_fetch"]()


def _bind(wrapper: Callable[[Callable[[], None]], None], inner: Callable[[], None]):
    return lambda: wrapper(inner)


_SEAMS: dict[int, LoopSeam] = {}


def loop_seam(trainer: Any) -> LoopSeam:
    """The :class:`LoopSeam` of ``trainer``'s training epoch loop (installed on first use; must
    be before the loop's ``on_run_start``, i.e. in ``setup`` or ``on_fit_start``)."""
    check_lightning()
    loop = trainer.fit_loop.epoch_loop
    seam = _SEAMS.get(id(loop))
    if seam is None or seam._loop() is not loop:
        seam = _SEAMS[id(loop)] = LoopSeam(loop)
    return seam


def leave_loop_seam(trainer: Any, owner: object) -> None:
    """Removes ``owner``'s listeners from ``trainer``'s loop seam, if it has one."""
    seam = _SEAMS.get(id(trainer.fit_loop.epoch_loop))
    if seam is not None:
        seam.remove(owner)


def micro_batch_index(trainer: Any) -> int:
    """Index in the epoch of the micro-batch about to run (or running) in the training loop."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def resume_position(trainer: Any) -> int:
    """Micro-batches of the epoch that a resume from a checkpoint saved now does not run again:
    those the training loop has processed. Lightning restarts an interrupted micro-batch (a
    checkpoint on an exception inside it) and counts one whose ``on_train_batch_end`` saved the
    checkpoint as done; at a mid-epoch validation every fetched batch but the one read ahead
    was processed."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


# -- the epoch's number of training batches ------------------------------------------------------


def epoch_to_train(trainer: Any) -> int:
    """The epoch the fit loop runs now or next: what it passes (or will) to ``set_epoch``."""
    return int(trainer.fit_loop.epoch_progress.current.processed)


def refresh_epoch_batches(trainer: Any) -> None:
    """Makes the training loop end this epoch where the training loaders' ``len`` says now.

    Lightning reads ``len(train_dataloader)`` once, in ``setup_data`` (before ``set_epoch``,
    before a resumed loader's state is loaded) and keeps it for every epoch: in its combined
    loader's limits, the fit loop's ``max_batches`` (``num_training_batches``), its data
    fetcher's ``length`` and ``val_check_batch``. A loader whose epochs differ in length calls
    this at the first fetch of each training epoch (its epoch is known then), so the epoch is
    neither cut short nor stretched and epoch-end validation still comes at its last batch.
    """
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None or combined._iterator is None:
        return
    lengths = [sized_len(loader) for loader in combined.flattened]
    limits = [
        _parse_num_batches(
            RunningStage.TRAINING,
            float("inf") if length is None else length,
            trainer.limit_train_batches,
        )
        for length in lengths
    ]
    combined.limits = limits
    combined._iterator.limits = limits  # the running pass keeps its own copy
    batches = len(combined)
    if batches == fit_loop.max_batches:
        return
    fit_loop.max_batches = batches
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = batches
    interval = trainer.val_check_interval
    if getattr(trainer, "_val_check_time_interval", None) is None and isinstance(interval, float):
        trainer.val_check_batch = max(1, int(batches * interval))


# -- SIGTERM -------------------------------------------------------------------------------------


def own_sigterm_handler(trainer: Any, handler: Callable[[int, Any], None]) -> None:
    """Makes ``handler`` Lightning's SIGTERM notifier: ``register_signal_handlers`` (which runs
    after ``strategy.setup``) composes it with the user's and SLURM's handlers instead of
    Lightning's own, which broadcasts inside the signal handler."""
    trainer._signal_connector._sigterm_notifier_fn = handler


def release_sigterm_handler(trainer: Any) -> None:
    trainer._signal_connector.__dict__.pop("_sigterm_notifier_fn", None)


def set_received_sigterm(trainer: Any) -> None:
    """Sets the flag behind ``trainer.received_sigterm`` (what Lightning's handler would set)."""
    trainer._signal_connector.received_sigterm = True


def stop_watching_launched_ranks() -> None:
    """Stops this process's child-process observer (rank 0 under Lightning's subprocess
    launcher) from SIGKILLing it, its checkpoint-on-exception included, when a rank it launched
    exits with a non-zero status: after the agreed stop every rank exits 143 on purpose."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next check finds nothing to watch and ends


def add_lightning_worker_init_fn(dataloader: object, rank: int) -> None:
    """Adds Lightning's worker seeding (``seed_everything(workers=True)``) to ``dataloader``
    now, as Lightning does after ``process_dataloader`` when the loader has no
    ``worker_init_fn``: a ``worker_init_fn`` wrapped around it afterwards keeps it."""
    _auto_add_worker_init_fn(dataloader, rank)


# -- DDP comm hook, autograd ---------------------------------------------------------------------


def ddp_comm_hook(strategy: DDPStrategy) -> Any:
    """The comm hook Lightning will register on CUDA (``None``: DDP's default all-reduce)."""
    return strategy._ddp_comm_hook


def set_ddp_comm_hook(strategy: DDPStrategy, hook: Any) -> None:
    strategy._ddp_comm_hook = hook


# -- ModelParallelStrategy's mesh sizes ---------------------------------------------------------


def model_parallel_sizes(strategy: ModelParallelStrategy) -> tuple[int | str, int | str]:
    """``(data_parallel_size, tensor_parallel_size)`` as the strategy was given them (``"auto"``
    until ``setup_environment`` decides)."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def set_model_parallel_sizes(
    strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int
) -> None:
    """Decides the mesh sizes before ``ModelParallelStrategy.setup_environment`` reads them."""
    strategy._data_parallel_size = int(data_parallel)
    strategy._tensor_parallel_size = int(tensor_parallel)


def in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


# -- training_step's loss -----------------------------------------------------------------------


@contextlib.contextmanager
def adding_to_training_loss(module: Any, extra: Callable[[], torch.Tensor | None]) -> Any:
    """Within: the loss ``module.training_step`` returns (a tensor, or a dict's ``"loss"``) gets
    ``extra()`` added (when not ``None``). The strategy's forward redirection reads
    ``training_step`` off the module when DDP's forward runs, so the term is part of DDP's
    forward output, from which ``find_unused_parameters=True`` finds the parameters without a
    gradient (a term added after it would reach parameters DDP already marked unused)."""
    original = module.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        term = extra()
        if term is None:
            return out
        if isinstance(out, torch.Tensor):
            return out + term.to(out.dtype)
        if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
            return {**out, "loss": out["loss"] + term.to(out["loss"].dtype)}
        return out

    # what Lightning reads of the method (``self.log`` looks for ``dataloader_iter`` in its
    # signature); no ``__wrapped__``: under torch.compile, dynamo fails to follow one to a
    # bound method
    training_step.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    module.training_step = training_step
    try:
        yield
    finally:
        module.__dict__.pop("training_step", None)
