"""``StragglerMonitor``: per-rank, per-phase step timing with the wait at every sync point."""

from __future__ import annotations

import logging
import numbers
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from typing_extensions import override

from lightning_vlmbalance.balance.cost import features_from_meta
from lightning_vlmbalance.callbacks._monitor_hooks import _TimingHooks
from lightning_vlmbalance.callbacks._options import checked_log_every_n_steps
from lightning_vlmbalance.parallel import DataParallelWorld, data_parallel_world
from lightning_vlmbalance.timing import StepTimer, StragglerRecorder, custom_scalars_layout

__all__ = ["StragglerMonitor", "TimedStepsListener"]

log = logging.getLogger(__name__)


class TimedStepsListener(Protocol):
    """What :meth:`StragglerMonitor.subscribe` takes: something fed the timed optimizer steps
    (the rebalancing strategy's online calibration subscribes itself). Every method runs on
    every rank at the same point, so a listener may run collectives in them."""

    state_key: str  # its entry in the monitor's checkpoint state

    def start(self, world: DataParallelWorld, global_step: int, state: Any = None) -> None:
        """Training starts at ``global_step`` (after a restore) in ``world`` (every process);
        ``state``: the listener's :meth:`state_dict` from the checkpoint, if any."""

    def on_timed_steps(self, steps: list[Any], global_step: int) -> dict[str, float]:
        """Steps newly timed (``ResolvedStep``: every micro-batch's pack features and phase
        times) after optimizer step ``global_step``; returns metrics for rank 0 to log."""
        ...

    def end(self) -> None:
        """Training ended: join any thread."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (under ``state_key``)."""
        ...


class _Listeners:
    """The listeners fed the timed steps of one fit (:meth:`StragglerMonitor.subscribe`), and
    the listener states a checkpoint restored, each kept until its listener starts."""

    def __init__(self) -> None:
        self.subscribed: list[TimedStepsListener] = []
        self.restored: dict[str, Any] = {}  # from a checkpoint, by state_key

    def add(self, listener: TimedStepsListener) -> None:
        """Subscribes ``listener`` once, however often it is added."""
        if listener not in self.subscribed:
            self.subscribed.append(listener)

    def start(self, world: DataParallelWorld, global_step: int) -> None:
        """Starts every listener, each with its restored state (consumed) if there is one."""
        for listener in self.subscribed:
            state = self.restored.pop(listener.state_key, None)
            listener.start(world, global_step, state)

    def end(self) -> None:
        """Ends every listener (training ended: they join their threads)."""
        for listener in self.subscribed:
            listener.end()

    def state_dict(self) -> dict[str, Any]:
        """Every listener's state, by its ``state_key``."""
        return {listener.state_key: listener.state_dict() for listener in self.subscribed}


