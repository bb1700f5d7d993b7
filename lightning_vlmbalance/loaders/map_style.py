"""``PackingSampler`` and ``PackedDataLoader``: distributed, deterministic, resumable packing.

The sampler holds the dataset's length table and computes the epoch plan
(:func:`~lightning_vlmbalance.packing.plan.build_epoch_plan`) that is identical on every rank. The
loader is what a Lightning ``*_dataloader`` hook returns: it runs a torch ``DataLoader`` (workers,
pinned memory) over the packs of this rank and is *stateful* for Lightning, so a mid-epoch
checkpoint resumes with exactly the remaining packs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from lightning_vlmbalance import _lightning as seam
from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.epoch_choice import EpochChoice, EpochRuntime, choose_epoch
from lightning_vlmbalance.balance.source import SourceBalance, build_balanced_epoch_plan
from lightning_vlmbalance.loaders._dataloader_settings import (
    DataLoaderSettings,
    check_dataloader_kwargs,
)
from lightning_vlmbalance.loaders.global_batch import GlobalBatchFormer, handed_packs
from lightning_vlmbalance.loaders.map_source import MapPackSource, PassSources
from lightning_vlmbalance.packing.collate import PackCollator
from lightning_vlmbalance.packing.plan import (
    EpochPlan,
    PackingConfig,
    as_length_column,
    build_epoch_plan,
    check_image_counts,
    check_length_table,
)
from lightning_vlmbalance.parallel import collective_device, data_parallel_world, step_spec

__all__ = ["PackedDataLoader", "PackingSampler"]

log = logging.getLogger(__name__)

_NO_TRAINER: Any = object()  # PackedDataLoader(trainer=...) not given
# epochs a loader plans ahead, before its first pass, for Lightning's step estimate
ESTIMATE_EPOCHS = 16
# the plan an evaluation pass reads: epoch 0's as first made, kept (PackingSampler.plan)
EVALUATION = -1


def _as_source_balance(
    balance: bool | SourceBalance | CostModel | str | Path | None,
) -> SourceBalance | None:
    """The source balance ``PackingSampler(balance=...)`` asks for (``None``: none)."""
    if balance is None or balance is False:
        return None
    if balance is True:
        return SourceBalance()
    return balance if isinstance(balance, SourceBalance) else SourceBalance(cost_model=balance)


def _column(
    values: Sequence[int] | np.ndarray | None, name: str, default: np.ndarray
) -> np.ndarray:
    """The length-table column ``name`` given as ``values`` (checked), else ``default``."""
    return default if values is None else as_length_column(values, name)


def _sha1(*columns: np.ndarray) -> str:
    """The SHA-1 of a length table's columns, in order (a fingerprint of the table)."""
    digest = hashlib.sha1()
    for column in columns:
        digest.update(column.tobytes())
    return digest.hexdigest()


