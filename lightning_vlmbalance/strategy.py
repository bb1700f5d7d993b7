"""``VLMBalanceStrategy``: DDP that moves whole packs between ranks once per global batch.

``Trainer(strategy="vlmbalance")`` (or ``"ddp_vlmbalance"``, or an instance) is DDP plus:

* the training loader is wrapped in a
  :class:`~lightning_vlmbalance.RebalancingLoader`
  (one global batch per optimizer step: :class:`~lightning_vlmbalance.parallel.StepSpec`)
  that plans each global batch with the planner core
  and exchanges the moving packs on a dedicated gloo process group, one global batch ahead in a
  background thread (``mode="overlap"``), or in line (``"sync"``), or not at all (``"off"``:
  only the loss weights are set, the same math as the other modes); every pack carries
  ``loss_weight`` and ``global_loss_tokens`` for its optimizer step, so
  :func:`~lightning_vlmbalance.packed_cross_entropy` gives the gradient of the token-mean loss
  of the whole global batch (:mod:`lightning_vlmbalance.loss`);
* Lightning's per-micro-batch SIGTERM-flag broadcast (a barrier at the start of every
  micro-batch under ``world_size > 1``) runs only at the first micro-batch of each optimizer
  step, so under DDP the ranks synchronise once per step and the ``"step"`` objective applies;
  ``objective="auto"`` picks ``"step"`` then, ``"microstep"`` with ``sigterm_every_micro_batch``.

Everything beyond DDP lives in :class:`Rebalancer`, a component any strategy can own (the sharded
strategy reuses it by composition); the strategy class only forwards its hooks to it.

Metrics (logged from rank 0 at the first micro-batch of each global batch, for that global
batch: its plan and exchange are done by then):

==================================  ======================================================
``balance/moved_packs``             packs that changed rank in the last global batch
``balance/planned_waste_frac``      the planner's predicted waste after rebalancing
``balance/exchange_ms``             time of the exchange itself (in the thread if overlapped)
``balance/exposed_exchange_ms``     time the training loop waited for the global batch
``balance/encoder_moved_images``    with ``encoder=True``: images encoded on another rank than
                                    their pack's, over the last global batch (all ranks)
``balance/encoder_bytes``           the image bytes rank 0 received to encode (rank 0's
                                    alone: no collective counts the others')
``balance/choice``                  ``mode="auto"``: the option taken for the global batch,
                                    its index in ``OPTIONS`` (0 placed, 1 packs moved,
                                    2 images routed, 3 both)
``balance/predicted_step_ms``       ``mode="auto"``: the cost model's step for that option
``balance/source_balanced``         1 when the sampler balanced the batch at the source
                                    (``PackingSampler(balance=...)``: nothing moves); absent
                                    when packs are exchanged
==================================  ======================================================
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    Strategy,
    StrategyRegistry,
)
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from typing_extensions import override

from lightning_vlmbalance import _lightning as seam
from lightning_vlmbalance.balance.calibration import OnlineCalibrator
from lightning_vlmbalance.balance.calibration_listener import CalibrationListener
from lightning_vlmbalance.balance.choice import StepScale
from lightning_vlmbalance.balance.config import RebalanceConfig
from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.encoder import ReturnChannel
from lightning_vlmbalance.balance.epoch_choice import EpochRuntime
from lightning_vlmbalance.balance.groups import ExchangeGroups
from lightning_vlmbalance.balance.model_schedule import ModelSchedule
from lightning_vlmbalance.callbacks.straggler_monitor import StragglerMonitor
from lightning_vlmbalance.loaders.map_style import PackedDataLoader
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.loaders.streaming import PackedStreamLoader
from lightning_vlmbalance.parallel import StepSpec, data_parallel_world, step_spec
from lightning_vlmbalance.preemption import SigtermAgreement, WorkersIgnoreSigterm

__all__ = ["FSDPVLMBalanceStrategy", "Rebalancer", "VLMBalanceStrategy"]


_STRATEGY_NAMES = ("vlmbalance", "ddp_vlmbalance")
_BALANCE_METRICS = ("moved_packs", "planned_waste_frac", "exchange_ms", "exposed_exchange_ms")
_ENCODER_METRICS = ("encoder_moved_images", "encoder_bytes")
_AUTO_METRICS = ("choice", "predicted_step_ms")  # mode="auto": the option taken, its price


# global batches the training loader may have planned beyond the last one trained: the one whose
# packs the loop is reading, and the one the overlapped thread prepares
_PLANNED_AHEAD = 2


class Rebalancer:
    """The rebalancing machinery a strategy owns: exchange process groups, the training loader's
    :class:`~lightning_vlmbalance.RebalancingLoader`, the ``balance/*`` metrics and
    the SIGTERM path. A strategy calls it from its ``setup_distributed``, ``setup``,
    ``process_dataloader``, ``training_step`` and ``teardown``.

    Args:
        strategy: the owning strategy (its ranks, root device and LightningModule are used).
        config: the rebalancing options.
        cost_model: a :class:`CostModel`, a path (``str`` or ``os.PathLike``) to one saved as
            JSON, or ``None`` (defaults).
        sync_every_micro_batch: whether the ranks synchronise at every micro-batch under this
            strategy (decides ``objective="auto"`` and where SIGTERM is agreed on).
        gpu_payloads: on CUDA with NCCL, payloads travel GPU to GPU on an NCCL group of their own.
    """

    def __init__(
        self,
        strategy: Strategy,
        config: RebalanceConfig,
        cost_model: CostModel | str | None,
        *,
        sync_every_micro_batch: bool,
        gpu_payloads: bool = True,
    ) -> None:
        self.strategy = strategy
        self.config = config.resolved(sync_every_micro_batch=sync_every_micro_batch)
        loadable = isinstance(cost_model, str | os.PathLike)
        given = CostModel.load(cost_model) if loadable else cost_model
        if given is not None and not isinstance(given, CostModel):
            raise TypeError(
                f"`{type(strategy).__name__}(cost_model={cost_model!r})`: expected a CostModel"
                " or the path of one saved as JSON"
            )
        self._model_given = given is not None
        # the one holder of the cost model in use: which model plans each optimizer step's
        # global batch (the loader, the calibrator and the metrics read it)
        self.models = ModelSchedule(given)
        self.sync_every_micro_batch = sync_every_micro_batch
        self.gpu_payloads = gpu_payloads
        self.loader: RebalancingLoader | None = None
        self.groups = ExchangeGroups()  # made at setup_groups, destroyed at teardown
        # encoder balancing's return: its group, the monitor's timer, the micro-batch's returns
        self.returns = ReturnChannel()
        self.source_balanced = False  # the training loader's sampler balances at the source
        self.step: StepSpec | None = None  # built at setup, for the fit (or evaluation)
        self.preemption = SigtermAgreement(lambda: self.strategy.root_device, self._stop_pass)
        self._logged_batches = 0
        self._wrapped_for: tuple[int, int] | None = None  # (trainer, epoch) of the last wrap
        self._told_unpacked = False  # a training loader that is not one of the packed ones
        # online calibration: the calibrator on every rank (rank 0 fits), fed by a listener
        # subscribed to the StragglerMonitor (which has the timings); the optimizer step the
        # loader was made at
        calibration = self.config.calibration
        self.calibrator = OnlineCalibrator(self.models, calibration) if calibration else None
        self.calibration = CalibrationListener(self) if self.calibrator is not None else None
        # mode="auto": how the measured step relates to its price, from the monitor's timings
        self.scale = StepScale() if self.config.mode == "auto" else None
        self._told_unheard = False
        self._wrapped_at_step = 0

    def setup_groups(self) -> None:
        """After the world process group (and the device mesh) exist: the exchange's own groups
        (:class:`~lightning_vlmbalance.balance.groups.ExchangeGroups`), among the data-parallel
        peers of each tensor-parallel rank."""
        parallel = data_parallel_world(self.strategy)
        world, size = parallel.world_size, parallel.size
        if world <= 1:
            return
        if size == world:
            peer_groups = [list(range(world))]
        else:
            mesh = self.strategy.device_mesh.mesh  # (data_parallel, tensor_parallel) global ranks
            peer_groups = mesh.reshape(size, -1).T.tolist()
        device = self.strategy.root_device
        gpu = self.gpu_payloads and device.type == "cuda" and dist.get_backend() == "nccl"
        self.groups = ExchangeGroups.create(
            peer_groups,
            parallel.global_rank,
            world,
            timeout_s=self.config.exchange_timeout_s,
            gpu_payloads=gpu,
            encoder=self.config.encoder,
        )
        self.returns.group = self.groups.encoder

    def setup(self, trainer: Any) -> None:
        self._wrapped_for = None
        self.step = StepSpec.of(trainer, objective=self.config.objective)
        if trainer.state.fn == TrainerFn.FITTING:
            self.preemption.install(trainer, self.step)
            self._listen(trainer)

    def _listen(self, trainer: Any) -> None:
        """Times encoder balancing's returns with the fit's StragglerMonitor (``encoder_return``)
        and subscribes online calibration to it (the timings it refits on); without one, says
        once that calibration is on and does nothing."""
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, StragglerMonitor)]
        self.returns.timers.clear()  # a timer of an earlier fit's monitor times no more
        if monitors:
            self.returns.time_with(monitors[0].timer)
            if self.scale is not None:
                monitors[0].subscribe(self.scale)
        if self.calibration is None:
            return
        if not monitors:
            if not self._told_unheard:
                self._told_unheard = True
                warnings.warn(
                    f"`{type(self.strategy).__name__}`: online calibration of the cost model is"
                    " on (`RebalanceConfig(calibration=Calibration())`, the default) but no"
                    " `StragglerMonitor` times the steps it refits on: the cost model stays as"
                    " given. Add `StragglerMonitor()` to the Trainer's callbacks, or pass"
                    " `calibration=None`",
                    stacklevel=2,
                )
            return
        monitors[0].subscribe(self.calibration)  # for this fit (the monitor forgets it after)

    def _stop_pass(self) -> None:
        """At a SIGTERM's agreed stop: the pass in progress ends on every rank."""
        if self.loader is not None:
            self.loader.close()

    def wrap_loader(self, dataloader: object) -> object:
        """The training loader wrapped in a RebalancingLoader (other stages: unchanged)."""
        module = self.strategy.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                f"`{type(self.strategy).__name__}` needs a fixed"
                " `Trainer(accumulate_grad_batches=...)`: a global batch is one optimizer step,"
                " which a GradientAccumulationScheduler changes during training"
            )
        # Lightning processes every training loader of one request at the same epoch; a reload
        # comes at a later one
        wrapped_for = (id(trainer), seam.epoch_to_train(trainer))
        if self.loader is not None and self._wrapped_for == wrapped_for:
            raise ValueError(
                f"`{type(self.strategy).__name__}` rebalances one training dataloader, and"
                " `train_dataloader()` returned several (a list, a dict or a CombinedLoader):"
                " each would run its own exchange on the same process group. Return one loader"
                " of packed batches (e.g. one PackedDataLoader over the concatenated datasets)"
            )
        self._wrapped_for = wrapped_for
        step = step_spec(trainer)
        if isinstance(dataloader, RebalancingLoader):  # wrapped by the user: use its inner one
            if dataloader.micro_steps != step.micro_steps:
                raise ValueError(
                    f"the training loader is a RebalancingLoader(micro_steps="
                    f"{dataloader.micro_steps}) but `Trainer(accumulate_grad_batches="
                    f"{step.micro_steps})`: a global batch must be one optimizer step; make"
                    " them equal (or return the plain loader)"
                )
            dataloader = dataloader.loader
        if isinstance(dataloader, PackedDataLoader | PackedStreamLoader):
            # it needs the trainer for each epoch's length, its optimizer steps and
            # overfit_batches; the RebalancingLoader made below weighs the steps (it says so)
            dataloader.trainer = trainer
        elif not self._told_unpacked:
            self._told_unpacked = True
            warnings.warn(
                f"`{type(self.strategy).__name__}`: the training loader is a"
                f" {type(dataloader).__name__}, not a `PackedDataLoader` or"
                " `PackedStreamLoader`: its batches are rebalanced as they come (packed only if"
                " its collate function packs them), and a checkpoint taken mid-epoch resumes"
                " from the epoch's first batch, not where it stopped. Use"
                " `lightning_vlmbalance.PackedDataLoader` (map-style data) or"
                " `PackedStreamLoader` (streams)",
                stacklevel=2,
            )
        sampler = getattr(dataloader, "sampler", None)
        # balanced at the source: the sampler formed and placed every global batch already, so
        # nothing moves and no exchange thread starts (only the loss weights are set)
        self.source_balanced = bool(getattr(sampler, "balanced", False))
        config = _training_config(self.config, sampler if self.source_balanced else None)
        if self.source_balanced:
            self._one_model_with(sampler)
            # under "auto" the sampler decides each epoch (and forms its packs) for how this
            # loader will train it
            sampler.decide_epochs(
                EpochRuntime(
                    options=config.auto_options,
                    meets_every_micro_batch=step.meets_every_micro_batch,
                    objective=config.objective,
                    tolerance=config.tolerance,
                )
                if config.mode == "auto"
                else None
            )
            if sampler.source_balance.llm_only and not config.encoder:
                warnings.warn(
                    "`SourceBalance(llm_only=True)` forms the packs by their language model's"
                    " cost and leaves the vision encoder's to the image routing, but"
                    f" `{type(self.strategy).__name__}` routes no image (`encoder=False`): the"
                    " encoder's work stays where the packs put it. Use `encoder=True`, or"
                    " `llm_only=None` (priced per epoch where images are routed)",
                    stacklevel=2,
                )
        if self.loader is not None:  # a reload: stop the old loader's pass
            self.loader.close()
        self._logged_batches = 0
        self._wrapped_at_step = trainer.global_step
        self.loader = RebalancingLoader(
            dataloader,  # type: ignore[arg-type]
            micro_steps=step.micro_steps,
            num_replicas=step.world.size,
            rank=step.world.rank,
            group=self.groups.exchange,
            group_ranks=self.groups.ranks,
            models=self.models,
            first_step=trainer.global_step,
            config=config,
            payload_group=self.groups.payload,
            device=self.strategy.root_device if self.groups.payload is not None else None,
            epoch_batches=lambda: trainer.num_training_batches,
            # the training loop's position: a loader that cannot resume starts again from its
            # first batch, while the loop counts on from the checkpoint's
            epoch_position=lambda: seam.resume_position(trainer),
            encoder_group=self.groups.encoder,
            returns=self.returns,
            meets_every_micro_batch=step.meets_every_micro_batch,
            scale=self.scale,
        )
        return self.loader

    def _one_model_with(self, sampler: Any) -> None:
        """A sampler that balances at the source plans with the model in use: before any refit
        was adopted that is the sampler's own (``balance=SourceBalance(cost_model=...)``), which
        the calibrator then judges candidates against and ``calibration/mape_*`` reports; after
        one, a sampler made later (``reload_dataloaders_every_n_epochs``) plans with the adopted
        model, not its starting one."""
        calibrated = self.calibrator is not None and self.calibrator.version > 0
        if calibrated:
            sampler.use_cost_model(self.models.latest)
            return
        if self._model_given and self.models.latest != sampler.cost_model:
            warnings.warn(
                f"`{type(self.strategy).__name__}(cost_model=...)` differs from the cost model"
                " of the training loader's sampler (`PackingSampler(balance=...)`), which plans"
                " every global batch at the source: the sampler's is the model in use (and the"
                " one online calibration refines); give the model to the sampler",
                stacklevel=2,
            )
        self.models.reset(sampler.cost_model)  # nothing planned yet: from the first step

    @property
    def cost_model(self) -> CostModel:
        """The newest cost model of the fit's schedule (:attr:`models`)."""
        return self.models.latest

    def adopt(
        self, model: CostModel, *, global_step: int, sampler_after: int | None = None
    ) -> int | None:
        """Plans with ``model`` from a global batch every rank agrees on: called on every rank
        at the same optimizer step ``global_step`` (the StragglerMonitor's calibration point),
        it switches the training loader three global batches after the last one trained (the
        loader plans at most two ahead), and any loader made later from the start. A sampler
        that balances at the source re-plans the rest of its epoch from the first global batch
        past ``sampler_after`` (the furthest :meth:`sampler_position` of every rank; ``None``,
        as on a resume, whose loader state restored the epoch's plan: from the next epoch).
        Returns the loader's index of the first global batch planned with it (``None``: no
        loader yet). The model goes into the fit's schedule (:attr:`models`) from that
        batch's optimizer step."""
        if self.loader is None:
            self.models.adopt(model, global_step)  # a loader made later: from its first batch
            return None
        packed = self._packed_loader()
        if packed is not None:  # re-plans a source-balanced epoch (others: nothing to do)
            packed.adopt_cost_model(model, after=sampler_after)
        trained = max(0, global_step - self._wrapped_at_step)  # global batches of this loader
        from_batch = trained + _PLANNED_AHEAD + 1
        if self.loader.planned_batches == 0:
            # nothing planned yet on any rank (a resume adopts the checkpoint's model before
            # the first batch is read): from the first global batch (it once planned 3 with
            # the starting model)
            from_batch = 0
        self.models.adopt(model, self._wrapped_at_step + from_batch)
        if self.scale is not None:  # its ratios so far were the old model's
            self.scale.reset(self._wrapped_at_step + from_batch)
        return from_batch

    def _packed_loader(self) -> PackedDataLoader | None:
        inner = None if self.loader is None else self.loader.loader
        return inner if isinstance(inner, PackedDataLoader) else None

    def sampler_position(self) -> int | None:
        """How far a source-balanced sampler's packs of this epoch have been read on this rank
        (:meth:`PackedDataLoader.read_position`); ``None`` without one."""
        packed = self._packed_loader()
        return packed.read_position() if packed is not None and packed.sampler.balanced else None

    def log_stats(self) -> None:
        """Logs the ``balance/*`` metrics of the last global batch, once per global batch."""
        loader = self.loader
        if loader is None or loader.global_batches <= self._logged_batches or not loader.stats:
            return
        self._logged_batches = loader.global_batches
        _log_balance(
            self.strategy.lightning_module,
            loader.stats[-1],
            source_balanced=self._formed_at_source(),
            encoder=self.config.encoder,
        )

    def _formed_at_source(self) -> bool:
        """Whether the epoch in training was formed at the source (a sampler that balances
        at the source may decide per epoch: ``SourceBalance(when="auto")``)."""
        if not self.source_balanced:
            return False
        inner = None if self.loader is None else self.loader.loader
        sampler = getattr(inner, "sampler", None)
        if sampler is None or not hasattr(sampler, "plan"):
            return True
        return bool(sampler.plan().formed_at_source)

    def teardown(self) -> None:
        self.preemption.release()
        if self.loader is not None:
            # Lightning tears the strategy down before the loop closes the loader's iterator:
            # stop the pass (and its collectives) before the exchange group goes away
            self.loader.close()
        self.loader = None
        self.groups.destroy()
        self.returns = ReturnChannel()


def _training_config(config: RebalanceConfig, sampler: Any) -> RebalanceConfig:
    """The config the training loader forms its global batches with. A ``sampler`` that
    balances at the source: under ``"auto"`` with ``SourceBalance(when="auto")`` every option
    (an epoch may be plain, and a formed one's placement is priced like any other), with
    ``when="always"`` the packs stay where the sampler placed them (``"auto"`` may still route
    their images); every other mode moves nothing."""
    if sampler is None:
        return config
    if config.mode == "auto" and sampler.source_balance.when == "auto":
        return config
    if config.mode == "auto" and config.encoder:
        return dataclasses.replace(config, options=("placed", "images"))
    return dataclasses.replace(config, mode="off", options=None)


def _log_balance(module: Any, stats: dict, *, source_balanced: bool, encoder: bool) -> None:
    """Logs the ``balance/*`` metrics of one global batch's ``stats`` from rank 0."""

    def log(key: str, value: float) -> None:
        module.log(f"balance/{key}", float(value), rank_zero_only=True, batch_size=1)

    for key in _BALANCE_METRICS:
        log(key, stats.get(key, 0.0))
    if source_balanced:  # which path ran (absent: the pack exchange)
        log("source_balanced", 1.0)
    for key in _ENCODER_METRICS if encoder else ():
        log(key, stats.get(key, 0.0))
    for key in _AUTO_METRICS:
        if key in stats:
            log(key, stats[key])


def _config_from(
    owner: str,
    config: RebalanceConfig | None,
    **fields: Any,
) -> RebalanceConfig:
    given = {k: v for k, v in fields.items() if v is not None}
    if config is not None and given:
        raise ValueError(
            f"`{owner}(config=..., {', '.join(given)}=...)`: give the options either in the"
            " config or as arguments"
        )
    return config if config is not None else RebalanceConfig(**given)


class _RebalancingProperties:
    """What both rebalancing strategies expose of their :class:`Rebalancer`, and the Lightning
    hooks they forward to it (before the strategy class in the bases: ``super()`` is the
    strategy's own hook)."""

    rebalancer: Rebalancer

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self.rebalancer.setup(trainer)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = self.rebalancer.wrap_loader(super().process_dataloader(dataloader))  # type: ignore[misc]
        WorkersIgnoreSigterm.install(dataloader, data_parallel_world(self).global_rank)
        return dataloader

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # encoder balancing: every rank enters the backward of each return of embeddings (an
        # all_to_all), also when the model left them out of its loss (a pack without image
        # tokens whose model skips the embeddings): a zero of them joins the loss, inside
        # DDP's forward (automatic optimization), or at the backward (manual)
        returns = self.rebalancer.returns
        returns.begin_micro_batch()
        if self.rebalancer.config.encoder:
            with seam.adding_to_training_loss(self.lightning_module, returns.returns_zero):  # type: ignore[attr-defined]
                out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        else:
            out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        self.rebalancer.log_stats()
        return out

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # what training_step's loss did not take (manual optimization)
        zero = self.rebalancer.returns.returns_zero()
        if zero is not None:
            closure_loss = closure_loss + zero.to(closure_loss.dtype)
        return super().backward(closure_loss, *args, **kwargs)  # type: ignore[misc]

    def teardown(self) -> None:
        self.rebalancer.teardown()
        super().teardown()  # type: ignore[misc]

    @property
    def config(self) -> RebalanceConfig:
        """The rebalancing options, ``objective`` resolved."""
        return self.rebalancer.config

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def resolved_objective(self) -> str:
        return self.config.objective

    def step_spec(self, trainer: Any) -> StepSpec:
        """The step of ``trainer``'s fit (:class:`~lightning_vlmbalance.parallel.StepSpec`) with
        this strategy's objective, fixed at set-up (the rebalancing strategies refuse a
        ``GradientAccumulationScheduler``)."""
        return self.rebalancer.step or StepSpec.of(trainer, objective=self.config.objective)

    @property
    def sync_every_micro_batch(self) -> bool:
        """Whether the ranks meet at every micro-batch under this strategy
        (:func:`~lightning_vlmbalance.parallel.meets_every_micro_batch` reads it)."""
        return self.rebalancer.sync_every_micro_batch

    @property
    def rebalancing_loader(self) -> RebalancingLoader | None:
        """The training loader's RebalancingLoader (after the loader was requested)."""
        return self.rebalancer.loader

    def cost_changed(self) -> None:
        """Tells online calibration that the model's cost changed on purpose (a frozen vision
        tower unfrozen, a new image resolution or sequence length): the timings gathered so
        far are dropped, and the next refits see only the model as it is now. Call it on every
        rank (e.g. from a callback at the step of the change). A no-op without calibration."""
        if self.rebalancer.calibrator is not None:
            self.rebalancer.calibrator.reset()


class VLMBalanceStrategy(_RebalancingProperties, DDPStrategy):
    """DDP with overlapped cross-rank rebalancing of packs (see the module docstring).

    Args:
        mode, objective, tolerance, exchange_timeout_s, encoder, options: the fields of
            :class:`~lightning_vlmbalance.balance.config.RebalanceConfig` (``"auto"``,
            ``"auto"``, ``0.0``, ``300.0``, ``False``, ``None`` by default; ``encoder=True``
            also balances the vision encoder image by image, for a model that encodes through
            :func:`~lightning_vlmbalance.balance.encoder.encode_images`; ``options``: what
            ``"auto"`` chooses among), or
        config: a ``RebalanceConfig`` instead of those six (and its ``calibration``).
        cost_model: a :class:`CostModel` or a path to one saved as JSON (default: defaults).
        sigterm_every_micro_batch: keep Lightning's sync point (its SIGTERM-flag broadcast) at
            every micro-batch (then ranks also synchronise per micro-batch: ``"auto"`` means
            ``"microstep"``).
        gpu_payloads: on CUDA with NCCL, exchange pack payloads GPU to GPU on an NCCL group of
            their own (default); ``False`` keeps them in host memory on the gloo group.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ValueError: for an unknown mode or objective, a negative tolerance or a non-positive
            timeout, quoting the call; for ``config`` together with any of its fields.

    Example::

        trainer = L.Trainer(strategy="vlmbalance", devices=8, accumulate_grad_batches=8)
        trainer = L.Trainer(strategy=VLMBalanceStrategy(mode="sync", tolerance=0.001))
    """

    strategy_name = "vlmbalance"

    def __init__(
        self,
        *,
        mode: str | None = None,
        objective: str | None = None,
        tolerance: float | None = None,
        exchange_timeout_s: float | None = None,
        encoder: bool | None = None,
        options: tuple[str, ...] | None = None,
        config: RebalanceConfig | None = None,
        cost_model: CostModel | str | None = None,
        sigterm_every_micro_batch: bool = False,
        gpu_payloads: bool = True,
        **kwargs: Any,
    ) -> None:
        config = _config_from(
            "VLMBalanceStrategy",
            config,
            mode=mode,
            objective=objective,
            tolerance=tolerance,
            exchange_timeout_s=exchange_timeout_s,
            encoder=encoder,
            options=options,
        )
        super().__init__(**kwargs)
        self.rebalancer = Rebalancer(
            self,
            config,
            cost_model,
            sync_every_micro_batch=sigterm_every_micro_batch,
            gpu_payloads=gpu_payloads,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in _STRATEGY_NAMES:
            strategy_registry.register(
                name,
                cls,
                description="DDP with overlapped cross-rank rebalancing of packs",
                override=True,
            )

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.rebalancer.setup_groups()


VLMBalanceStrategy.register_strategies(StrategyRegistry)  # the names work once imported


def _fabric_refusal(name: str) -> Any:
    def refuse(**_: Any) -> Any:
        raise ValueError(
            f"`Fabric(strategy={name!r})`: lightning_vlmbalance's strategies work with the"
            " Lightning `Trainer` only (they rebalance the training loader Lightning's fit loop"
            " drives, through its hooks and checkpoints); Fabric has neither. Under Fabric use"
            " `strategy='ddp'` with `PackedDataLoader(..., micro_steps=A)` (it weighs every"
            " optimizer step of A packs per rank; `fabric.backward(loss / A)`: the contract of"
            " `lightning_vlmbalance.loss`), balance at the source with"
            " `PackingSampler(balance=...)`, time the ranks with"
            " `lightning_vlmbalance.FabricStragglerMonitor`, or train with"
            f" `L.Trainer(strategy={name!r})`"
        )

    return refuse


def _refuse_under_fabric() -> None:
    """Fabric has a strategy registry of its own: the names are taken there by a refusal that
    says why, not Fabric's generic "invalid strategy name"."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES

    for name in (*_STRATEGY_NAMES, "fsdp_vlmbalance"):
        FABRIC_STRATEGIES.register(
            name, _fabric_refusal(name), description="Trainer only (refused)", override=True
        )


_refuse_under_fabric()


class FSDPVLMBalanceStrategy(_RebalancingProperties, ModelParallelStrategy):
    """FSDP2 (Lightning's ``ModelParallelStrategy``) with the same rebalancing as
    ``"vlmbalance"``: ``Trainer(strategy="fsdp_vlmbalance")``.

    The LightningModule shards itself in ``configure_model`` (``fully_shard`` from
    ``torch.distributed.fsdp``, tensor parallelism with ``self.device_mesh["tensor_parallel"]``),
    as under ``ModelParallelStrategy``. The default mesh puts every rank in the data-parallel
    (sharding) dimension: ``ModelParallelStrategy()``'s own default on one node is 1 x
    ``devices`` tensor-parallel, which would neither shard across the devices nor rebalance.

    Synchronisation: FSDP2 all-gathers the parameters in every micro-batch's forward and
    reduce-scatters gradients in every micro-batch's backward, so the ranks meet at every
    micro-batch and ``objective="auto"`` means ``"microstep"``. With
    ``gradient_sync_every_micro_batch=False`` the reduce-scatter waits for the last micro-batch
    of the step (``set_requires_gradient_sync(False)`` before), but the forward all-gathers still
    meet every micro-batch: ``"microstep"`` still applies.

    With tensor parallelism the ranks of one tensor-parallel group compute the same pack: plans
    and exchanges run over the data-parallel dimension, each group of data-parallel peers with
    the same tensor-parallel rank exchanging among themselves, and the loss weight divides by
    the data-parallel size (FSDP averages gradients over that dimension).

    Args:
        mode, objective, tolerance, exchange_timeout_s, encoder, options, config, cost_model,
            gpu_payloads: as for
            :class:`VLMBalanceStrategy`.
        data_parallel_size: default: every rank (``world_size / tensor_parallel_size``).
        tensor_parallel_size: default 1.
        gradient_sync_every_micro_batch: ``False`` skips FSDP's gradient reduce-scatter in the
            accumulating micro-batches (the full unsharded gradient is kept until the last).
        **kwargs: passed to ``ModelParallelStrategy`` (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).

    Example::

        trainer = L.Trainer(strategy="fsdp_vlmbalance", devices=8, accumulate_grad_batches=8)
    """

    strategy_name = "fsdp_vlmbalance"

    def __init__(
        self,
        *,
        mode: str | None = None,
        objective: str | None = None,
        tolerance: float | None = None,
        exchange_timeout_s: float | None = None,
        encoder: bool | None = None,
        options: tuple[str, ...] | None = None,
        config: RebalanceConfig | None = None,
        cost_model: CostModel | str | None = None,
        gpu_payloads: bool = True,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = 1,
        gradient_sync_every_micro_batch: bool = True,
        **kwargs: Any,
    ) -> None:
        config = _config_from(
            "FSDPVLMBalanceStrategy",
            config,
            mode=mode,
            objective=objective,
            tolerance=tolerance,
            exchange_timeout_s=exchange_timeout_s,
            encoder=encoder,
            options=options,
        )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self.gradient_sync_every_micro_batch = gradient_sync_every_micro_batch
        # FSDP meets at every micro-batch (forward all-gathers): SIGTERM is agreed on there too
        self.rebalancer = Rebalancer(
            self, config, cost_model, sync_every_micro_batch=True, gpu_payloads=gpu_payloads
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 with overlapped cross-rank rebalancing of packs",
            override=True,
        )

    @override
    def setup_environment(self) -> None:
        data_parallel, tensor_parallel = seam.model_parallel_sizes(self)
        tensor_parallel = 1 if tensor_parallel == "auto" else int(tensor_parallel)
        if data_parallel == "auto":
            world = self.num_nodes * self.num_processes
            if world % tensor_parallel:
                raise ValueError(
                    f"`FSDPVLMBalanceStrategy(tensor_parallel_size={tensor_parallel})`"
                    f" does not divide the {world} ranks"
                )
            data_parallel = world // tensor_parallel
        seam.set_model_parallel_sizes(self, int(data_parallel), tensor_parallel)
        super().setup_environment()
        self.rebalancer.setup_groups()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning calls this around the accumulating micro-batches' backward."""
        if self.gradient_sync_every_micro_batch:
            yield None
            return
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in sharded:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in sharded:
                m.set_requires_gradient_sync(True, recurse=False)


FSDPVLMBalanceStrategy.register_strategies(StrategyRegistry)