class StragglerMonitor(Callback):
    """Times every rank's phases per optimizer step and shows who waits for whom in TensorBoard.

    Per optimizer step and rank it measures ``data``, ``vision_fwd``, ``llm_fwd``, ``backward``,
    ``optimizer``, ``sync_wait`` (waiting at the gradient all-reduce, timed with a DDP
    communication hook that adds no collective), ``lightning_sync`` (Lightning's
    per-micro-batch SIGTERM-flag broadcast, a barrier), ``encoder_return`` (under encoder
    balancing), ``collective_wait`` (under FSDP2) and ``step``. It adds no collective and no
    device synchronisation per step: on CUDA the phases are CUDA events read with ``query()``.
    At each log point all ranks gather their sums since the last one in one small all-gather,
    and rank 0 logs:

    ====================================  ====================================================
    ``straggler/<phase>_ms/rank_<r>``     mean milliseconds per step of ``<phase>`` on rank r
                                          (phases above and ``step``)
    ``straggler/waste_frac``              waiting (``sync_wait``, ``lightning_sync``,
                                          ``encoder_return``, ``collective_wait``) over total
                                          rank-time
    ``straggler/worst_rank``              rank with the most busy (non-waiting) time
    ``straggler/max_over_median``         its busy time over the median rank's
    ``packing/efficiency``                the real packs trained since the last log point, all
                                          ranks: their tokens (``meta["total_tokens"]``) over
                                          their capacity (``input_ids.numel()``, ``seq_len``);
                                          padding packs and batches that are not packed
                                          batches are left out (no value without any)
    ====================================  ====================================================

    Log points are those of Lightning's own ``self.log`` metrics: the optimizer steps that
    ``Trainer(log_every_n_steps=N)`` logs (``global_step`` a multiple of ``N``), at the step
    Lightning writes them at (the number of optimizer steps before that one), so that the
    monitor's charts line up with the LightningModule's; ``log_every_n_steps`` on the monitor
    replaces ``N``. The end of training is a log point for the steps left since the last one.

    A TensorBoard custom-scalars layout shows each phase as one chart with one line per rank.
    Every rank also appends its raw per-step times to ``<log_dir>/straggler/rank_<r>.jsonl``
    (schema in ``docs/straggler_monitor.md``), the input of cost-model calibration.

    Validation or a checkpoint save between two micro-batches of an optimizer step is not
    training: it is left out of the step (``outside_step_ms`` in the JSON lines), and the other
    ranks' wait for it is ``between_steps_ms``, not ``lightning_sync``.

    Checkpoints and resuming: every checkpoint saved during ``fit`` holds the whole-run totals of
    every step timed up to it (each save gathers the steps since the last log point, a small
    all-gather that every rank reaches inside ``Trainer.save_checkpoint``, which Lightning
    requires on every rank; on CUDA it first synchronises the device once). A checkpoint saved
    after an exception (``trainer.interrupted``) gathers nothing and holds the totals of the
    last gather. When training starts, each rank drops the records of its JSON-lines
    file past the starting ``global_step`` (after a resume, the steps that are trained again), so
    a file holds each optimizer step once. A resume that writes a new folder (a new logger
    version) starts it at the checkpoint's step + 1; the previous folder keeps its records,
    including the steps after the checkpoint: calibrate on one folder.

    The recording, the JSON lines, the gather and the checkpointed totals are the framework-free
    :class:`~lightning_vlmbalance.timing.StragglerRecorder` (``self.recorder``); this callback
    finds the modules, hooks them, Lightning's loop and DDP's comm hook, and logs.

    Args:
        log_every_n_steps: optimizer steps between log points (and gathers); ``None``: the
            Trainer's ``log_every_n_steps`` (with ``Trainer(log_every_n_steps=0)`` nothing is
            logged; the end of training still gathers, for :meth:`summary`).
        vision_module: the vision submodule (an ``nn.Module`` or a dotted name); ``None`` looks
            for one named ``vision``, ``vision_tower``, ``vision_model``, ``visual``,
            ``vision_encoder``, ``image_encoder`` or ``vit``; ``False`` disables it.
        llm_module: the language submodule, likewise (``llm``, ``language_model``,
            ``text_model``, ``lm``, ``decoder``). Vision forward nested inside it is excluded.
        jsonl_dir: where the JSON-lines files go (default: ``<trainer.log_dir>/straggler``).

    Raises:
        ValueError: for ``log_every_n_steps < 1`` or a module name that does not exist.

    Example::

        trainer = L.Trainer(strategy="ddp", devices=8, callbacks=[StragglerMonitor()])
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        vision_module: nn.Module | str | bool | None = None,
        llm_module: nn.Module | str | bool | None = None,
        jsonl_dir: str | Path | None = None,
    ) -> None:
        self.log_every_n_steps = (
            None
            if log_every_n_steps is None
            else checked_log_every_n_steps("StragglerMonitor", log_every_n_steps)
        )
        self._every = 0  # the optimizer steps between log points in use (0: no log points)
        self.vision_module = vision_module
        self.llm_module = llm_module
        self.jsonl_dir = jsonl_dir
        self.recorder = StragglerRecorder()
        self.jsonl_path: Path | None = None
        self._hooks = _TimingHooks()  # into the model, the optimizers, the loop, DDP, FSDP2
        self._last_step = 0
        self._failed = False
        self._fitting = False  # from on_train_start to the end of fit: checkpoints gather
        # fed the timed steps (the rebalancing strategies' online calibration subscribes)
        self._listeners = _Listeners()

    @property
    def timer(self) -> StepTimer:
        """The recorder's phase timer (replaced at ``setup`` by one on the strategy's device)."""
        return self.recorder.timer

    @property
    def steps_timed(self) -> int:
        """Optimizer steps gathered from every rank over the whole run."""
        return self.recorder.steps_timed

    # -- set-up ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # listeners subscribe per fit (a strategy's, in its own setup, which comes after this
        # one): those of an earlier fit are fed no more (their state stayed in the checkpoints
        # saved after that fit)
        self._listeners.subscribed.clear()
        self.recorder.use_clock("cuda" if trainer.strategy.root_device.type == "cuda" else "cpu")
        self._hooks.wrap_strategy_comm_hook(trainer.strategy, self.timer)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._failed = False
        self._hooks.install(trainer, pl_module, self.timer, self.vision_module, self.llm_module)
        self.jsonl_path = _jsonl_path(trainer, self.jsonl_dir)  # opened at train start
        if trainer.is_global_zero:
            _add_custom_scalars(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after a checkpoint was restored (on_fit_start runs before the restore)
        self._last_step = trainer.global_step
        self._every = _log_interval(trainer, self.log_every_n_steps)
        world = data_parallel_world(trainer.strategy)  # every process: one line per rank
        self._listeners.start(world, trainer.global_step)
        self.recorder.start(
            self.jsonl_path,
            trainer.global_step,
            rank=world.global_rank,
            world_size=world.world_size,
        )
        self._fitting = True

    # -- per micro-batch -----------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        meta = batch.get("meta") if isinstance(batch, dict) else None
        if isinstance(meta, dict):
            self.timer.set_features(_pack_features(meta))

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self.timer.start("backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer.stop_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.timer.start("optimizer")

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.enabled and (fill := _pack_fill(batch)) is not None:
            self.recorder.note_pack(*fill)
        if trainer.global_step == self._last_step:  # still accumulating
            self.timer.end_micro()
            return
        self._last_step = trainer.global_step
        if not self.enabled:
            return
        self.timer.end_step(trainer.global_step, trainer.current_epoch)
        resolved = self.recorder.collect()
        if self._every and trainer.global_step % self._every == 0:  # where Lightning logs
            _gather(trainer, self.recorder)
            _log(trainer, self.recorder.metrics())  # means since the last log point
        for listener in self._listeners.subscribed:
            _log(trainer, listener.on_timed_steps(resolved, trainer.global_step))

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fitting:  # inside an optimizer step (a val_check_interval mid-accumulation)
            self.timer.pause()  # resumed when training goes on

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.timer.discard_step()  # nothing is left open between epochs

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._listeners.end()
        if self._failed or not self.enabled:
            return
        self.recorder.synchronize()  # once, at the end: resolve the last steps' events
        _gather(trainer, self.recorder)  # every rank gets here: gather what is left
        if self._every:  # a log point for the steps since the last one
            _log(trainer, self.recorder.metrics())

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # Lightning does not call teardown after an exception: undo everything here, and keep
        # the JSON lines written so far (the steps before a crash are the ones worth reading)
        self._failed = True
        self._fitting = False
        self._listeners.end()  # a refit in flight is joined, as at the end of training
        self.recorder.abort()
        self._cleanup()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        self._fitting = False
        # a restored listener state belongs to the run that restored it (a fit consumes it at
        # its start; `validate(ckpt_path=...)` restores it too): never to a later fit
        self._listeners.restored = {}
        self._hooks.remove()
        self.recorder.close()

    @property
    def enabled(self) -> bool:
        """Whether steps are timed. Switch it only between optimizer steps and identically on
        every rank (say from a callback keyed on ``global_step``): the gather is a collective."""
        return self.recorder.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.recorder.enabled = value

    # -- listeners -----------------------------------------------------------------------------
    def subscribe(self, listener: TimedStepsListener) -> None:
        """Feeds ``listener`` the timed steps of the fit being set up (subscribe from a
        strategy's ``setup``, or any point after this monitor's ``setup``; once, however often
        it subscribes) and keeps its state in this monitor's checkpoints, those saved after the
        fit too, until the next fit sets up."""
        self._listeners.add(listener)

    @property
    def listeners(self) -> tuple[TimedStepsListener, ...]:
        """Those fed the timed steps (:meth:`subscribe`)."""
        return tuple(self._listeners.subscribed)

    def summary(self) -> dict[str, Any]:
        """Whole-run totals, the same on every rank (as of the last gather: a log point, a
        checkpoint save; complete after ``fit``)."""
        return self.recorder.summary()

    # -- checkpointing ---------------------------------------------------------------------------
    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.timer.pause()  # a save between two micro-batches is not training time
        if not self._fitting or not self.recorder.is_open:
            return  # after fit (the totals are complete) or outside it: no collective
        if trainer.interrupted or "callbacks" not in checkpoint:
            # after an exception other ranks may never save (OnExceptionCheckpoint): no
            # collective, the totals are those of the last gather; weights only: no state
            self.recorder.flush()
            return
        # Lightning calls `state_dict` before this hook, with the totals of the last gather.
        # Every rank saves (`Trainer.save_checkpoint` ends in a barrier), and reaches this hook
        # at the same point of its `dump_checkpoint`: gather the steps since the last gather
        self.recorder.synchronize()  # resolve every step up to here (a save syncs anyway)
        _gather(trainer, self.recorder)
        checkpoint["callbacks"][self.state_key] = self.state_dict()

    @override
    def state_dict(self) -> dict[str, Any]:
        # the listeners' states: e.g. the cost model the strategy plans with
        return {**self.recorder.state_dict(), **self._listeners.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        known = self.recorder.state_dict()
        # what is not the recorder's is a listener's (it may subscribe after the restore)
        self._listeners.restored = {k: state.pop(k) for k in list(state) if k not in known}
        self.recorder.load_state_dict(state)


def _gather(trainer: L.Trainer, recorder: StragglerRecorder) -> None:
    """Adds every rank's steps since the last gather to ``recorder``'s totals. A collective:
    every rank calls it at the same point (a log point, a checkpoint save, the end of
    training)."""
    strategy = trainer.strategy
    # one small all-gather through the strategy (the only collective the monitor adds)
    recorder.gather(lambda row: strategy.all_gather(row.to(strategy.root_device)))


def _log(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Rank 0 logs ``metrics`` of the optimizer step that just ended (the last of those they
    cover) at the step Lightning logs that optimizer step's ``self.log`` metrics at."""
    if not trainer.is_global_zero or not metrics:
        return
    step = _lightning_log_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _log_interval(trainer: L.Trainer, every: int | None) -> int:
    """The optimizer steps between log points: ``every``, else the Trainer's
    ``log_every_n_steps`` (0: Lightning logs no step metrics, nor does the monitor)."""
    return every if every is not None else int(trainer.log_every_n_steps or 0)