class _DataParallelRank:
    """A sampler's data-parallel world size and rank: values given at construction are kept;
    defaulted ones follow the strategy's data-parallel group once told
    (:meth:`PackingSampler.set_data_parallel`), else the process group, even one initialised after
    the sampler was built (say in a DataModule's ``__init__``)."""

    def __init__(self, num_replicas: int | None, rank: int | None) -> None:
        self.auto_replicas, self.auto_rank = num_replicas is None, rank is None
        self.group: tuple[int, int] | None = None  # the strategy's data-parallel group
        world = data_parallel_world()
        self.num_replicas = world.size if num_replicas is None else num_replicas
        self.rank = world.rank if rank is None else rank
        self.check()

    def check(self) -> None:
        """Raises ``ValueError`` for a rank outside ``[0, num_replicas)``."""
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"`PackingSampler(rank={self.rank}, num_replicas={self.num_replicas})`:"
                " rank must be in [0, num_replicas)"
            )

    def follow(self) -> bool:
        """Re-reads the defaulted values from the group (unless no process group is initialised)
        and returns whether they changed; the caller checks them (:meth:`check`)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return False
        if self.group is not None:  # the strategy's data-parallel group
            auto_world, auto_rank = self.group
        else:
            world = data_parallel_world()
            auto_world, auto_rank = world.size, world.rank
        world = auto_world if self.auto_replicas else self.num_replicas
        rank = auto_rank if self.auto_rank else self.rank
        if (world, rank) == (self.num_replicas, self.rank):
            return False
        log.info(
            "PackingSampler: rank %d of %d now that the process group exists (was %d of %d)",
            rank,
            world,
            self.rank,
            self.num_replicas,
        )
        self.num_replicas, self.rank = world, rank
        return True

    def set_group(self, num_replicas: int, rank: int) -> None:
        """Follows the strategy's data-parallel group (:meth:`PackingSampler.set_data_parallel`).

        Raises:
            ValueError: if a value given at construction is not the group's.
        """
        num_replicas, rank = int(num_replicas), int(rank)
        given = {
            name: value
            for name, value, auto, want in (
                ("num_replicas", self.num_replicas, self.auto_replicas, num_replicas),
                ("rank", self.rank, self.auto_rank, rank),
            )
            if not auto and value != want
        }
        if given:
            args = ", ".join(f"{k}={v}" for k, v in given.items())
            raise ValueError(
                f"`PackingSampler({args})` does not match the strategy's data-parallel group:"
                f" {num_replicas} data-parallel ranks, this one rank {rank} of them (under tensor"
                " parallelism the ranks of one tensor-parallel group must train the same packs)."
                " Leave `num_replicas` and `rank` to default, or give these"
            )
        self.group = (num_replicas, rank)


class _EpochModels:
    """The cost models a source-balanced sampler plans its epochs with: the current epoch's by
    first global batch, and the one later epochs use (online calibration adopts new ones)."""

    def __init__(self, balance: SourceBalance | None) -> None:
        # later epochs' model (None: an unbalanced sampler)
        self.latest = None if balance is None else balance.model
        # (epoch, [(first global batch, model), ...]): the models of one epoch, where they are
        # not just the latest
        self.pinned: tuple[int, list[tuple[int, CostModel]]] | None = None

    def schedule(self, epoch: int) -> list[tuple[int, CostModel]]:
        """``[(first global batch, model), ...]`` that ``epoch`` is planned with."""
        if self.pinned is not None and self.pinned[0] == epoch:
            return list(self.pinned[1])
        assert self.latest is not None
        return [(0, self.latest)]

    def use(self, model: CostModel) -> None:
        """Plans every epoch with ``model`` from its start."""
        self.latest, self.pinned = model, None

    def adopt(
        self, sampler: PackingSampler, model: CostModel, epoch: int, from_batch: int | None
    ) -> bool:
        """:meth:`PackingSampler.adopt_cost_model`: ``model`` is the one of later epochs, and
        ``sampler``'s plan of ``epoch`` is made again with it from global batch ``from_batch`` on
        unless that takes more packs. The plans in ``sampler``'s cache that were made with other
        models are dropped (and the old plan put back where the new one takes more packs)."""
        schedule = self.schedule(epoch)
        # this epoch keeps its models (unless re-planned below): its packs are counted with
        # them, also where its plan is not cached (counted with the new model, a longer re-plan
        # was compared with itself)
        self.pinned = (epoch, schedule)
        self.latest = model
        sampler._plans.pop(epoch + 1, None)
        if from_batch is None:
            return False
        from_batch = max(0, int(from_batch))
        kept = [(b, m) for b, m in schedule if b < from_batch]
        changed = kept if kept and kept[-1][1] == model else [*kept, (from_batch, model)]
        if changed == schedule:
            return False
        packs = sampler.packs_per_rank(epoch)
        planned = sampler._plans.pop(epoch, None)
        self.pinned = (epoch, changed)
        grown = sampler.packs_per_rank(epoch)
        if grown <= packs:
            return True
        # the rest of the epoch would take more packs than planned: Lightning's training loop
        # follows, but a schedule sized from `trainer.estimated_stepping_batches` (OneCycleLR)
        # would be stepped past its end. This epoch keeps its plan; later epochs are planned
        # with the model
        self.pinned = (epoch, schedule)
        sampler._plans.pop(epoch, None)
        if planned is not None:
            sampler._plans[epoch] = planned
        log.info(
            "PackingSampler: the re-plan of epoch %d with the new cost model takes more"
            " packs (%d > %d): the epoch keeps its plan, later epochs use the model",
            epoch,
            grown,
            packs,
        )
        return False

    def state(self, epoch: int) -> list[list[Any]]:
        """``epoch``'s models, JSON-ready."""
        return [[b, m.to_dict()] for b, m in self.schedule(epoch)]

    def load_state(self, epoch: int, state: list[list[Any]]) -> None:
        """Restores :meth:`state` for ``epoch`` (later epochs: its last model)."""
        schedule = [(int(b), CostModel.from_dict(m)) for b, m in state]
        self.pinned = (int(epoch), schedule)
        self.latest = schedule[-1][1]


