"""The timing core: phase intervals, nesting, the comm-hook wait, straggler statistics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lightning_vlmbalance.timing import PHASES, StepTimer, straggler_stats, timed_comm_hook


def _sleep_phase(timer: StepTimer, phase: str, seconds: float, **kw) -> None:
    timer.start(phase, **kw)
    time.sleep(seconds)
    timer.stop(phase)


def test_phases_are_summed_over_micro_batches() -> None:
    timer = StepTimer()
    for _ in range(3):
        timer.set_features({"pack_id": 1})
        _sleep_phase(timer, "vision_fwd", 0.01)
        timer.end_micro()
    timer.end_step(global_step=1, epoch=0)
    (step,) = timer.drain()
    assert len(step.micro) == 3 and step.micro[0]["pack_id"] == 1
    assert step.phases_ms["vision_fwd"] >= 30
    assert step.step_ms >= step.phases_ms["vision_fwd"]
    assert timer.drain() == []


def test_nested_vision_is_excluded_from_llm() -> None:
    """A vision forward inside the language module's forward counts only as vision."""
    timer = StepTimer()
    timer.start("llm_fwd")
    _sleep_phase(timer, "vision_fwd", 0.03)
    time.sleep(0.01)
    timer.stop("llm_fwd")
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["vision_fwd"] >= 30
    assert 10 <= step.phases_ms["llm_fwd"] < 25


def test_wait_after_the_last_bucket_becomes_sync_wait() -> None:
    timer = StepTimer()
    timer.start("backward")
    time.sleep(0.02)
    timer.mark_sync_entry()
    time.sleep(0.03)  # waiting for the other ranks
    timer.stop_backward()
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["sync_wait"] >= 30
    assert 20 <= step.phases_ms["backward"] < 30


def test_discarded_step_is_not_reported() -> None:
    timer = StepTimer()
    _sleep_phase(timer, "data", 0.0, host=True)
    timer.discard_step()
    timer.end_step(1, 0)
    assert timer.drain() == []


def test_straggler_stats() -> None:
    phases = np.zeros((3, len(PHASES)))
    phases[0, PHASES.index("sync_wait")] = 40.0
    phases[2, PHASES.index("lightning_sync")] = 30.0
    stats = straggler_stats(phases, np.array([100.0, 100.0, 100.0]))
    assert stats.worst_rank == 1
    assert stats.waste_frac == pytest.approx(70 / 300)
    assert stats.max_over_median == pytest.approx(100 / 70)
    with pytest.raises(ValueError, match="phases_ms must be"):
        straggler_stats(np.zeros((2, 3)), np.zeros(2))


def test_comm_hook_wraps_never_replaces() -> None:
    calls = []

    def user_hook(state, bucket):
        calls.append(("user", state, bucket))
        return "future"

    hook = timed_comm_hook(lambda: calls.append(("mark",)), user_hook)
    assert hook("s", "b") == "future"
    assert calls == [("mark",), ("user", "s", "b")]
    assert hook.__wrapped__ is user_hook


def test_disabled_timer_records_nothing() -> None:
    timer = StepTimer()
    timer.enabled = False
    _sleep_phase(timer, "vision_fwd", 0.0)
    timer.mark_sync_entry()
    timer.end_step(1, 0)
    assert timer.drain() == []
    timer.enabled = True
    _sleep_phase(timer, "vision_fwd", 0.0)
    timer.end_step(2, 0)
    assert [s.global_step for s in timer.drain()] == [2]


def test_a_phase_never_stopped_does_not_block_later_steps() -> None:
    """An optimizer step skipped by a GradScaler leaves `optimizer` open: the step still ends."""
    timer = StepTimer()
    timer.start("optimizer")
    timer.start("optimizer")  # re-entered (LBFGS calls the closure several times)
    timer.end_step(1, 0)
    _sleep_phase(timer, "data", 0.0, host=True)
    timer.end_step(2, 0)
    assert [s.global_step for s in timer.drain()] == [1, 2]


def test_time_before_a_step_is_not_waiting() -> None:
    timer = StepTimer()
    timer.between_steps(120.0)
    assert not timer.step_open
    _sleep_phase(timer, "lightning_sync", 0.0, host=True)
    assert timer.step_open
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.between_steps_ms == 120.0 and step.phases_ms["lightning_sync"] < 5
