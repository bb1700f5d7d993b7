"""StragglerMonitor across checkpoints, resumes and validation inside an optimizer step.

The invariants, checked on real ``Trainer`` fits:

- a checkpoint holds the whole-run totals of every step timed up to it, also the steps since the
  last log point (on 2 ranks the totals are gathered when the checkpoint is saved);
- after a resume each rank's JSON lines hold every ``global_step`` once: the records past the
  checkpoint's step, of the steps the resumed run trains again, are dropped; the whole-run totals
  then equal the sums over the JSON lines (calibration and the summary count the same steps);
- validation, or a checkpoint save, between two micro-batches of an optimizer step is not
  training time: not in ``step_ms``, not in any phase, and the sync point that follows it (the
  other ranks' wait for it) is ``between_steps_ms``, not ``lightning_sync``.

The in-process fits read the host clock through ``lightning_vlmbalance.timing.timer.time``,
replaced by a clock that moves only when the test says so (as in ``tests/timing/test_timer.py``):
the language model's forward takes 10 ms, a validation batch 1 s, a checkpoint save 3 s, and
every time below is exact, whatever the machine's load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.balance import read_monitor_jsonl
from lightning_vlmbalance.synthetic import LengthTable, synthetic_length_table
from tests.launch import run_module
from tests.packing.lightning_job import SMALL_VLM, Data
from tests.timing import fake_clock
from tests.timing.fake_clock import FakeClock

FWD_S, VAL_S, SAVE_S = 0.01, 1.0, 3.0  # fake seconds: a training forward, a val batch, a save
ROUNDING = 0.01  # ms: the JSON lines round each phase to 4 decimals; sums over a few records


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = fake_clock.install(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield fake
    torch.set_num_threads(threads)


class ClockedVLM(ToyVLM):
    """The example VLM on the fake clock: each training forward of the language model lasts
    ``FWD_S`` (inside the monitor's ``llm_fwd``), each validation batch ``VAL_S``."""

    def __init__(self) -> None:
        super().__init__(**SMALL_VLM, max_positions=128)
        self.clock: FakeClock | None = None  # set after construction: not a hyperparameter
        # registered before the monitor's hooks: the time is inside the timed forward
        self.llm.register_forward_hook(self._forward_time)

    def _forward_time(self, *_: Any) -> None:
        if self.trainer.training:
            self.clock.sleep(FWD_S)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.clock.sleep(VAL_S)
        return self.loss(batch)


def _model(clock: FakeClock) -> ClockedVLM:
    model = ClockedVLM()
    model.clock = clock
    return model


class DataWithVal(Data):
    def val_dataloader(self) -> vb.PackedDataLoader:
        return self.train_dataloader()


class SaveMidStep(Callback):
    """Saves a checkpoint after the micro-batches ``at`` (0-based in the run), each save lasting
    ``SAVE_S``; records which optimizer step each save and validation fell inside."""

    def __init__(self, clock: FakeClock, path: Path, at: tuple[int, ...]) -> None:
        self.clock, self.path, self.at = clock, path, at
        self.batches = 0
        self.last_step = 0
        self.micro_in_step = 0  # 0 between optimizer steps, 1 inside one
        self.inside: dict[int, float] = {}  # optimizer step -> seconds outside training in it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.micro_in_step = int(trainer.global_step == self.last_step)  # no step ended
        self.last_step = trainer.global_step
        if self.batches in self.at:
            trainer.save_checkpoint(self.path)
        self.batches += 1

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.clock.sleep(SAVE_S)
        if self.micro_in_step:
            step = trainer.global_step + 1
            self.inside[step] = self.inside.get(step, 0.0) + SAVE_S

    def on_validation_batch_end(self, trainer, pl_module, *args: Any) -> None:
        if self.micro_in_step:
            step = trainer.global_step + 1
            self.inside[step] = self.inside.get(step, 0.0) + VAL_S


def _trainer(out: Path, callbacks: list[Callback], max_steps: int, **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **kw,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _table() -> LengthTable:
    return synthetic_length_table(200, tile_tokens=8, max_text_tokens=64, seed=1)


def _fit_with_checkpoints(
    out: Path, clock: FakeClock, max_steps: int, resume: Path | None = None
) -> vb.StragglerMonitor:
    """2 micro-batches a step, a log point every 3 steps, a checkpoint every 4."""
    monitor = vb.StragglerMonitor(log_every_n_steps=3, jsonl_dir=out / "jsonl")
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    trainer = _trainer(
        out, [monitor, checkpoint], max_steps, accumulate_grad_batches=2, limit_val_batches=0
    )
    trainer.fit(_model(clock), datamodule=Data(_table(), 128, 0), ckpt_path=resume)
    return monitor


def _saved(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)["callbacks"]["StragglerMonitor"]


def test_checkpoint_and_resume_count_every_step_once(tmp_path: Path, clock: FakeClock) -> None:
    """A checkpoint at step 4 (the last log point was step 3) holds 4 steps' totals; resumed
    from it after the first run went on to step 8, the JSON lines hold steps 1..8 once each,
    and the totals are the sums over them."""
    _fit_with_checkpoints(tmp_path, clock, max_steps=8)
    step_ms = 2 * FWD_S * 1e3  # every step: 2 forwards of the language model, nothing else
    for k in (4, 8):
        saved = _saved(tmp_path / "ckpt" / f"step={k}.ckpt")
        assert saved["steps_timed"] == k, saved
        assert saved["total_step_ms"] == pytest.approx([k * step_ms])
        assert saved["total_wait_ms"] == [0.0]
    jsonl = tmp_path / "jsonl" / "rank_0.jsonl"
    assert [r["global_step"] for r in _rows(jsonl)] == list(range(1, 9))

    monitor = _fit_with_checkpoints(
        tmp_path, clock, max_steps=8, resume=tmp_path / "ckpt" / "step=4.ckpt"
    )
    rows = _rows(jsonl)
    assert [r["global_step"] for r in rows] == list(range(1, 9))  # 5..8 once, as retrained
    summary = monitor.summary()
    assert summary["steps_timed"] == 8
    assert summary["busy_ms_per_rank"] == pytest.approx([sum(r["step_ms"] for r in rows)])
    assert summary["busy_ms_per_rank"] == pytest.approx([8 * step_ms])
    # what calibration reads: each micro-batch of each step once
    assert len(read_monitor_jsonl(tmp_path / "jsonl")) == 8 * 2


def test_validation_and_saves_inside_a_step_are_not_training_time(
    tmp_path: Path, clock: FakeClock
) -> None:
    """4 micro-batches a step; validation (2 batches of 1 s) after every 5th micro-batch, and a
    checkpoint save (3 s) after micro-batches 1 and 13: every step still lasts its 4 forwards,
    and the time outside training inside a step is ``outside_step_ms``."""
    monitor = vb.StragglerMonitor(log_every_n_steps=2, jsonl_dir=tmp_path / "jsonl")
    saver = SaveMidStep(clock, tmp_path / "mid.ckpt", at=(1, 13))
    trainer = _trainer(
        tmp_path,
        [monitor, saver],
        max_steps=5,
        accumulate_grad_batches=4,
        val_check_interval=5,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    trainer.fit(_model(clock), datamodule=DataWithVal(_table(), 128, 0))
    rows = _rows(tmp_path / "jsonl" / "rank_0.jsonl")
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5]
    # saves inside steps 1 and 4; validations inside steps 2, 3 and 4 (after micro-batches 5,
    # 10, 15); the one after micro-batch 20 is after step 5
    assert saver.inside == {1: SAVE_S, 2: 2 * VAL_S, 3: 2 * VAL_S, 4: 2 * VAL_S + SAVE_S}
    step_ms = 4 * FWD_S * 1e3
    for row in rows:
        assert row["step_ms"] == pytest.approx(step_ms), row
        assert row["phases_ms"]["llm_fwd"] == pytest.approx(step_ms), row
        outside = saver.inside.get(row["global_step"], 0.0) * 1e3
        assert row["outside_step_ms"] == pytest.approx(outside), row
    summary = monitor.summary()
    assert summary["busy_ms_per_rank"] == pytest.approx([5 * step_ms])
    # the mid-step checkpoint holds the steps before it
    assert _saved(tmp_path / "mid.ckpt")["steps_timed"] == 3


# -- 2 ranks: the checkpoint's gather, the resume, and the wait after a mid-step validation ------


def test_two_ranks_checkpoint_resume_and_validation(tmp_path: Path) -> None:
    """The checkpoint at step 4 (after the log point at 3) has both ranks' totals of steps
    1..4, equal to the sums over their JSON lines; after the resume every rank's lines hold
    steps 1..7 once and the totals are their sums; in a step that a validation interrupted, the
    micro-batch after it has no ``lightning_sync`` (its wait for the other rank's validation is
    ``between_steps_ms``).

    One 2-process job: 7 steps of 2 micro-batches, a log point every 3 steps, a checkpoint every
    4, validation after every 3rd micro-batch (rank 1 sleeps in it); then, in the same
    processes, a new Trainer and monitor resumed from step 4 up to step 7, writing the same
    JSON-lines folder."""
    out = tmp_path
    run_module(
        "tests.callbacks.straggler_job",
        *("--out", str(out), "--devices", "2", "--accumulate", "2", "--max-steps", "7"),
        *("--log-every", "3", "--checkpoint-every", "4", "--then-resume-from", "4"),
        *("--jsonl-dir", str(out / "j"), "--val-every", "3", "--val-sleep-ms", "30"),
        *("--delay-ms", "0"),
    )
    rows = {r: _rows(out / "j" / f"rank_{r}.jsonl") for r in (0, 1)}
    for r in (0, 1):
        assert [x["global_step"] for x in rows[r]] == list(range(1, 8)), r
    saved = _saved(out / "ckpt" / "step=4.ckpt")
    assert saved["steps_timed"] == 4
    for r in (0, 1):
        upto4 = [x for x in rows[r] if x["global_step"] <= 4]
        step = sum(x["step_ms"] for x in upto4)
        wait = sum(x["phases_ms"]["sync_wait"] + x["phases_ms"]["lightning_sync"] for x in upto4)
        assert saved["total_step_ms"][r] == pytest.approx(step, abs=ROUNDING)
        assert saved["total_wait_ms"][r] == pytest.approx(wait, abs=ROUNDING)
    summary = json.loads((out / "summary_resumed.json").read_text())
    assert summary["steps_timed"] == 7
    final = _saved(out / "last_resumed.ckpt")  # saved after the resumed fit, unrounded
    assert final["steps_timed"] == 7
    for r in (0, 1):
        step = sum(x["step_ms"] for x in rows[r])
        wait = sum(x["phases_ms"]["sync_wait"] + x["phases_ms"]["lightning_sync"] for x in rows[r])
        assert final["total_step_ms"][r] == pytest.approx(step, abs=ROUNDING)
        assert final["total_wait_ms"][r] == pytest.approx(wait, abs=ROUNDING)
    # validation after micro-batches 3 and 9 (1-based): inside steps 2 and 5, after their first
    # micro-batch; the one after micro-batch 6 (and 12) follows a step's end
    for r in (0, 1):
        interrupted = {x["global_step"] for x in rows[r] if x["outside_step_ms"] > 0}
        assert interrupted == {2, 5}, (r, interrupted)
        for x in rows[r]:
            assert x["micro"][0]["lightning_sync_ms"] == 0
            if x["global_step"] in interrupted:
                assert x["micro"][1]["lightning_sync_ms"] == 0, x
            else:
                assert x["micro"][1]["lightning_sync_ms"] > 0, x
