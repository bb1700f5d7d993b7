"""The step: which data-parallel world a rank is in, how many micro-steps make one optimizer
step, how often the ranks meet, and so what a balanced plan optimises. :class:`StepSpec` is the
one owner of these answers; the sampler, the loaders, the loss contract, preemption and the
rebalancer ask :func:`step_spec` (nothing else reads the Trainer's ``accumulate_grad_batches``).

A Lightning strategy is read only through its public attributes (``distributed_sampler_kwargs``,
``world_size``, ``global_rank``, and ``gradient_average_ranks`` / ``sync_every_micro_batch``
where a strategy of this package says so); without a strategy the answer comes from the
initialised ``torch.distributed`` process group, or is one process. No Lightning import.

Under tensor parallelism the data-parallel world is smaller than the process group: the ranks of
one tensor-parallel group compute the same packs (``copies`` of each data-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = [
    "DataParallelWorld",
    "StepOwner",
    "StepSpec",
    "data_parallel_world",
    "meets_every_micro_batch",
    "resolve_objective",
    "step_spec",
]


@dataclass(frozen=True, slots=True)
class DataParallelWorld:
    """This rank's data-parallel world.

    Attributes:
        size: data-parallel ranks (``num_replicas`` of a sampler, ``R`` of the loss contract).
        rank: this rank among them.
        world_size: every process of the job (tensor-parallel peers included).
        global_rank: this process among them.
        gradient_ranks: ranks the strategy averages gradients over (``size`` unless the
            strategy says otherwise).
    """

    size: int
    rank: int
    world_size: int
    global_rank: int
    gradient_ranks: int

    @property
    def copies(self) -> int:
        """Processes that compute each data-parallel rank's packs (its tensor-parallel peers):
        a sum over the whole process group counts every pack this many times."""
        return max(1, self.world_size // self.size)


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective over ``group`` (default: the default group) must live:
    the current CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _process_group() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _sampler_kwargs(strategy: Any) -> dict[str, Any] | None:
    try:
        kwargs = strategy.distributed_sampler_kwargs
    except (AttributeError, RuntimeError, AssertionError):  # no mesh yet; one device
        return None
    if not kwargs or "num_replicas" not in kwargs or "rank" not in kwargs:
        return None
    return kwargs


def data_parallel_world(strategy: Any = None) -> DataParallelWorld:
    """The data-parallel world of ``strategy`` (a Lightning strategy: its
    ``distributed_sampler_kwargs``, the ``data_parallel`` mesh dimension under model
    parallelism), else of the initialised process group, else of one process."""
    world, me = _process_group()
    if strategy is None:
        return DataParallelWorld(
            size=world, rank=me, world_size=world, global_rank=me, gradient_ranks=world
        )
    world, me = int(strategy.world_size), int(strategy.global_rank)
    kwargs = _sampler_kwargs(strategy)
    size, rank = (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (world, me)
    try:
        averaged = getattr(strategy, "gradient_average_ranks", None)
    except (RuntimeError, AssertionError):  # read from a device mesh not built yet
        averaged = None
    return DataParallelWorld(
        size=size,
        rank=rank,
        world_size=world,
        global_rank=me,
        gradient_ranks=size if averaged is None else int(averaged),
    )


def meets_every_micro_batch(strategy: Any) -> bool:
    """Whether the ranks under ``strategy`` meet at every micro-batch (which decides
    ``objective="auto"``): the rebalancing strategies say (``sync_every_micro_batch``); under
    any other strategy with more than one rank they do (Lightning's per-micro-batch SIGTERM-flag
    broadcast; FSDP's collectives); a single process meets nobody."""
    said = getattr(strategy, "sync_every_micro_batch", None)
    if said is not None:
        return bool(said)
    return int(getattr(strategy, "world_size", 1)) > 1


def resolve_objective(objective: str, *, sync_every_micro_batch: bool) -> str:
    """The one place ``objective="auto"`` is decided: ``"microstep"`` if the ranks synchronise
    at every micro-batch (FSDP, or Lightning's per-micro-batch flag broadcast; see
    :func:`meets_every_micro_batch`), else ``"step"``. Any other objective is returned as it
    is."""
    if objective != "auto":
        return objective
    return "microstep" if sync_every_micro_batch else "step"


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One optimizer step of a fit (a *global batch*: ``micro_steps`` packs on each of the
    ``world.size`` data-parallel ranks).

    Attributes:
        world: the data-parallel world (:class:`DataParallelWorld`).
        micro_steps: micro-batches per rank per optimizer step (Lightning's
            ``accumulate_grad_batches``).
        meets_every_micro_batch: whether the ranks synchronise at every micro-batch.
        objective: what a balanced plan minimises, decided: ``"step"`` (per-rank totals over the
            step), ``"microstep"`` (the slowest rank of every micro-step) or ``"both"``.
    """

    world: DataParallelWorld
    micro_steps: int
    meets_every_micro_batch: bool
    objective: str

    @classmethod
    def of(cls, trainer: Any, *, objective: str = "auto") -> StepSpec:
        """The step of ``trainer`` as it is now, ``objective="auto"`` decided by how often its
        strategy's ranks meet. The one reader of ``accumulate_grad_batches``: a strategy that
        fixes the step for a fit (:class:`StepOwner`) builds its spec here once; under any
        other strategy :func:`step_spec` builds it at every ask (a
        ``GradientAccumulationScheduler`` changes it between epochs)."""
        strategy = trainer.strategy
        meets = meets_every_micro_batch(strategy)
        return cls(
            world=data_parallel_world(strategy),
            micro_steps=int(trainer.accumulate_grad_batches),
            meets_every_micro_batch=meets,
            objective=resolve_objective(objective, sync_every_micro_batch=meets),
        )


@runtime_checkable
class StepOwner(Protocol):
    """A strategy that decides the step of its fit (the rebalancing strategies: their configured
    objective, fixed at set-up)."""

    def step_spec(self, trainer: Any) -> StepSpec: ...


def step_spec(trainer: Any) -> StepSpec:
    """The step ``trainer`` trains: as its strategy decides it (:class:`StepOwner`), else what
    the Trainer says now (:meth:`StepSpec.of`)."""
    strategy = trainer.strategy
    if isinstance(strategy, StepOwner):
        return strategy.step_spec(trainer)
    return StepSpec.of(trainer)
