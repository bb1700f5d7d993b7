"""The timing core: phase intervals, nesting, the comm-hook wait, straggler statistics.

The host clock is injected: ``lightning_vlmbalance.timing.timer`` reads ``time.perf_counter``
through its module attribute ``time``, which the ``clock`` fixture replaces by a clock that only
moves when the test says so (``tests/timing/fake_clock.py``). Every interval is then exact,
whatever the machine's load.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlmbalance.timing import MEASURED_PHASES, StepTimer, straggler_stats, timed_comm_hook
from lightning_vlmbalance.timing import timer as timer_mod
from tests.timing import fake_clock
from tests.timing.fake_clock import FakeClock


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return fake_clock.install(monkeypatch)


def _sleep_phase(timer: StepTimer, clock: FakeClock, phase: str, seconds: float, **kw) -> None:
    timer.start(phase, **kw)
    clock.sleep(seconds)
    timer.stop(phase)


def test_the_host_clock_is_read_through_the_module_attribute(clock) -> None:
    """The seam the other tests rely on: a mark is ``timer.time.perf_counter()``."""
    a = timer_mod.HOST.mark()
    clock.sleep(0.25)
    assert timer_mod.HOST.elapsed_ms(a, timer_mod.HOST.mark()) == pytest.approx(250.0)


def test_phases_are_summed_over_micro_batches(clock) -> None:
    timer = StepTimer()
    for _ in range(3):
        timer.set_features({"pack_id": 1})
        _sleep_phase(timer, clock, "vision_fwd", 0.01)
        clock.sleep(0.002)  # between phases: in the step, in no phase
        timer.end_micro()
    timer.end_step(global_step=1, epoch=0)
    (step,) = timer.drain()
    assert len(step.micro) == 3 and step.micro[0]["pack_id"] == 1
    assert [m["vision_fwd_ms"] for m in step.micro] == pytest.approx([10.0] * 3)
    assert step.phases_ms["vision_fwd"] == pytest.approx(30.0)
    assert step.step_ms == pytest.approx(36.0)  # first mark to end_step
    assert all(step.phases_ms[p] == 0 for p in MEASURED_PHASES if p != "vision_fwd")
    assert timer.drain() == []


def test_nested_vision_is_excluded_from_llm(clock) -> None:
    """A vision forward inside the language module's forward counts only as vision."""
    timer = StepTimer()
    timer.start("llm_fwd")
    clock.sleep(0.005)
    _sleep_phase(timer, clock, "vision_fwd", 0.03)
    clock.sleep(0.01)
    timer.stop("llm_fwd")
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["vision_fwd"] == pytest.approx(30.0)
    assert step.phases_ms["llm_fwd"] == pytest.approx(15.0)
    assert step.step_ms == pytest.approx(45.0)


def test_wait_after_the_last_bucket_becomes_sync_wait(clock) -> None:
    timer = StepTimer()
    timer.start("backward")
    clock.sleep(0.01)
    timer.mark_sync_entry()  # a first bucket: not the last one
    clock.sleep(0.01)
    timer.mark_sync_entry()  # the last bucket is handed to the all-reduce here
    clock.sleep(0.03)  # waiting for the other ranks
    timer.stop_backward()
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["sync_wait"] == pytest.approx(30.0)
    assert step.phases_ms["backward"] == pytest.approx(20.0)
    assert step.micro[0]["sync_wait_ms"] == pytest.approx(30.0)


def test_backward_without_a_bucket_has_no_sync_wait(clock) -> None:
    """One device, or no DDP: the whole backward is `backward`."""
    timer = StepTimer()
    _sleep_phase(timer, clock, "backward", 0.02)
    timer.stop_backward()  # already stopped: a no-op
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["backward"] == pytest.approx(20.0)
    assert step.phases_ms["sync_wait"] == 0


def test_discarded_step_is_not_reported(clock) -> None:
    timer = StepTimer()
    _sleep_phase(timer, clock, "data", 0.01, host=True)
    timer.discard_step()
    timer.end_step(1, 0)
    assert timer.drain() == []


def test_straggler_stats() -> None:
    phases = np.zeros((3, len(MEASURED_PHASES)))
    phases[0, MEASURED_PHASES.index("sync_wait")] = 40.0
    phases[2, MEASURED_PHASES.index("lightning_sync")] = 30.0
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


def test_disabled_timer_records_nothing(clock) -> None:
    timer = StepTimer()
    timer.enabled = False
    _sleep_phase(timer, clock, "vision_fwd", 0.01)
    timer.mark_sync_entry()
    timer.end_step(1, 0)
    assert timer.drain() == []
    timer.enabled = True
    _sleep_phase(timer, clock, "vision_fwd", 0.02)
    timer.end_step(2, 0)
    (step,) = timer.drain()
    assert step.global_step == 2 and step.phases_ms["vision_fwd"] == pytest.approx(20.0)