def _lightning_log_step(trainer: L.Trainer) -> int:
    """The step at which Lightning's logger writes the ``self.log`` metrics of the optimizer
    step that ended last (called from ``on_train_batch_end`` and ``on_train_end``).

    Lightning 2.6 writes training metrics at ``fit_loop.epoch_loop._batches_that_stepped``
    (``LoggerConnector.log_metrics``), which counts the batches that stepped and is incremented
    after the batch's hooks and the metrics' write (``_TrainingEpochLoop.on_advance_end``): the
    number of optimizer steps before the one that ended, ``global_step - 1`` under automatic
    optimization (one optimizer step per stepping batch; Lightning keeps the two in step across
    a resume). Its log points, ``LoggerConnector.should_update_logs``, are
    ``(_batches_that_stepped + 1) % log_every_n_steps == 0``: ``global_step`` a multiple of
    it. Public attributes only; under manual optimization with several optimizer steps per
    batch the two counts part (``global_step`` counts each)."""
    return max(trainer.global_step - 1, 0)


def _pack_fill(batch: Any) -> tuple[int, int] | None:
    """``(real tokens, capacity)`` of a packed micro-batch (``PackCollator``'s ``PackedBatch``):
    its ``meta["total_tokens"]`` (images included) and the token slots of its ``input_ids``
    (``seq_len``); ``None`` for a padding pack and for a batch of another kind. Host integers
    and tensor shapes only: no device sync."""
    if not isinstance(batch, dict):
        return None
    meta, input_ids = batch.get("meta"), batch.get("input_ids")
    if not isinstance(meta, dict) or not isinstance(input_ids, torch.Tensor):
        return None
    tokens = meta.get("total_tokens")
    if meta.get("padding") or not isinstance(tokens, numbers.Integral) or not input_ids.numel():
        return None
    return int(tokens), input_ids.numel()