class _PlanAhead:
    """The next epoch's plan, made in a background thread while this one trains (a balanced
    sampler's former runs as machine code without the GIL)."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def start(self, settings: tuple, build: Callable[[tuple], EpochPlan]) -> None:
        """Plans ``settings`` with ``build`` in the background, in place of any plan not taken."""
        ahead: dict[str, Any] = {"settings": settings}

        def run() -> None:
            try:
                ahead["plan"] = build(settings)
            except BaseException as err:  # raised where the plan is taken
                ahead["error"] = err

        thread = threading.Thread(target=run, name="vlmbalance-plan-ahead", daemon=True)
        ahead["thread"] = thread
        self._pending = ahead
        thread.start()

    def take(self, settings: tuple) -> EpochPlan | None:
        """The plan made in the background, if it was made for ``settings`` (else ``None``: plan
        again); raises what planning raised."""
        ahead, self._pending = self._pending, None
        if ahead is None or ahead["settings"] != settings:
            return None
        ahead["thread"].join()
        if "error" in ahead:
            raise ahead["error"]
        return ahead["plan"]

    def __getstate__(self) -> dict[str, Any]:
        # a thread does not pickle; the copy plans again if it needs to
        return {"_pending": None}


class PackingSampler(SequentialSampler):  # type: ignore[type-arg]
    # A SequentialSampler to Lightning: it yields its plan in a fixed order (any shuffling is the
    # plan's own, seeded per epoch), so ``Trainer(overfit_batches=...)`` keeps it instead of
    # trying to rebuild the loader; the loader then pins the epoch (see PackedDataLoader).
    """Yields this rank's packs (lists of sample indices) of the current epoch.

    Every rank computes the same plan from the length table, so every rank yields the same number
    of packs per epoch without any collective. Rank ``r`` reads the contiguous shard ``r`` of the
    samples (plus the few packs handed over to even out pack counts). A padding pack (see
    ``remainder``) is yielded as an empty list.

    Args:
        total_tokens: tokens of each sample (the length table), images included.
        image_tokens: image tokens of each sample (zeros if ``None``).
        config: how samples become packs (:class:`~lightning_vlmbalance.PackingConfig`), or
        **options: its fields as keyword arguments (``seq_len=8192, seed=0, shuffle=True,
            window, min_fill, overlong, remainder, packer, image_budget``).
        num_replicas: data-parallel ranks (default: the initialised process group's world size).
        rank: this rank (default: the process group's rank).
        balance: balance at the source (:mod:`lightning_vlmbalance.balance.source`): a
            :class:`~lightning_vlmbalance.SourceBalance` (every setting: cost model,
            micro-steps, objective, ``exact``, ``plan_ahead``, the former's knobs), or ``True``
            (``SourceBalance()``), or a ``CostModel`` or a path to one saved as JSON (with the
            other settings' defaults). Every global batch (``num_replicas x micro_steps``
            packs) is formed from the shuffled samples so its packs cost the same, and placed
            on ranks and micro-steps for the objective: ranks read their packs' samples at
            random instead of a contiguous shard; nothing moves at run time. Left to default,
            ``micro_steps`` and ``objective="auto"`` follow the Trainer when the loader knows
            it (its :class:`~lightning_vlmbalance.parallel.StepSpec`; ``"step"`` under
            ``"vlmbalance"``,
            ``"microstep"`` under ``"fsdp_vlmbalance"`` and under any other strategy with more
            than one rank), else 1 and ``"step"``.
        images: images of each sample (default: one per sample with image tokens); a cost
            feature.

    Raises:
        ValueError: for a bad length table or setting, naming the sample or the setting.

    Example::

        sampler = PackingSampler(table.total_tokens, table.image_tokens, seq_len=8192)
        sampler.set_epoch(epoch)
        for sample_ids in sampler: ...
    """

    def __init__(
        self,
        total_tokens: Sequence[int] | np.ndarray,
        image_tokens: Sequence[int] | np.ndarray | None = None,
        *,
        config: PackingConfig | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        balance: bool | SourceBalance | CostModel | str | Path | None = None,
        images: Sequence[int] | np.ndarray | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ValueError(
                f"`PackingSampler(config=..., {', '.join(options)}=...)`: give the options"
                " either in the config or as arguments"
            )
        self.total_tokens = as_length_column(total_tokens, "total_tokens")
        self.image_tokens = _column(image_tokens, "image_tokens", np.zeros_like(self.total_tokens))
        self.config = config if config is not None else PackingConfig(**options)
        self.source_balance = _as_source_balance(balance)
        if self.source_balance is not None and self.config.max_image_tokens_per_pack is not None:
            raise ValueError(
                "`PackingSampler(max_image_tokens_per_pack=..., balance=...)`: the source"
                " balance forms its own packs and does not keep a vision-token budget yet; use"
                " one or the other"
            )
        # what the trainer decides where the settings leave it (set_micro_steps)
        self._trainer_micro_steps, self._trainer_objective = 1, "auto"
        # how the strategy's loader trains an epoch (decide_epochs), and each epoch's decision
        self._runtime: EpochRuntime | None = None
        self._epoch_choices: dict[tuple, EpochChoice] = {}
        self._evaluation: tuple[tuple, EpochPlan] | None = None  # _evaluation_plan
        # (epoch, last epoch, optimizer steps left from it): set_fit_end
        self._fit_end: tuple[int, int | None, int | None] | None = None
        self.images = _column(images, "images", (self.image_tokens > 0).astype(np.int64))
        check_length_table(self.total_tokens, self.image_tokens)
        check_image_counts(self.images, self.image_tokens)
        self._world = _DataParallelRank(num_replicas, rank)
        self.epoch = 0
        self._plans: dict[int, EpochPlan] = {}  # the last two epochs' plans
        # online calibration of a balanced sampler (adopt_cost_model)
        self._models = _EpochModels(self.source_balance)
        self._ahead = _PlanAhead()
        self.planned_ahead = 0  # plans taken from the background
        # images: a cost feature of the balanced plan
        self._table_hash = _sha1(self.total_tokens, self.image_tokens, self.images)
        self.plan()  # validate the table and the settings now, not in the first step

    @property
    def num_replicas(self) -> int:
        """Data-parallel ranks the plan is made for (see :meth:`set_data_parallel`)."""
        return self._world.num_replicas

    @property
    def rank(self) -> int:
        """This rank among them."""
        return self._world.rank

    def _sync_with_process_group(self) -> None:
        """Re-reads defaulted rank/world size: a sampler built before the process group existed
        (say in a DataModule's ``__init__``) must not plan as if it were alone."""
        if self._world.follow():
            self._plans = {}
            self._world.check()

    def set_data_parallel(self, num_replicas: int, rank: int) -> None:
        """The data-parallel group's size and this rank in it, where the sampler's were left to
        default: under tensor parallelism (a strategy's ``distributed_sampler_kwargs``) the ranks
        of one tensor-parallel group compute the same packs, so the data-parallel world is
        smaller than the process group. Values given at construction must be these.

        Raises:
            ValueError: if the sampler was built with another ``num_replicas`` or ``rank`` (say
                the world size and global rank under tensor parallelism: the ranks of a
                tensor-parallel group would then train different packs).
        """
        self._world.set_group(num_replicas, rank)
        self._sync_with_process_group()

    @property
    def balanced(self) -> bool:
        """Whether the sampler balances its global batches at the source (``balance=``)."""
        return self.source_balance is not None

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model the source balance plans with now (``None`` unbalanced): the given
        one, or the last adopted (:meth:`adopt_cost_model`)."""
        return self._models.latest

    def use_cost_model(self, model: CostModel) -> None:
        """Plans every epoch with ``model`` from its start, as if the sampler had been built with
        it: for a sampler that has trained nothing yet (a loader reloaded by
        ``reload_dataloaders_every_n_epochs`` after online calibration adopted ``model``; it
        planned with its starting model before).

        Raises:
            ValueError: for an unbalanced sampler.
        """
        if self.source_balance is None:
            raise ValueError("`PackingSampler.use_cost_model`: the sampler is not balanced")
        self._models.use(model)
        self._plans = {}

    def cost_schedule(self, epoch: int | None = None) -> list[tuple[int, CostModel]]:
        """The cost models ``epoch`` (default: the current one) is planned with: ``[(first
        global batch, model), ...]``."""
        return self._models.schedule(self.epoch if epoch is None else int(epoch))

    def adopt_cost_model(
        self, model: CostModel, *, epoch: int | None = None, from_batch: int | None = None
    ) -> bool:
        """Plans with ``model`` from global batch ``from_batch`` of ``epoch`` on (online
        calibration): the rest of that epoch is formed again from the samples the batches
        before it left, in stream order, and later epochs are planned with ``model``.
        ``from_batch=None``: from the next epoch on. Every rank must adopt the same model at the
        same batch (the plan is every rank's). Returns whether the plan of ``epoch`` changed
        (``False`` as well for the model already in use there, say the one a resumed loader's
        state restored).

        Raises:
            ValueError: for an unbalanced sampler.
        """
        if self.source_balance is None:
            raise ValueError("`PackingSampler.adopt_cost_model`: the sampler is not balanced")
        epoch = self.epoch if epoch is None else int(epoch)
        return self._models.adopt(self, model, epoch, from_batch)

    def schedule_state(self) -> list[list[Any]]:
        """The current epoch's cost models, JSON-ready (a loader's checkpoint state)."""
        return self._models.state(self.epoch)

    def load_schedule_state(self, epoch: int, state: list[list[Any]]) -> None:
        """Restores :meth:`schedule_state` for ``epoch`` (later epochs: its last model)."""
        self._models.load_state(epoch, state)
        self._plans = {}

    @property
    def micro_steps(self) -> int:
        """Packs per rank per global batch the balanced plan is formed for."""
        given = None if self.source_balance is None else self.source_balance.micro_steps
        return self._trainer_micro_steps if given is None else given

    @property
    def objective(self) -> str:
        """The objective the balanced plan is placed for (``"auto"``: not decided yet)."""
        given = "auto" if self.source_balance is None else self.source_balance.objective
        return self._trainer_objective if given == "auto" else given

    def set_micro_steps(self, micro_steps: int, objective: str | None = None) -> None:
        """The fit's micro-steps per optimizer step (and objective: its
        :class:`~lightning_vlmbalance.parallel.StepSpec`), where the settings left them to it;
        the loader calls this when it knows the trainer."""
        before = (self.micro_steps, self.objective)
        self._trainer_micro_steps = int(micro_steps)
        if objective is not None:
            self._trainer_objective = objective
        if (self.micro_steps, self.objective) != before:
            self._plans = {}

    def decide_epochs(self, runtime: EpochRuntime | None) -> None:
        """How the strategy's loader will train each epoch (a strategy in ``mode="auto"``
        tells a balanced sampler): with ``SourceBalance(when="auto")`` each epoch is then
        formed at the source only where that is predicted faster, and where the loader may
        route images also priced formed by the language model's cost alone
        (:mod:`~lightning_vlmbalance.balance.epoch_choice`). ``None``: every epoch formed."""
        if runtime != self._runtime:
            self._runtime = runtime
            self._plans = {}

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose plan is yielded (Lightning calls this every epoch)."""
        self.epoch = epoch

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The packing plan of ``epoch`` (default: the current one), cached for the last two
        epochs asked for (a loader asks for the epoch Lightning runs next before it is set).

        A balanced sampler plans the next epoch in a background thread as soon as it has one
        (the former runs as machine code without the GIL), so a new epoch finds its plan ready
        instead of computing it on the step's path."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch == EVALUATION:
            return self._evaluation_plan()
        plan = self._plans.get(epoch)
        if plan is None:
            settings = self._settings(epoch)
            plan = self._ahead.take(settings)
            if plan is None:  # none planned ahead, or for other settings: plan again
                plan = self._build(settings)
            else:
                self.planned_ahead += 1
            kept = {e: p for e, p in self._plans.items() if e == self.epoch and e != epoch}
            self._plans = {**kept, epoch: plan}
            balance = self.source_balance
            if balance is not None and balance.plan_ahead and self._trains_after(epoch, plan):
                self._ahead.start(self._settings(epoch + 1), self._build)
        return plan

    def _evaluation_plan(self) -> EpochPlan:
        """``plan(EVALUATION)``: epoch 0's plan as it was first made for these ranks and
        micro-steps, kept: refits adopted later (which re-plan epoch 0 for a balanced
        sampler, and may decide it otherwise) do not change what an evaluation pass reads."""
        self._sync_with_process_group()
        key = (self.num_replicas, self.micro_steps, self.objective, self._runtime)
        if self._evaluation is None or self._evaluation[0] != key:
            plan = self._plans.get(0) or self._build(self._settings(0))
            self._evaluation = (key, plan)
        return self._evaluation[1]

    def set_fit_end(self, epoch: int, *, last_epoch: int | None, steps_left: int | None) -> None:
        """Where the fit ends, as its trainer says at ``epoch`` (the loader tells the sampler):
        the last epoch it trains (``None``: no limit), and the optimizer steps it has left
        from there (``None``: no limit). An epoch after the fit's end is not planned ahead
        (with ``mode="auto"`` its decision prices three plans, in the background while the
        step trains: 5% of a short CPU fit's time, for an epoch never trained)."""
        self._fit_end = (int(epoch), last_epoch, steps_left)

    def _trains_after(self, epoch: int, plan: EpochPlan) -> bool:
        """Whether the fit may train the epoch after ``epoch`` (whose plan is ``plan``)."""
        if self._fit_end is None:
            return True
        told, last_epoch, steps_left = self._fit_end
        if last_epoch is not None and epoch + 1 > last_epoch:
            return False
        if steps_left is None or epoch != told:
            return True
        return steps_left > -(-plan.packs_per_rank // max(1, self.micro_steps))

    def _settings(self, epoch: int) -> tuple:
        # the epoch's cost models (CostModel compares by value): an ahead plan of other models
        # is planned again
        models = () if self.source_balance is None else tuple(self.cost_schedule(epoch))
        return (epoch, self.num_replicas, self.micro_steps, self.objective, models, self._runtime)

    def _build(self, settings: tuple) -> EpochPlan:
        epoch, world, micro_steps, objective, models, runtime = settings
        if self.source_balance is None:
            return self._plain(epoch, world)
        # no trainer told how the ranks meet: once per step
        balance = self.source_balance.resolved(micro_steps=micro_steps, objective=objective)
        if runtime is None or balance.when == "always":
            return self._formed(epoch, world, balance, list(models))
        # the epoch's decision, made once with the model it starts with (a refit adopted
        # during the epoch re-plans the rest of a formed epoch, never the decision)
        first = json.dumps(models[0][1].to_dict(), sort_keys=True)  # (a model is unhashable)
        key = (epoch, world, micro_steps, objective, first, runtime)
        choice = self._epoch_choices.get(key)
        if choice is None:
            plans = {"plain": self._plain(epoch, world)}
            for name, llm_only in self._formed_bases(runtime):
                basis = dataclasses.replace(balance, llm_only=llm_only)
                plans[name] = self._formed(epoch, world, basis, list(models[:1]))
            choice = choose_epoch(
                plans,
                micro_steps=micro_steps,
                total_tokens=self.total_tokens,
                image_tokens=self.image_tokens,
                images=self.images,
                cost_model=models[0][1],
                runtime=runtime,
            )
            # a new dict (the plan-ahead thread reads it), the epochs that may still be asked
            kept = {k: c for k, c in self._epoch_choices.items() if k[0] >= epoch - 1}
            self._epoch_choices = {**kept, key: choice}
            if len(models) == 1:  # the plan just priced is the epoch's
                return dataclasses.replace(plans[choice.taken], epoch_choice=choice.to_dict())
        if choice.taken == "plain":
            plan = self._plain(epoch, world)
        else:
            basis = dataclasses.replace(balance, llm_only=choice.taken == "formed_llm")
            plan = self._formed(epoch, world, basis, list(models))
        return dataclasses.replace(plan, epoch_choice=choice.to_dict())

    def _formed_bases(self, runtime: EpochRuntime) -> list[tuple[str, bool]]:
        """The formed plans priced: by every phase's cost, and where the loader may route
        images also by the language model's (``llm_only=None``); or the one given."""
        assert self.source_balance is not None
        given = self.source_balance.llm_only
        if given is not None:
            return [("formed_llm" if given else "formed", given)]
        return [("formed", False), *([("formed_llm", True)] if runtime.routes_images else [])]

    def _plain(self, epoch: int, world: int) -> EpochPlan:
        return build_epoch_plan(
            self.total_tokens, self.image_tokens, self.config, num_replicas=world, epoch=epoch
        )

    def _formed(self, epoch: int, world: int, balance: SourceBalance, schedule: list) -> EpochPlan:
        return build_balanced_epoch_plan(
            self.total_tokens,
            self.image_tokens,
            self.images,
            self.config,
            num_replicas=world,
            epoch=epoch,
            balance=balance,
            schedule=schedule,
        )

    def pack_refs(self, start: int = 0, epoch: int | None = None) -> list[tuple[int, np.ndarray]]:
        """``(pack_id, sample_ids)`` of this rank's packs of ``epoch`` (default: the current
        one) from position ``start`` on."""
        self._sync_with_process_group()
        plan = self.plan(epoch)
        return list(zip(plan.rank_pack_ids[self.rank][start:], plan.rank_packs[self.rank][start:]))

    def __iter__(self) -> Iterator[list[int]]:
        for _, ids in self.pack_refs():
            yield ids.tolist()

    def __len__(self) -> int:
        return self.packs_per_rank()

    def packs_per_rank(self, epoch: int | None = None) -> int:
        """This rank's packs in ``epoch`` (default: the current one); epochs differ, since each
        shuffle packs differently."""
        self._sync_with_process_group()
        return self.plan(epoch).packs_per_rank

    def packs_per_rank_planned(self, epoch: int) -> int:
        """:meth:`packs_per_rank` of a future ``epoch`` with the cost model in use, planned
        aside (the cache of the current and next epochs' plans is left as it is)."""
        self._sync_with_process_group()
        plan = self._plans.get(int(epoch))
        if plan is None:
            plan = self._build(self._settings(int(epoch)))
        return plan.packs_per_rank

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same packs after a resume."""
        self._sync_with_process_group()
        return {
            "num_samples": len(self.total_tokens),
            "num_replicas": self.num_replicas,
            "length_table_sha1": self._table_hash,
            # plans of earlier versions trained a rank's packs in packing order
            "pack_order": "seeded" if self.config.shuffle else "packing",
            **{k: getattr(self.config, k) for k in self.config.__slots__},
            "balance": None
            if self.source_balance is None
            else {
                **self.source_balance.to_dict(),
                "micro_steps": self.micro_steps,
                "objective": self.objective,
                # what the epochs' decisions and an llm_only=None are made with
                "runtime": None if self._runtime is None else self._runtime.to_dict(),
            },
        }


class _OfSources:
    """A :class:`PackedDataLoader` setting of its pack sources: read from its own, set on every
    one (each makes its inner ``DataLoader`` again for its next pass)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loader: Any, owner: type | None = None) -> Any:
        return self if loader is None else getattr(loader.pack_source, self.name)

    def __set__(self, loader: Any, value: Any) -> None:
        loader._passes.set(self.name, value)


class PackedDataLoader(DataLoaderSettings):
    """A Lightning-ready, resumable loader of packed batches (one pack per batch).

    It is not a ``torch.utils.data.DataLoader`` subclass on purpose: Lightning leaves it alone (no
    ``DistributedSampler`` injection, so it works with the default
    ``Trainer(use_distributed_sampler=True)``), calls ``set_epoch`` on its ``sampler`` every epoch,
    and saves/restores its ``state_dict`` in checkpoints, which resumes mid-epoch with exactly the
    remaining packs.

    It is the Lightning front of a :class:`~lightning_vlmbalance.loaders.map_source.
    MapPackSource` (``pack_source``: the packs, the positions, the states), which holds no
    trainer. The training loader reused for validation (Lightning validates mid-epoch, inside the
    training pass): an evaluation pass begun while a training pass reads gets a second source
    over the same dataset and sampler, with its own inner ``DataLoader`` (and persistent
    workers) and positions, so the training pass goes on with its own. This needs the loader's
    ``trainer`` (without one a validation pass cannot be told from a training one).

    Args:
        dataset: map-style dataset of samples (see :mod:`~lightning_vlmbalance.packing.collate`).
        sampler: the :class:`PackingSampler` over the dataset's length table.
        collate_fn: defaults to ``PackCollator(sampler.config.seq_len)``.
        trainer: the Lightning ``Trainer`` this loader trains under (``self.trainer`` in a
            ``train_dataloader`` hook). While it trains, the loader groups its packs into the
            Trainer's optimizer steps (its micro-steps per step, and the epoch's training
            batches after ``limit_train_batches`` / ``fast_dev_run``), counts each step's loss
            tokens over the ranks (one small all-gather per step) and sets ``loss_weight`` and
            ``global_loss_tokens`` (:mod:`lightning_vlmbalance.loss`). Needed with any strategy
            but ``"vlmbalance"`` (which does this itself) once there is more than one rank or
            micro-step; :func:`~lightning_vlmbalance.packed_cross_entropy` says so if forgotten.
            With ``Trainer(overfit_batches=N)`` it also trains the same packs every epoch (the
            first ``N`` of epoch 0's plan on each rank).
        micro_steps: in a loop of your own (a Lightning Fabric loop, no Trainer): the packs
            each rank trains per optimizer step. The loader then weighs every step as under a
            Trainer (one small all-gather per step over the initialised process group: every
            rank iterates the loader together): ``fabric.backward(loss / micro_steps)`` of each
            micro-batch's ``packed_cross_entropy(...).loss`` (divided as Lightning's loop
            divides; DDP averages over the ranks) gives the gradient of the whole global
            batch's token-mean loss (``docs/loss.md``). ``len(loader)`` is this rank's packs
            in the epoch (read it after ``set_epoch``; after ``load_state_dict`` the pass
            yields ``len(loader) - loader.start``); an epoch's last step has fewer packs when
            they do not divide by ``micro_steps``, and is weighed as such.
        **dataloader_kwargs: passed to the inner ``DataLoader`` (``num_workers``,
            ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ...).

    Raises:
        ValueError: if the dataset and the sampler's length table disagree in size.
    """

    # Lightning inspects ``sampler`` / ``batch_sampler`` like a DataLoader's (set_epoch, the
    # shuffle check of validation loaders): packs come from ``sampler``, there is no batch sampler
    batch_sampler = None
    # the pack source's (read there; set on every source: the next pass uses it)
    dataset = _OfSources()
    sampler = _OfSources()
    collate_fn = _OfSources()

    def __init__(
        self,
        dataset: Dataset,
        sampler: PackingSampler,
        collate_fn: PackCollator | None = None,
        *,
        trainer: Any = _NO_TRAINER,
        micro_steps: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        check_dataloader_kwargs("PackedDataLoader", dataloader_kwargs, "the PackingSampler")
        if micro_steps is not None and (trainer is not _NO_TRAINER or int(micro_steps) < 1):
            raise ValueError(
                f"`PackedDataLoader(micro_steps={micro_steps!r})` is for a loop of your own (a"
                " Fabric loop) and a positive count; under a Trainer give `trainer=` (the"
                " Trainer decides its micro-steps)"
            )
        # a loop of your own: steps of this many packs per rank, weighed over the process group
        self._own_micro_steps = None if micro_steps is None else int(micro_steps)
        if self._own_micro_steps is not None and sampler.balanced:
            # now, not at the first step: len() and a resume read the plan of these steps
            sampler.set_micro_steps(self._own_micro_steps)
        self.dataloader_kwargs = dataloader_kwargs
        self.pack_source = MapPackSource(dataset, sampler, collate_fn, dataloader_kwargs)
        self._passes = PassSources(self.pack_source)  # and a validation's (class docstring)
        # `trainer=self.trainer` where it is still None (a DataModule's __init__ runs before the
        # Trainer is attached): said in the error a weighted loss raises
        self._given_none = trainer is None
        self.trainer = None if trainer is _NO_TRAINER else trainer
        self._told_len: int | None = None  # what ``len`` first answered without a trainer
        self._len_warned = False

    def _adopt_data_parallel(self) -> None:
        """Under tensor parallelism, plan over the strategy's data-parallel group; a balanced
        sampler forms global batches of the Trainer's micro-steps."""
        if self.trainer is None:
            return
        step = step_spec(self.trainer)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.sampler.set_data_parallel(step.world.size, step.world.rank)
        if self.sampler.balanced:
            self.sampler.set_micro_steps(step.micro_steps, step.objective)
            trainer = self.trainer
            max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
            self.sampler.set_fit_end(
                seam.epoch_to_train(trainer),
                last_epoch=max_epochs - 1 if max_epochs is not None and max_epochs > 0 else None,
                steps_left=max_steps - trainer.global_step if max_steps and max_steps > 0 else None,
            )

    def __len__(self) -> int:
        self._adopt_data_parallel()
        if self._training():
            # Lightning asks before it calls ``set_epoch`` (and, on a resume, before this
            # loader's state is loaded): answer for the epoch it is about to train
            epoch = seam.epoch_to_train(self.trainer)
            packs = self.sampler.packs_per_rank(self._plan_epoch(epoch))
            if self.pack_source._iter_epoch is None:  # before the first pass: _longest_plan
                packs = max(packs, self._longest_plan(epoch))
            return packs
        if self.trainer is not None:  # validation, test, predict: epoch 0's plan, every time
            return self.sampler.packs_per_rank(EVALUATION)
        told = len(self.sampler)
        if self._told_len is None:  # the first answer is the one a Trainer keeps
            self._told_len = told
        return told

    def _longest_plan(self, first: int) -> int:
        """This rank's packs in the longest plan of epochs ``first`` to the fit's last (at most
        :data:`ESTIMATE_EPOCHS` of them). What ``len`` answers before the first pass:
        ``trainer.estimated_stepping_batches`` (what an LR schedule such as OneCycleLR is sized
        from) multiplies that first answer by ``max_epochs``, and epochs plan different pack
        counts (5 epochs: 100 steps estimated, 102 trained). Each epoch's own length is told to
        the training loop when it starts (``refresh_epoch_batches``), so only the estimate sees
        this bound: a schedule then ends at or after the last step, never before."""
        last = self.trainer.max_epochs
        if last is None or last < 0 or self._overfitting():
            return 0
        epochs = range(first + 1, min(int(last), first + ESTIMATE_EPOCHS))
        return max((self.sampler.packs_per_rank_planned(e) for e in epochs), default=0)

    def _training(self) -> bool:
        return self.trainer is not None and self.trainer.training

    def _overfitting(self) -> bool:
        return self._training() and self.trainer.overfit_batches > 0

    def _plan_epoch(self, epoch: int) -> int:
        """The plan read in ``epoch``: with ``Trainer(overfit_batches=N)`` the first ``N``
        packs of epoch 0's plan, every epoch. Outside training (a loader given its trainer for
        validation, test or predict) epoch 0's plan as first made, every time
        (:data:`EVALUATION`): Lightning reads an evaluation loader's length once, and epochs
        plan different pack counts (a later, longer plan lost its last packs: 297 of 300, then
        296 of 300 validation samples), as does epoch 0 re-planned with a refit adopted later
        (282 of 300 validated)."""
        if self.trainer is not None and not self.trainer.training:
            return EVALUATION
        return 0 if self._overfitting() else epoch

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        source = self._passes.of_pass(self.trainer is not None and not self._training())
        source.begin()
        return self._generate(source)

    def global_batches(
        self, micro_steps: int | None = None
    ) -> Iterator[tuple[list[dict[str, Any]], None, int]]:
        """The pass's optimizer steps, not weighed, for a loader that forms the global batches
        itself (a :class:`~lightning_vlmbalance.RebalancingLoader`, which the ``"vlmbalance"``
        strategies make): per step of ``micro_steps`` packs (default the Trainer's), this
        rank's packs, ``None`` (no features agreed yet) and how many of its first packs a
        resume inside the step trained before (as :class:`PackedStreamLoader`'s)."""
        self.pack_source.begin()

        def steps() -> Iterator[tuple[list[dict[str, Any]], None, int]]:
            size = micro_steps if micro_steps is not None else self._micro_steps()
            self._open(size, self.pack_source)
            for packs, features, skip in self.pack_source.global_batches(size, self._stop()):
                for k, pack in enumerate(packs):
                    self.pack_source.handed(pack, trained=k >= skip)
                yield packs, features, skip

        return steps()

    def _micro_steps(self) -> int:
        if self.trainer is not None:
            return step_spec(self.trainer).micro_steps
        return self._own_micro_steps or 1

    def _stop(self) -> Any:
        """Where the epoch's training batches end (``limit_train_batches``, a re-planned
        epoch's length): read at every step; ``None`` outside training."""
        trainer = self.trainer
        return (lambda: trainer.num_training_batches) if self._training() else None

    def _open(self, micro_steps: int, source: MapPackSource, *, own_steps: bool = False) -> int:
        """Opens ``source``'s pass of the sampler's epoch (at the first ``next()``: Lightning
        creates the iterator before it calls ``set_epoch``) and tells the training loop its
        length (``own_steps``: a training pass of a loop of your own)."""
        self._adopt_data_parallel()
        epoch = self.sampler.epoch  # Lightning's (what a checkpoint saves)
        plan_epoch = self._plan_epoch(epoch)  # epoch 0's when overfitting
        lead = source.open(plan_epoch, micro_steps, self._training() or own_steps)
        packs = self.sampler.packs_per_rank(plan_epoch)
        if self._training():
            # epochs differ in pack count; Lightning keeps the count it read before the first
            seam.refresh_epoch_batches(self.trainer)
        elif (
            not own_steps
            and self._told_len is not None
            and self._told_len < packs
            and not self._len_warned
        ):
            warnings.warn(
                f"PackedDataLoader: epoch {epoch} has {packs} packs on this rank, but `len()`"
                f" said {self._told_len} first: a Trainer that read that length ends the pass"
                " there and never trains (or validates) its last packs. Give the loader its"
                " trainer (`PackedDataLoader(..., trainer=self.trainer)`): it then tells"
                " Lightning each training epoch's length, and evaluates epoch 0's plan every"
                " time",
                stacklevel=3,
            )
            self._len_warned = True  # said once
        return lead

    def _generate(self, source: MapPackSource) -> Iterator[dict[str, Any]]:
        """The pass's packs: while training, each optimizer step formed (weighed) by a
        :class:`~lightning_vlmbalance.loaders.global_batch.GlobalBatchFormer` (one small
        all-gather of the packs' features per step, on the world group); otherwise as read."""
        own = self.trainer is None and self._own_micro_steps is not None
        weighed = self._training() or own
        if weighed:
            if own:  # a loop of your own: the process group's world, the steps it gave
                world, micro_steps = data_parallel_world(), int(self._own_micro_steps)
                device = collective_device()
            else:
                spec = step_spec(self.trainer)
                world, micro_steps = spec.world, spec.micro_steps
                device = self.trainer.strategy.root_device
            self._open(micro_steps, source, own_steps=own)
            former = GlobalBatchFormer(
                micro_steps=micro_steps,
                num_replicas=world.size,
                rank=world.rank,
                copies=world.copies,
                gradient_ranks=world.gradient_ranks,
                gather_device=device,
            )
            steps = source.global_batches(micro_steps, None if own else self._stop())
            packs = handed_packs(former, steps, source.handed)
        else:
            self._open(1, source)
            packs = source.packs()
        for batch in packs:
            if not weighed:
                source.handed(batch)
            if self._given_none and self.trainer is None and isinstance(batch.get("meta"), dict):
                batch["meta"]["loader_trainer_was_none"] = True
            yield batch

    # -- positions, calibration --------------------------------------------------------------

    def read_position(self) -> int | None:
        """How far into this rank's packs of the epoch the inner ``DataLoader`` has asked for
        packs (at least what was delivered: workers and read-ahead ask earlier); ``None``
        without a pass of the current epoch in progress."""
        return self.pack_source.read_position()

    def adopt_cost_model(self, model: CostModel, *, after: int | None) -> int | None:
        """Online calibration of a balanced sampler: re-plans the rest of the epoch with
        ``model`` from the first global batch past position ``after`` with one global batch to
        spare (``after``: the furthest :meth:`read_position` of every rank, so every rank
        switches at the same batch, none of whose packs any rank has read), tells the training
        loop the epoch's new length, and plans later epochs with ``model``. ``after=None``:
        later epochs only. Returns the first global batch planned with ``model`` (``None``:
        none of this epoch). A sampler that does not balance, or ``Trainer(overfit_batches=N)``
        (which trains epoch 0's first packs every epoch), is left as it is.

        Raises:
            RuntimeError: if this rank has read past the switch already (``after`` was not the
                furthest position of every rank).
        """
        if not self.sampler.balanced or self._overfitting():
            return None
        first = self.pack_source.replan(model, self._plan_epoch(self.sampler.epoch), after)
        if first is not None and self._training():
            seam.refresh_epoch_batches(self.trainer)  # the re-planned epoch's length
        return first

    @property
    def _iterator(self) -> Any:
        """An inner ``DataLoader``'s persistent iterator (``persistent_workers=True``): Lightning
        shuts its workers down at the end of ``fit`` (and of a validation run) through it, as it
        does for a ``DataLoader``, once per loop that iterated the loader."""
        made = self._passes.iterated()
        return None if made is None else made._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        made = self._passes.iterated()
        if made is not None:
            made._iterator = value

    def _made_loaders(self) -> list[DataLoader]:
        return self._passes.made_loaders()

    def _remake(self) -> None:
        self._passes.remake()

    @property
    def start(self) -> int:
        """Position in this rank's packs where the current pass resumed (0: from the start)."""
        return self.pack_source.start

    @property
    def consumed(self) -> int:
        """Packs of the current epoch handed to the consumer.

        Lightning's training loop does not fetch ahead of a loader whose length it knows (this
        one), so when it saves a checkpoint every delivered pack has been trained on.
        """
        return self.pack_source.consumed

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        consumed = self.pack_source.consumed
        if self.trainer is not None and self.pack_source.in_progress():
            # where Lightning resumes a checkpoint saved now: a batch delivered to a step that
            # failed (a checkpoint on the exception) is run again
            consumed = seam.resume_position(self.trainer)
        return self.pack_source.state(consumed)

    def state_at(self, position: int) -> dict[str, Any]:
        """The state that resumes at ``position`` of the pass in progress: what a wrapper that
        reads ahead (:class:`~lightning_vlmbalance.RebalancingLoader`) saves, the packs it has
        handed on rather than those it has read (inside an optimizer step too). Without a pass
        of the current epoch in progress, where the epoch stands."""
        return self.pack_source.state_at(position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pack_source.restore(state_dict, self._plan_epoch)