def test_a_phase_never_stopped_does_not_block_later_steps(clock) -> None:
    """An optimizer step skipped by a GradScaler leaves `optimizer` open: the step still ends,
    and the phase ends with its micro-batch."""
    timer = StepTimer()
    timer.start("optimizer")
    clock.sleep(0.01)
    timer.start("optimizer")  # re-entered (LBFGS calls the closure several times): keeps its start
    clock.sleep(0.01)
    timer.end_step(1, 0)
    clock.sleep(0.05)  # after the step: not in it
    _sleep_phase(timer, clock, "data", 0.0, host=True)
    timer.end_step(2, 0)
    first, second = timer.drain()
    assert [first.global_step, second.global_step] == [1, 2]
    assert first.phases_ms["optimizer"] == pytest.approx(20.0)
    assert second.phases_ms["optimizer"] == 0


def test_time_before_a_step_is_not_waiting(clock) -> None:
    timer = StepTimer()
    timer.between_steps(120.0)
    assert not timer.step_open
    _sleep_phase(timer, clock, "lightning_sync", 0.004, host=True)
    assert timer.step_open
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.between_steps_ms == 120.0
    assert step.phases_ms["lightning_sync"] == pytest.approx(4.0)
    assert step.step_ms == pytest.approx(4.0)  # the time before the step is not in it


def test_a_pause_between_micro_batches_is_outside_the_step(clock) -> None:
    """Validation between two micro-batches: the pause starts where the last micro-batch ended
    (whatever ran between, say the validation loader's set-up, is outside too), the step's time
    and phases leave it out, and the sync point after it is a wait for work outside training."""
    timer = StepTimer()
    assert timer.sync_point_is_between()  # before the step's first micro-batch
    _sleep_phase(timer, clock, "llm_fwd", 0.01)
    timer.end_micro()
    clock.sleep(0.5)  # between micro-batches, before validation starts: outside
    timer.pause()
    clock.sleep(2.0)  # validation
    timer.pause()  # a checkpoint saved at the end of validation: paused already
    clock.sleep(1.0)
    assert timer.sync_point_is_between()  # training goes on: resumed, and the wait is "between"
    clock.sleep(0.25)  # the other ranks' validation
    timer.between_steps(250.0)
    assert not timer.sync_point_is_between()  # the next micro-batch's sync point is training
    _sleep_phase(timer, clock, "llm_fwd", 0.01)
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.outside_step_ms == pytest.approx(3500.0)
    assert step.step_ms == pytest.approx(270.0)  # 2 forwards and the wait after the pause
    assert step.between_steps_ms == 250.0
    assert step.phases_ms["llm_fwd"] == pytest.approx(20.0)
    assert step.to_json(0, 1)["outside_step_ms"] == pytest.approx(3500.0)


def test_a_pause_inside_a_micro_batch_ends_with_it(clock) -> None:
    """A checkpoint saved from a callback's ``on_train_batch_end`` before the monitor's: the
    pause starts then, and ends with the micro-batch; outside a step a pause does nothing."""
    timer = StepTimer()
    timer.pause()  # no step open: nothing to leave out
    assert not timer.resume()
    _sleep_phase(timer, clock, "backward", 0.01)
    timer.pause()
    clock.sleep(3.0)  # the save
    timer.end_micro()
    clock.sleep(0.001)  # between micro-batches: in the step
    assert timer.sync_point_is_between()  # the other ranks' wait for the save
    _sleep_phase(timer, clock, "backward", 0.01)
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.outside_step_ms == pytest.approx(3000.0)
    assert step.step_ms == pytest.approx(21.0)
    timer.pause()  # between steps: nothing open
    clock.sleep(1.0)
    _sleep_phase(timer, clock, "backward", 0.01)
    timer.end_step(2, 0)
    (step,) = timer.drain()
    assert step.outside_step_ms == 0 and step.step_ms == pytest.approx(10.0)


class _DeviceClock:
    """A device clock (as CUDA events are) that reads the fake host clock: not the HOST object,
    so only phases timed with the device clock nest in one another."""

    device = True

    @staticmethod
    def mark() -> float:
        return timer_mod.time.perf_counter()

    @staticmethod
    def ready(mark: float) -> bool:
        return True

    @staticmethod
    def elapsed_ms(a: float, b: float) -> float:
        return (b - a) * 1e3


def test_a_wait_inside_a_collective_uses_the_timers_own_clock(clock) -> None:
    """``wait_phase`` (FSDP's collectives, the encoder's return) times with each timer's clock:
    on CUDA the compute stream's events, excluded from the device phase it interrupts, with no
    host interval (the host time of a queued collective is not its wait)."""
    from lightning_vlmbalance.timing.timer import COLLECTIVE_WAIT, wait_phase

    timer = StepTimer()
    timer.device = _DeviceClock()
    timer.start("backward")
    clock.sleep(0.01)
    with wait_phase([timer], COLLECTIVE_WAIT):
        clock.sleep(0.02)
    clock.sleep(0.005)
    timer.stop_backward()
    timer.end_step(1, 0)
    (step,) = timer.drain()
    assert step.phases_ms["collective_wait"] == pytest.approx(20.0)
    assert step.phases_ms["backward"] == pytest.approx(15.0)
    assert step.collective_calls_ms == pytest.approx([20.0])
