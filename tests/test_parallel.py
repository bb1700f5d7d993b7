"""``lightning_vlmbalance.parallel``: the one answer to "which data-parallel world am I in" and
"how often do the ranks meet", from real Lightning strategies (set-up in fits is covered by
the strategy, sampler and loss tests)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.config import RebalanceConfig, resolve_objective
from lightning_vlmbalance.parallel import (
    DataParallelWorld,
    data_parallel_world,
    meets_every_micro_batch,
)


def _strategy(strategy, devices: int = 2):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False).strategy


def test_one_process_without_a_strategy() -> None:
    assert data_parallel_world() == DataParallelWorld(
        size=1, rank=0, world_size=1, global_rank=0, gradient_ranks=1
    )


def test_ddp_world_is_every_rank() -> None:
    world = data_parallel_world(_strategy("ddp"))
    assert (world.size, world.rank, world.world_size, world.copies) == (2, 0, 2, 1)
    assert world.gradient_ranks == 2


def test_tensor_parallel_copies() -> None:
    """Data-parallel size 2 in a world of 4: each data-parallel rank's packs are computed by 2
    processes, so a sum over the world counts them twice."""
    world = DataParallelWorld(size=2, rank=1, world_size=4, global_rank=3, gradient_ranks=2)
    assert world.copies == 2


def test_a_mesh_not_built_yet_falls_back_to_the_world() -> None:
    """Before set-up a model-parallel strategy has no device mesh: the world, not an error."""
    world = data_parallel_world(_strategy(ModelParallelStrategy()))
    assert (world.size, world.world_size) == (2, 2)


def test_who_meets_every_micro_batch_decides_auto() -> None:
    """The rebalancing strategies say; any other strategy with more than one rank meets every
    micro-batch (Lightning's flag broadcast, FSDP); "auto" is decided in one function."""
    assert meets_every_micro_batch(_strategy("vlmbalance")) is False
    assert meets_every_micro_batch(_strategy("fsdp_vlmbalance")) is True
    assert meets_every_micro_batch(_strategy(vb.VLMBalanceStrategy(sigterm_every_micro_batch=True)))
    assert meets_every_micro_batch(_strategy("ddp")) is True
    assert meets_every_micro_batch(_strategy(ModelParallelStrategy())) is True
    assert meets_every_micro_batch(_strategy("auto", devices=1)) is False
    assert resolve_objective("auto", sync_every_micro_batch=True) == "microstep"
    assert resolve_objective("auto", sync_every_micro_batch=False) == "step"
    assert resolve_objective("both", sync_every_micro_batch=False) == "both"
    config = RebalanceConfig().resolved(sync_every_micro_batch=True)
    assert config.objective == "microstep"


def _trainer(strategy, devices: int = 2, **kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


def test_the_step_is_read_from_the_trainer_once_and_fixed_by_a_rebalancing_strategy() -> None:
    """`step_spec` is the one answer to "how many micro-steps, which objective": under a plain
    strategy it follows the Trainer (a GradientAccumulationScheduler changes it between epochs);
    a rebalancing strategy fixes its spec at set-up, with its configured objective."""
    from lightning_vlmbalance.parallel import StepSpec, step_spec

    plain = _trainer("ddp", accumulate_grad_batches=3)
    step = step_spec(plain)
    assert (step.micro_steps, step.world.size, step.objective) == (3, 2, "microstep")
    plain.accumulate_grad_batches = 5  # what a GradientAccumulationScheduler does
    assert step_spec(plain).micro_steps == 5

    trainer = _trainer(vb.VLMBalanceStrategy(objective="both"), accumulate_grad_batches=4)
    assert step_spec(trainer).objective == "both"  # before set-up: derived, as configured
    fixed = StepSpec.of(trainer, objective=trainer.strategy.resolved_objective)
    trainer.strategy.rebalancer.step = fixed  # what Rebalancer.setup does
    trainer.accumulate_grad_batches = 7
    assert step_spec(trainer) is fixed
    assert (fixed.micro_steps, fixed.objective, fixed.meets_every_micro_batch) == (4, "both", False)
