"""StragglerMonitor logs where Lightning logs: on the global steps at which a real ``Trainer``
writes the LightningModule's own ``self.log`` metrics to TensorBoard, read back from the event
files; and ``packing/efficiency`` of the packed batches trained between its log points."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import lightning_vlmbalance as vb
from examples.vlm import SMALL_VLM, ToyVLM
from lightning_vlmbalance.callbacks.straggler_monitor import _pack_fill
from tests.cpu_fit import packed_loader

ACCUMULATE = 2
STEPS = 6  # a multiple of every interval below: the end of training is a log point
DENSE_VLM = {**SMALL_VLM, "moe_experts": 0}
MONITOR_TAGS = ("straggler/step_ms/rank_0", "straggler/waste_frac", "packing/efficiency")


class PackLog(Callback):
    """Each trained micro-batch's ``(global_step after it, total_tokens, seq_len, padding)``."""

    def __init__(self) -> None:
        self.micro: list[tuple[int, int, int, bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        meta = batch["meta"]
        self.micro.append(
            (
                trainer.global_step,
                meta["total_tokens"],
                batch["input_ids"].shape[-1],
                meta["padding"],
            )
        )


def _fit(out: Path, monitor: vb.StragglerMonitor, steps: int = STEPS, **trainer: Any) -> PackLog:
    torch.manual_seed(0)
    packs = PackLog()
    fit = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[monitor, packs],
        logger=TensorBoardLogger(out, name="run", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer,
    )
    fit.fit(ToyVLM(**DENSE_VLM), packed_loader(fit))
    assert fit.global_step == steps
    return packs


def _steps(out: Path) -> dict[str, list[int]]:
    """Every scalar tag's logged steps."""
    acc = EventAccumulator(str(out / "run" / "version_0"))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("every", [1, 2, 3])
def test_monitor_logs_on_the_steps_lightning_logs_at(tmp_path: Path, every: int) -> None:
    """Under ``Trainer(log_every_n_steps=N)`` and gradient accumulation, the monitor's scalars
    and ``packing/efficiency`` have exactly the steps of the module's ``self.log("train/loss")``:
    Lightning logs the optimizer steps ``k`` with ``k % N == 0`` at step ``k - 1`` (the batches
    that stepped before). ``packing/efficiency`` is the real tokens over the capacity of the
    packs trained since the previous log point, in ``(0, 1]``."""
    packs = _fit(
        tmp_path, vb.StragglerMonitor(jsonl_dir=tmp_path / "jsonl"), log_every_n_steps=every
    )
    steps = _steps(tmp_path)
    lightning = steps["train/loss"]
    assert lightning == [k - 1 for k in range(1, STEPS + 1) if k % every == 0]  # Lightning's rule
    for tag in MONITOR_TAGS:
        assert steps[tag] == lightning, tag

    acc = EventAccumulator(str(tmp_path / "run" / "version_0"))
    acc.Reload()
    logged = [e.value for e in acc.Scalars("packing/efficiency")]
    assert all(0 < v <= 1 for v in logged), logged
    points = [0, *(step + 1 for step in lightning)]  # optimizer steps at the log points
    expected = [_interval_efficiency(packs, a, b) for a, b in pairwise(points)]
    assert logged == pytest.approx(expected, rel=1e-6)  # TensorBoard stores float32


def _interval_efficiency(packs: PackLog, after: int, upto: int) -> float:
    """Real tokens over capacity of the micro-batches of optimizer steps ``after+1..upto``: a
    micro-batch belongs to step ``k`` if it ended with ``global_step`` ``k - 1`` (accumulating)
    or closed step ``k`` (``global_step`` became ``k``)."""
    owner, step_of = 1, []
    for step, *_ in packs.micro:
        step_of.append(owner)
        if step == owner:  # this micro-batch closed the step
            owner += 1
    real = [
        (t, c) for k, (_, t, c, pad) in zip(step_of, packs.micro) if after < k <= upto and not pad
    ]
    return sum(t for t, _ in real) / sum(c for _, c in real)


def test_an_explicit_interval_logs_on_lightnings_axis_and_at_the_end(tmp_path: Path) -> None:
    """``StragglerMonitor(log_every_n_steps=4)`` under ``Trainer(log_every_n_steps=1)``: the log
    point at optimizer step 4 is Lightning's step 3; the end of training (step 6) logs the
    steps left, at Lightning's step of step 6."""
    monitor = vb.StragglerMonitor(log_every_n_steps=4, jsonl_dir=tmp_path / "jsonl")
    _fit(tmp_path, monitor, log_every_n_steps=1)
    steps = _steps(tmp_path)
    assert steps["train/loss"] == list(range(STEPS))
    for tag in MONITOR_TAGS:
        assert steps[tag] == [3, 5], tag
    assert monitor.summary()["steps_timed"] == STEPS


def test_trainer_logging_off_logs_nothing_and_still_sums_up(tmp_path: Path) -> None:
    """``Trainer(log_every_n_steps=0)``: Lightning writes no step metric, nor does the monitor;
    the end of training still gathers, for ``summary()``."""
    monitor = vb.StragglerMonitor(jsonl_dir=tmp_path / "jsonl")
    _fit(tmp_path, monitor, steps=3, log_every_n_steps=0)
    tags = set(_steps(tmp_path))
    assert not {t for t in tags if t.startswith(("straggler/", "packing/", "train/"))}, tags
    assert monitor.summary()["steps_timed"] == 3


def test_only_real_packed_batches_count() -> None:
    """``packing/efficiency`` reads a ``PackedBatch``'s ``meta["total_tokens"]`` and its
    ``input_ids`` length; padding packs and other batches are skipped, without an error."""
    batch = next(iter(packed_loader()))
    assert _pack_fill(batch) == (batch["meta"]["total_tokens"], 128)
    assert 0 < batch["meta"]["total_tokens"] <= 128
    padding = {**batch, "meta": {**batch["meta"], "padding": True, "total_tokens": 0}}
    assert _pack_fill(padding) is None
    assert _pack_fill({"input_ids": batch["input_ids"]}) is None  # no meta
    assert _pack_fill({"meta": {"total_tokens": 5}}) is None  # no input_ids
    assert _pack_fill((batch["input_ids"], batch["labels"])) is None  # not a dict
    assert _pack_fill({**batch, "meta": {"pack_id": 3}}) is None  # no token count