def _jsonl_path(trainer: L.Trainer, jsonl_dir: str | Path | None) -> Path:
    """This rank's JSON-lines file in ``jsonl_dir`` (default: ``<trainer.log_dir>/straggler``),
    its folder created. Every rank calls it at the same point: ``trainer.log_dir`` is a
    broadcast from rank 0."""
    directory = Path(jsonl_dir) if jsonl_dir else None
    if directory is None:
        log_dir = trainer.log_dir  # a broadcast from rank 0: every rank calls it here
        directory = Path(log_dir or trainer.default_root_dir) / "straggler"
    directory.mkdir(parents=True, exist_ok=True)
    rank = data_parallel_world(trainer.strategy).global_rank
    return directory / f"rank_{rank}.jsonl"


def _add_custom_scalars(trainer: L.Trainer) -> None:
    """Gives every TensorBoard logger the layout of one chart per phase, one line per rank."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_custom_scalars(custom_scalars_layout())


def _pack_features(meta: dict[str, Any]) -> dict[str, Any]:
    """The pack id and cost features of a micro-batch, for calibration (partial meta: the id
    only; such records are skipped by ``CostModel.fit``)."""
    features: dict[str, Any] = {"pack_id": meta["pack_id"]} if "pack_id" in meta else {}
    try:
        features.update(features_from_meta(meta))
    except ValueError:
        pass
    return features
