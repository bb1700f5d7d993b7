"""FSDP2's collectives timed per model: the timed model's waits become ``collective_wait``
intervals; another model in the process is left alone; the handle restores the methods."""

from __future__ import annotations

from typing import Any

import pytest

from harness.ranks import run_ranks


def _job(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_vlmbalance.timing import StepTimer, time_collectives

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    def sharded() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    timed_model, other = sharded(), sharded()
    timer = StepTimer(device_clock="cpu")
    handle = time_collectives(timer, timed_model)

    def step(model: torch.nn.Module, number: int) -> int:
        timer.start("llm_fwd")
        loss = model(torch.randn(4, 8)).square().mean()
        timer.stop("llm_fwd")
        timer.start("backward")
        loss.backward()
        timer.stop_backward()
        timer.end_micro()
        timer.end_step(number, 0)
        (resolved,) = timer.drain()
        return len(resolved.collective_calls_ms)

    calls = {"timed": step(timed_model, 1), "other": step(other, 2)}
    handle.remove()
    calls["removed"] = step(timed_model, 3)
    calls["plain_ddp"] = time_collectives(timer, torch.nn.Linear(2, 2)) is None
    return calls


def test_only_the_given_models_collectives_are_timed() -> None:
    results = run_ranks(_job, 1, timeout=120, start_method="forkserver")
    for status, calls in results.values():
        assert status == "ok", calls
        assert calls["timed"] > 0 and calls["other"] == 0 and calls["removed"] == 0
        assert calls["plain_ddp"]


def test_the_old_process_wide_call_is_refused_by_name() -> None:
    from lightning_vlmbalance.timing import StepTimer, time_collectives

    with pytest.raises(TypeError, match="give the model"):
        time_collectives(StepTimer(device_clock="cpu"))


def test_timing_a_model_twice_is_refused_until_the_first_handle_is_removed() -> None:
    """Two handles on one model: the second wrapped the first's wraps, and the first's
    ``remove`` took both."""
    import torch

    from lightning_vlmbalance.timing import StepTimer, time_collectives

    class Group:
        def unshard(self) -> str:
            return "unsharded"

        wait_for_unshard = post_backward = finalize_backward = unshard

    class State:
        _fsdp_param_groups = (Group(),)

    class Sharded(torch.nn.Module):
        def _get_fsdp_state(self) -> State:
            return State()

    model, timer = Sharded(), StepTimer(device_clock="cpu")
    first = time_collectives(timer, model)
    with pytest.raises(ValueError, match="timed already"):
        time_collectives(timer, model)
    first.remove()
    second = time_collectives(timer, model)
    assert second is not None and State._fsdp_param_groups[0].unshard() == "unsharded"
    second.remove()
    assert not State._fsdp_param_groups[0].__dict__
