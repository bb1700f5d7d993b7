"""The private Lightning attributes the package relies on are all owned by `_lightning.py`:
this fails when Lightning removes one or changes what it means."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_vlmbalance import _lightning as seam
from tests.cpu_fit import cpu_trainer, packed_loader
from tests.packing.lightning_job import SMALL_VLM

ROOT = Path(__file__).resolve().parents[1]


def test_every_private_attribute_is_there_and_means_the_same() -> None:
    assert seam._problems() == ()
    seam.check_lightning()


def test_a_missing_attribute_is_named_with_the_supported_range(monkeypatch) -> None:
    monkeypatch.delattr(_TrainingEpochLoop, "_on_before_fetch")
    seam._problems.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"supports lightning >=2.5,<2.7.*_on_before_fetch"):
            seam.check_lightning()
    finally:
        monkeypatch.undo()
        seam._problems.cache_clear()


def test_pyproject_pins_the_supported_range() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"lightning' + re.escape(",".join(seam.SUPPORTED_LIGHTNING)) + '"', text)


def test_sync_point_listeners_compose_and_leave_independently() -> None:
    """The strategy's replacement and the monitor's wrapper compose in registration order
    whatever order Lightning calls them in; each owner removes only its own listener."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    loop = trainer.fit_loop.epoch_loop
    calls: list[str] = []
    strategy, monitor, other = object(), object(), object()
    s = seam.loop_seam(trainer)

    def wrap(name):
        def wrapper(inner):
            calls.append(f"{name}>")
            inner()
            calls.append(f"<{name}")

        return wrapper

    s.wrap_sync_point(monitor, wrap("monitor"))
    s.replace_sync_point(strategy, lambda: calls.append("agree"))
    s.wrap_sync_point(other, wrap("other"))
    loop._broadcast_sigterm_tensor()
    assert calls == ["monitor>", "other>", "agree", "<other", "<monitor"]
    with pytest.raises(RuntimeError, match="replaced by object already"):
        s.replace_sync_point(monitor, lambda: None)
    seam.leave_loop_seam(trainer, strategy)  # the monitor keeps timing Lightning's own point
    calls.clear()
    loop._broadcast_sigterm_tensor()
    assert calls == ["monitor>", "other>", "<other", "<monitor"]
    seam.leave_loop_seam(trainer, monitor)
    seam.leave_loop_seam(trainer, other)  # the last one out restores Lightning's methods
    assert "_broadcast_sigterm_tensor" not in loop.__dict__
    assert "_on_before_fetch" not in loop.__dict__


def test_fetch_listeners_and_micro_batch_index_in_a_real_fit() -> None:
    """In a real fit the fetch listeners run around every fetch, and the micro-batch index is
    the 0-based position of the batch in the epoch (what accumulation is keyed on)."""
    from examples.vlm import ToyVLM

    events: list[tuple[str, int]] = []

    class Listen(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            seam.loop_seam(trainer).on_fetch(
                self,
                lambda: events.append(("before", seam.micro_batch_index(trainer))),
                lambda: events.append(("after", seam.micro_batch_index(trainer))),
            )

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            events.append(("batch", seam.micro_batch_index(trainer)))

        def teardown(self, trainer, pl_module, stage):
            seam.leave_loop_seam(trainer, self)

    trainer = cpu_trainer([Listen()], steps=3, accumulate_grad_batches=2)
    trainer.fit(ToyVLM(**SMALL_VLM, max_positions=128), packed_loader(trainer))
    batches = [i for e, i in events if e == "batch"]
    assert batches == [1, 2, 3, 4, 5, 6]  # `ready` was incremented before the batch hooks
    fetched = [e for e, _ in events if e != "batch"]
    assert fetched[:4] == ["before", "after", "before", "after"] and len(fetched) >= 12
    assert "_on_before_fetch" not in trainer.fit_loop.epoch_loop.__dict__


def test_the_launcher_observer_stops_watching_at_the_agreed_stop() -> None:
    """Lightning's child-process observer SIGKILLs the launching process (rank 0) when a rank it
    started exits non-zero; after ``stop_watching_launched_ranks`` a rank's exit 143 leaves it
    alive (a stand-in process plays rank 0, so the test's own process is never the target)."""
    observer_type = seam._ChildProcessObserver
    outcomes = []
    for stop in (False, True):
        rank0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        rank1 = subprocess.Popen([sys.executable, "-c", "raise SystemExit(143)"])
        observer = observer_type(main_pid=rank0.pid, child_processes=[rank1], sleep_period=1)
        observer.start()
        if stop:
            seam.stop_watching_launched_ranks()
        observer.join(timeout=30)
        assert not observer.is_alive()
        try:  # its SIGKILL, if it sent one, lands a moment after the observer ends
            outcomes.append(rank0.wait(timeout=2))
        except subprocess.TimeoutExpired:
            outcomes.append(None)
        rank0.kill()
        rank0.wait()
    assert outcomes == [-signal.SIGKILL, None]


def test_a_wrapped_worker_init_fn_keeps_lightnings_seeding(monkeypatch) -> None:
    """Lightning adds its worker seeding after ``process_dataloader`` only to a loader without
    a ``worker_init_fn``: the strategy's SIGTERM wrapper, installed there, runs it inside."""
    from torch.utils.data import DataLoader

    from lightning_vlmbalance.preemption import WorkersIgnoreSigterm

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    loader = DataLoader(range(4))
    WorkersIgnoreSigterm.install(loader, rank=3)
    _auto_add_worker_init_fn(loader, 3)  # what Lightning does next: nothing, it has one
    inner = loader.worker_init_fn.init_fn
    assert (inner.func, inner.keywords) == (pl_worker_init_function, {"rank": 3})

    def own(worker_id: int) -> None:
        pass

    mine = DataLoader(range(4), worker_init_fn=own)
    WorkersIgnoreSigterm.install(mine, rank=0)
    WorkersIgnoreSigterm.install(mine, rank=0)  # once
    assert mine.worker_init_fn.init_fn is own


def test_resume_position_is_where_lightning_restarts_a_checkpoint_saved_at_that_point(
    tmp_path,
) -> None:
    """The position a loader saves is the micro-batches the loop processed: inside a training
    step the current one is not counted (an exception there runs it again), at its
    ``on_train_batch_end`` it is (Lightning counts it done when it restarts from there), and at
    a mid-epoch validation every trained batch is, not the one read ahead."""
    from examples.vlm import ToyVLM

    seen: dict[str, list[int]] = {"step": [], "batch_end": [], "validation": []}

    class Model(ToyVLM):
        def training_step(self, batch, batch_idx):
            seen["step"].append(seam.resume_position(self.trainer))
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen["batch_end"].append(seam.resume_position(self.trainer))

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                seen["validation"].append(seam.resume_position(self.trainer))

    trainer = cpu_trainer(
        [],
        steps=3,
        accumulate_grad_batches=2,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    model = Model(**SMALL_VLM, max_positions=128)
    trainer.fit(model, packed_loader(trainer), val_dataloaders=packed_loader(trainer))
    assert seen["step"] == [0, 1, 2, 3, 4, 5]
    assert seen["batch_end"] == [1, 2, 3, 4, 5, 6]
    assert seen["validation"][:2] == [2, 4]
