"""``VLMBalanceStrategy``: DDP that moves whole packs between ranks once per global batch.

``Trainer(strategy="vlmbalance")`` (or ``"ddp_vlmbalance"``, or an instance) is DDP plus:

* the training loader is wrapped in a
  :class:`~lightning_vlmbalance.balance.loader.RebalancingLoader`
  (``micro_steps = accumulate_grad_batches``) that plans each global batch with the planner core
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

Metrics (logged from rank 0 at the end of each global batch):

==================================  ======================================================
``balance/moved_packs``             packs that changed rank in the last global batch
``balance/planned_waste_frac``      the planner's predicted waste after rebalancing
``balance/exchange_ms``             time of the exchange itself (in the thread if overlapped)
``balance/exposed_exchange_ms``     time the training loop waited for the global batch
==================================  ======================================================
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.loader import MODES, RebalancingLoader
from lightning_vlmbalance.balance.planner import OBJECTIVES

__all__ = ["VLMBalanceStrategy"]

log = logging.getLogger(__name__)

STRATEGY_NAMES = ("vlmbalance", "ddp_vlmbalance")


class VLMBalanceStrategy(DDPStrategy):
    """DDP with overlapped cross-rank rebalancing of packs (see the module docstring).

    Args:
        mode: ``"overlap"`` (default), ``"sync"`` or ``"off"``.
        objective: ``"auto"``, ``"microstep"``, ``"step"`` or ``"both"``.
        tolerance: planner tolerance (fraction of the balance-optimal value).
        cost_model: a :class:`CostModel` or a path to one saved as JSON (default: defaults).
        exchange_timeout_s: deadline of every exchange wait; a failed or dead peer becomes an
            error on every rank within it.
        sigterm_every_micro_batch: keep Lightning's SIGTERM broadcast at every micro-batch
            (then ranks also synchronise per micro-batch: ``"auto"`` means ``"microstep"``).
        gpu_payloads: on CUDA with NCCL, exchange pack payloads GPU to GPU on an NCCL group of
            their own (default); ``False`` keeps them in host memory on the gloo group.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ValueError: for an unknown mode or objective, a negative tolerance or a non-positive
            timeout, quoting the call.

    Example::

        trainer = L.Trainer(strategy="vlmbalance", devices=8, accumulate_grad_batches=8)
        trainer = L.Trainer(strategy=VLMBalanceStrategy(mode="sync", tolerance=0.001))
    """

    strategy_name = "vlmbalance"

    def __init__(
        self,
        *,
        mode: str = "overlap",
        objective: str = "auto",
        tolerance: float = 0.0,
        cost_model: CostModel | str | None = None,
        exchange_timeout_s: float = 300.0,
        sigterm_every_micro_batch: bool = False,
        gpu_payloads: bool = True,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`VLMBalanceStrategy(mode={mode!r})`: expected one of {MODES}")
        if objective != "auto" and objective not in OBJECTIVES:
            raise ValueError(
                f"`VLMBalanceStrategy(objective={objective!r})`: expected 'auto' or one of"
                f" {OBJECTIVES}"
            )
        if not tolerance >= 0:
            raise ValueError(f"`VLMBalanceStrategy(tolerance={tolerance!r})` must be >= 0")
        if not exchange_timeout_s > 0:
            raise ValueError(
                f"`VLMBalanceStrategy(exchange_timeout_s={exchange_timeout_s!r})` must be > 0"
            )
        super().__init__(**kwargs)
        self.mode = mode
        self.objective = objective
        self.tolerance = tolerance
        self.cost_model = CostModel.load(cost_model) if isinstance(cost_model, str) else cost_model
        self.exchange_timeout_s = exchange_timeout_s
        self.sigterm_every_micro_batch = sigterm_every_micro_batch
        self.gpu_payloads = gpu_payloads
        self.rebalancing_loader: RebalancingLoader | None = None
        self._exchange_group: dist.ProcessGroup | None = None
        self._payload_group: dist.ProcessGroup | None = None
        self._gated_loop: Any = None
        self._sigterm_connector: Any = None
        self._sigterm_pending = False
        self._logged_batches = 0

    @property
    def resolved_objective(self) -> str:
        if self.objective != "auto":
            return self.objective
        return "microstep" if self.sigterm_every_micro_batch else "step"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in STRATEGY_NAMES:
            strategy_registry.register(
                name,
                cls,
                description="DDP with overlapped cross-rank rebalancing of packs",
                override=True,
            )

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self.world_size > 1:
            # a process group of its own: the exchange never interleaves with DDP's all-reduce
            self._exchange_group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.exchange_timeout_s)
            )
            if (
                self.gpu_payloads
                and self.root_device.type == "cuda"
                and dist.get_backend() == "nccl"
            ):
                # payloads travel GPU to GPU on an NCCL group of their own, on a side stream
                self._payload_group = dist.new_group(
                    backend="nccl", timeout=timedelta(seconds=self.exchange_timeout_s)
                )

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._own_sigterm(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                "`VLMBalanceStrategy` needs a fixed `Trainer(accumulate_grad_batches=...)`: a"
                " global batch is one optimizer step, which a GradientAccumulationScheduler"
                " changes during training"
            )
        if isinstance(dataloader, RebalancingLoader):  # wrapped by the user: use its inner one
            if dataloader.micro_steps != trainer.accumulate_grad_batches:
                raise ValueError(
                    f"the training loader is a RebalancingLoader(micro_steps="
                    f"{dataloader.micro_steps}) but `Trainer(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches})`: a global batch must be one optimizer"
                    " step; make them equal (or return the plain loader)"
                )
            dataloader = dataloader.loader
        if hasattr(dataloader, "weigh_steps"):  # a PackedDataLoader
            dataloader.trainer = trainer  # it needs the trainer for overfit_batches
            dataloader.weigh_steps = False  # the RebalancingLoader weighs the steps (no 2nd sum)
        if self.rebalancing_loader is not None:  # a reload: stop the old loader's pass
            self.rebalancing_loader.close()
        self._logged_batches = 0
        self.rebalancing_loader = RebalancingLoader(
            dataloader,  # type: ignore[arg-type]
            micro_steps=trainer.accumulate_grad_batches,
            world_size=self.world_size,
            rank=self.global_rank,
            group=self._exchange_group,
            cost_model=self.cost_model,
            objective=self.resolved_objective,
            tolerance=self.tolerance,
            mode=self.mode,
            exchange_timeout_s=self.exchange_timeout_s,
            payload_group=self._payload_group,
            device=self.root_device if self._payload_group is not None else None,
            epoch_batches=lambda: trainer.num_training_batches,
        )
        return self.rebalancing_loader

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._log_balance_stats()
        return out

    def _log_balance_stats(self) -> None:
        loader = self.rebalancing_loader
        if loader is None or loader.global_batches <= self._logged_batches or not loader.stats:
            return
        stats = loader.stats[-1]
        self._logged_batches = loader.global_batches
        module = self.lightning_module
        values = {
            "balance/moved_packs": stats.get("moved_packs", 0.0),
            "balance/planned_waste_frac": stats.get("planned_waste_frac", 0.0),
            "balance/exchange_ms": stats.get("exchange_ms", 0.0),
            "balance/exposed_exchange_ms": stats.get("exposed_exchange_ms", 0.0),
        }
        for key, value in values.items():
            module.log(key, float(value), rank_zero_only=True, batch_size=1)

    # -- preemption (SIGTERM) -----------------------------------------------------------------
    # Lightning's own SIGTERM handler runs a broadcast on the world group inside the signal
    # handler, wherever the main thread was interrupted, and raises on each rank as soon as that
    # rank saw the signal: collectives are left unpaired and ranks hang. Here the handler only
    # sets a flag; the ranks agree on it with one all-reduce at the point where Lightning would
    # broadcast its flag (the first micro-batch of each optimizer step), and all raise Lightning's
    # SIGTERMException there together, after the exchange pass has been stopped and joined.

    def _own_sigterm(self, trainer: Any) -> None:
        connector = trainer._signal_connector
        # an instance attribute shadows the bound method: Lightning's register_signal_handlers,
        # which runs after strategy.setup, composes ours (with any user and SLURM handlers)
        connector._sigterm_notifier_fn = self._on_sigterm
        self._sigterm_connector = connector
        self._sigterm_pending = False
        loop = trainer.fit_loop.epoch_loop
        accumulate = trainer.accumulate_grad_batches
        every_micro_batch = self.sigterm_every_micro_batch

        def agree_on_sigterm() -> None:
            # the micro-batch about to run has index batch_progress.current.ready
            if not every_micro_batch and loop.batch_progress.current.ready % accumulate:
                return
            flag = torch.tensor([int(self._sigterm_pending)], device=self.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank, same point: paired
            if int(flag.item()):
                connector.received_sigterm = True
                if self.rebalancing_loader is not None:
                    self.rebalancing_loader.close()  # the pass in progress ends on every rank
                raise SIGTERMException()

        agree_on_sigterm.__vlmbalance__ = True  # type: ignore[attr-defined]
        loop._broadcast_sigterm_tensor = agree_on_sigterm
        self._gated_loop = loop

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler: no collective and no exception here, only a flag."""
        log.info("rank %d received SIGTERM (%s)", self.global_rank, signum)
        if self.world_size <= 1:  # alone: Lightning's own flag (it raises after the batch)
            self._sigterm_connector.received_sigterm = True
        else:  # agreed on by every rank at the next optimizer-step boundary
            self._sigterm_pending = True

    @override
    def teardown(self) -> None:
        connector, self._sigterm_connector = self._sigterm_connector, None
        if connector is not None:
            connector.__dict__.pop("_sigterm_notifier_fn", None)
        loop, self._gated_loop = self._gated_loop, None
        if loop is not None and getattr(
            loop.__dict__.get("_broadcast_sigterm_tensor"), "__vlmbalance__", False
        ):
            del loop._broadcast_sigterm_tensor
        if self.rebalancing_loader is not None:
            # Lightning tears the strategy down before the loop closes the loader's iterator:
            # stop the pass (and its collectives) before the exchange group goes away
            self.rebalancing_loader.close()
        self.rebalancing_loader = None
        for group in (self._payload_group, self._exchange_group):
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError) as err:  # pragma: no cover - best effort
                    log.debug("could not destroy an exchange group: %s", err)
        self._exchange_group = self._payload_group = None
        super().teardown()


def register() -> None:
    """Registers ``"vlmbalance"`` and ``"ddp_vlmbalance"`` (done when the package is imported)."""
    VLMBalanceStrategy.register_strategies(StrategyRegistry)


register()
