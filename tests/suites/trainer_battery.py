"""Trainer battery: small real trainings of the example VLM, one per Lightning flag, as a new
user would try them.

Each case is a real CPU fit (2 ranks on gloo unless the case says otherwise) of
``examples.vlm.ToyVLM`` at the size of the multi-process tests, with seq_len 128 and a few hundred
synthetic samples, under ``strategy="vlmbalance"`` (mode overlap) unless the case says otherwise.
A case has an explicit expectation: exit code 0 and properties checked from the JSON records every
rank writes (optimizer steps, the ``(epoch, pack_id, sample_ids)`` of every pack trained on, the
validation / test / predict packs, gradient norms, TensorBoard tags...), or a failure whose output
holds given strings. It runs under a wall-clock cap; over the cap its whole process group is
killed and it counts as HANG. A rank still alive 15 s after rank 0 exited is a HANG too.

Commands (from the repository root)::

    python -m tests.suites.trainer_battery                          # every case, a table
    python -m tests.suites.trainer_battery --cases accumulate_1,bad_length_table --json
    python -m tests.suites.trainer_battery --list

With ``--json`` the last line of stdout is one JSON object: ``cases`` (``name``, ``status``
PASS/FAIL/HANG, ``seconds``, ``reason``), ``passed``, ``failed``, ``hung``, ``seconds``.

Internally each case re-runs this module as its job, ``python -m tests.suites.trainer_battery
--job CASE --out DIR [--phase K]`` (Lightning's DDP launcher re-executes that command line for
rank 1), through :func:`harness.jobs.run_jobs` (a session of its own, killed as a group at the
cap); the job writes ``DIR/{tag}.rank{r}.json``, and its first process, the session's leader,
``DIR/phase{K}.pgid``: the process group in which the runner looks for ranks left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

import lightning_vlmbalance as vb
from examples.vlm import (
    SMALL_VLM,  # the example VLM at the tests' size
    ToyVLM,
)
from harness.jobs import run_jobs
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table

MODULE = "tests.suites.trainer_battery"
SEQ_LEN = 128
BAD_INDEX = 17  # the sample the bad-input cases break
ORPHAN_GRACE_S = 15.0

# ------------------------------------------------------------------------------------------------
# expectations: each check reads the records of one case and returns None or what is wrong

Records = dict[str, list[dict[str, Any]]]  # tag -> one record per rank, by rank
Check = Callable[[Records], "str | None"]


def _pairs(rec: dict[str, Any]) -> list[tuple[int, int]]:
    return [(e, p) for e, p, *_ in rec["train"]]


def _by_epoch(recs: list[dict[str, Any]]) -> dict[int, list[list[int]]]:
    """epoch -> the sample-id lists of the packs every rank trained on in it."""
    out: dict[int, list[list[int]]] = {}
    for rec in recs:
        for epoch, _, ids, _ in rec["train"]:
            out.setdefault(epoch, []).append(ids)
    return out


def steps(n: int, tag: str = "fit") -> Check:
    def check(r: Records) -> str | None:
        got = [rec["global_step"] for rec in r[tag]]
        return None if set(got) == {n} else f"{tag}: global_step {got} per rank, expected {n}"

    return check


def packs(per_rank: int, epochs: int = 1, tag: str = "fit") -> Check:
    """Every rank trained ``per_rank`` packs in each of ``epochs`` epochs."""

    def check(r: Records) -> str | None:
        got = [Counter(e for e, *_ in rec["train"]) for rec in r[tag]]
        want = Counter({e: per_rank for e in range(epochs)})
        return None if all(c == want for c in got) else f"{tag}: packs per epoch {got}"

    return check


def exactly_once(r: Records) -> str | None:
    """Every complete epoch trains every sample exactly once over the ranks."""
    n = r["fit"][0]["num_samples"]
    for epoch, lists in _by_epoch(r["fit"]).items():
        ids = sorted(i for ids in lists for i in ids)
        if ids != list(range(n)):
            seen = Counter(ids)
            twice = sorted(i for i, c in seen.items() if c > 1)[:5]
            missing = sorted(set(range(n)) - set(seen))[:5]
            return f"epoch {epoch}: {len(ids)} ids for {n} samples, twice {twice} missing {missing}"
    return None


def same_packs_each_epoch(epochs: int) -> Check:
    def check(r: Records) -> str | None:
        per_epoch = [
            sorted(p for rec in r["fit"] for e, p in _pairs(rec) if e == k) for k in range(epochs)
        ]
        if not per_epoch[0] or any(s != per_epoch[0] for s in per_epoch):
            return f"pack ids per epoch differ: {per_epoch}"
        return None

    return check


def val_runs(runs: int, batches: int | None = None, covers: bool = True) -> Check:
    """``runs`` validation runs after the sanity check, each of ``batches`` batches per rank; with
    ``covers`` each run sees every validation sample exactly once over the ranks."""

    def check(r: Records) -> str | None:
        per_rank = [[v for v in rec["val"] if not v["sanity"]] for rec in r["fit"]]
        if any(len(v) != runs for v in per_rank):
            return f"validation runs per rank {[len(v) for v in per_rank]}, expected {runs}"
        for k in range(runs):
            sizes = [len(v[k]["packs"]) for v in per_rank]
            if batches is not None and set(sizes) != {batches}:
                return f"validation run {k}: {sizes} batches per rank, expected {batches}"
            ids = sorted(i for v in per_rank for _, ids in v[k]["packs"] for i in ids)
            if covers and ids != list(range(r["fit"][0]["val_samples"])):
                return f"validation run {k} saw {len(ids)} sample ids, not each sample once"
        return None

    return check


def eval_stages(r: Records) -> str | None:
    """validate / test / predict after fit: each sees every validation sample once over ranks."""
    n = r["fit"][0]["val_samples"]
    for stage in ("validate", "test", "predict"):
        runs = [rec.get(stage) for rec in r["fit"]]
        if any(not run for run in runs):
            return f"trainer.{stage}: no batch recorded on some rank"
        ids = sorted(i for run in runs for _, ids in run for i in ids)
        if ids != list(range(n)):
            return f"trainer.{stage}: {len(ids)} sample ids for {n} samples"
    outs = [rec["predictions"] for rec in r["fit"]]
    lens = [len(rec["predict"]) for rec in r["fit"]]
    return None if outs == lens else f"trainer.predict returned {outs} items for {lens} batches"


def clipped(max_norm: float, must_trigger: bool) -> Check:
    """Norms after clipping are at most ``max_norm``, and unchanged where they were below it."""

    def check(r: Records) -> str | None:
        for rec in r["fit"]:
            pairs = list(zip(rec["norms_pre"], rec["norms_post"]))
            if not pairs:
                return "no optimizer step recorded"
            if max(post for _, post in pairs) > max_norm * (1 + 1e-3):
                return f"rank {rec['rank']}: norms (before, after clipping) {pairs}"
            if any(pre <= max_norm and abs(post - pre) > 1e-4 * pre for pre, post in pairs):
                return f"rank {rec['rank']}: a norm below the limit changed: {pairs}"
            if must_trigger and max(pre for pre, _ in pairs) <= max_norm:
                return f"clipping never triggered: norms before clipping {rec['norms_pre']}"
        return None

    return check


def stopped_by_time(seconds: float, slack: float = 30.0) -> Check:
    def check(r: Records) -> str | None:
        took = [rec["train_s"] for rec in r["fit"]]
        epochs = [rec["current_epoch"] for rec in r["fit"]]
        if not all(seconds - 0.5 <= t <= seconds + slack for t in took):
            return f"training took {took} s for max_time {seconds} s"
        return None if max(epochs) < 100 else f"ran all {epochs} epochs"

    return check


def resumed_like_uninterrupted(r: Records) -> str | None:
    """Each resumed run trains the same (epoch, pack_id) sequence as the uninterrupted run from
    the checkpoint on, on every rank, and ends at the same step."""
    for tag in sorted(t for t in r if t.startswith("phase")):
        for full, part in zip(r["fit"], r[tag]):
            at = part.get("resumed_at")
            if at is None:
                return f"{tag}: the resumed run did not restore the recorder state"
            if _pairs(part) != _pairs(full)[at:] or part["global_step"] != full["global_step"]:
                return (
                    f"{tag} rank {part['rank']} (resumed after {at} packs): first packs"
                    f" {_pairs(part)[:4]} vs uninterrupted {_pairs(full)[at : at + 4]}"
                )
    return None


def two_fits(steps_each: int) -> Check:
    def check(r: Records) -> str | None:
        if "fit2" not in r:
            return "the second fit wrote no record"
        pids = {rec["pid"] for tag in ("fit", "fit2") for rec in r[tag]}
        if len(pids) != 2:
            return f"{len(pids)} processes ran the fits (expected the same 2)"
        if [_pairs(rec) for rec in r["fit2"]] != [_pairs(rec) for rec in r["fit"]]:
            return "the second fit (same seed and data) trained other packs than the first"
        return steps(steps_each, "fit2")(r)

    return check


def strategy_is(name: str, mode: str | None) -> Check:
    def check(r: Records) -> str | None:
        got = {(rec["strategy"], rec["mode"]) for rec in r["fit"]}
        return None if got == {(name, mode)} else f"strategy {got}, expected {(name, mode)}"

    return check


def tensorboard_tags(*prefixes: str) -> Check:
    def check(r: Records) -> str | None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        out = Path(r["fit"][0]["out"])
        files = sorted(out.glob("tb/**/events.out.tfevents.*"))
        if not files:
            return "no TensorBoard event file under tb/"
        tags: set[str] = set()
        for f in files:
            tags |= set(EventAccumulator(str(f)).Reload().Tags()["scalars"])
        missing = [p for p in prefixes if not any(t.startswith(p) for t in tags)]
        return f"no scalar tag starting with {missing} in {sorted(tags)}" if missing else None

    return check


def common(r: Records, devices: int) -> str | None:
    """Every case: a record per rank, finite losses, the loss weighted for this Trainer's (ranks,
    accumulation), all ranks at the same step."""
    for tag, recs in r.items():
        if [rec["rank"] for rec in recs] != list(range(devices)):
            return f"{tag}: records from ranks {[rec['rank'] for rec in recs]}"
        for rec in recs:
            want = [rec["world_size"], rec["accumulate"]]
            bad = [w for *_, w in rec["train"] if w != want]
            if bad:
                return f"{tag} rank {rec['rank']}: packs weighted for {bad[0]}, expected {want}"
            if rec["nonfinite"]:
                return f"{tag} rank {rec['rank']}: {rec['nonfinite']} non-finite losses"
        if len({rec["global_step"] for rec in recs}) != 1:
            return f"{tag}: ranks end at steps {[rec['global_step'] for rec in recs]}"
        if not any(rec["train"] for rec in recs) and tag.startswith(("fit", "phase0")):
            return f"{tag}: no pack trained"
    return None


# ------------------------------------------------------------------------------------------------
# the case table


@dataclass(kw_only=True, slots=True)
class Case:
    """One Trainer configuration and what it must do.

    ``strategy``: ``"vlmbalance"`` (the registered name: mode overlap), ``"sync"`` / ``"off"``
    (``VLMBalanceStrategy(mode=...)``), or any other Trainer strategy string. ``data``:
    :class:`BatteryData` arguments. ``flow``: ``fit``; ``eval`` (validate, test and predict after
    fit); ``two_fits`` (a second Trainer in the same script); ``cli`` (LightningCLI); ``resume``
    (phase 0 checkpoints, phases 1.. resume from a checkpoint in epoch 0, then epoch 1).
    ``extras``: ``callbacks`` (the package's three), ``moe`` (``CompiledMoERouting`` only),
    ``tensorboard``. ``error``: strings the
    output of a failing run must hold (then exit code 0 is a FAIL).
    """

    name: str
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: str = "vlmbalance"
    devices: int = 2
    data: dict[str, Any] = field(default_factory=dict)
    flow: str = "fit"
    extras: tuple[str, ...] = ()
    expect: tuple[Check, ...] = ()
    error: tuple[str, ...] = ()
    cap_s: float = 120.0

    @property
    def phases(self) -> int:
        return 3 if self.flow == "resume" else 1


VAL = {"val_samples": 64}
CASES = [
    Case(name="accumulate_1", trainer={"max_steps": 10}, expect=(steps(10), packs(10))),
    Case(
        name="accumulate_3",
        trainer={"max_steps": 5, "accumulate_grad_batches": 3},
        expect=(steps(5), packs(15)),
    ),
    Case(
        name="gradient_clip",
        trainer={"max_steps": 6, "gradient_clip_val": 1.0, "accumulate_grad_batches": 2},
        expect=(steps(6), clipped(1.0, must_trigger=False)),
    ),
    Case(
        name="gradient_clip_0.1",
        trainer={"max_steps": 6, "gradient_clip_val": 0.1, "accumulate_grad_batches": 2},
        expect=(steps(6), clipped(0.1, must_trigger=True)),
    ),
    Case(
        name="bf16_mixed", trainer={"max_steps": 6, "precision": "bf16-mixed"}, expect=(steps(6),)
    ),
    Case(
        name="bf16_mixed_compiled_moe",
        trainer={"max_steps": 6, "precision": "bf16-mixed"},
        extras=("moe",),
        expect=(steps(6),),
        cap_s=240.0,
    ),
    Case(name="bf16_true", trainer={"max_steps": 6, "precision": "bf16-true"}, expect=(steps(6),)),
    Case(
        name="val_check_interval",
        trainer={"max_steps": 10, "val_check_interval": 4},
        data=VAL,
        expect=(steps(10), val_runs(2)),
    ),
    Case(
        name="check_val_every_n_epoch",
        trainer={"max_epochs": 2, "check_val_every_n_epoch": 2},
        data={**VAL, "samples": 150},
        expect=(val_runs(1), exactly_once),
    ),
    Case(
        name="max_steps",
        trainer={"max_steps": 7, "accumulate_grad_batches": 2},
        expect=(steps(7), packs(14)),
    ),
    Case(
        name="max_epochs_2",
        trainer={"max_epochs": 2, "accumulate_grad_batches": 2},
        data={"samples": 200},
        expect=(exactly_once,),
    ),
    Case(
        name="max_time",
        trainer={"max_time": "00:00:00:08", "accumulate_grad_batches": 2},
        expect=(stopped_by_time(8.0),),
    ),
    Case(
        name="checkpoint_resume",
        trainer={"max_epochs": 2, "accumulate_grad_batches": 2},
        data={"samples": 200},
        flow="resume",
        expect=(resumed_like_uninterrupted,),
        cap_s=240.0,
    ),
    Case(
        name="limit_train_batches_7_accumulate_3",
        trainer={"max_epochs": 2, "limit_train_batches": 7, "accumulate_grad_batches": 3},
        expect=(steps(6), packs(7, epochs=2)),
    ),
    Case(
        name="limit_val_batches",
        trainer={"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2},
        data=VAL,
        expect=(steps(6), val_runs(2, batches=2, covers=False)),
    ),
    Case(
        name="fast_dev_run",
        trainer={"fast_dev_run": True, "accumulate_grad_batches": 2},
        data=VAL,
        expect=(steps(1), packs(1), val_runs(1, batches=1, covers=False)),
    ),
    Case(
        name="overfit_batches_4",
        trainer={"max_epochs": 3, "overfit_batches": 4, "accumulate_grad_batches": 2},
        expect=(packs(4, epochs=3), same_packs_each_epoch(3)),
    ),
    Case(
        name="overfit_batches_0.1",
        trainer={"max_epochs": 3, "overfit_batches": 0.1},
        expect=(same_packs_each_epoch(3),),
    ),
    Case(
        name="num_workers_2",
        trainer={"max_epochs": 1, "accumulate_grad_batches": 2},
        data={"samples": 160, "num_workers": 2},
        expect=(exactly_once,),
    ),
    Case(
        name="lightning_cli_sync",
        flow="cli",
        expect=(steps(4), strategy_is("VLMBalanceStrategy", "sync")),
    ),
    Case(
        name="devices_1",
        devices=1,
        trainer={"max_steps": 5, "accumulate_grad_batches": 2},
        expect=(steps(5), packs(10)),
    ),
    Case(
        name="all_callbacks_tensorboard",
        trainer={"max_steps": 6, "accumulate_grad_batches": 2, "log_every_n_steps": 1},
        extras=("callbacks", "tensorboard"),
        expect=(
            steps(6),
            tensorboard_tags("train/loss", "straggler/", "balance/", "moe/", "offload/"),
        ),
        cap_s=240.0,
    ),
    Case(
        name="ddp_with_trainer_loader",
        strategy="ddp",
        trainer={"max_steps": 5, "accumulate_grad_batches": 2},
        expect=(steps(5), packs(10), strategy_is("DDPStrategy", None)),
    ),
    Case(
        name="mode_sync",
        strategy="sync",
        trainer={"max_steps": 6, "accumulate_grad_batches": 2},
        expect=(steps(6), strategy_is("VLMBalanceStrategy", "sync")),
    ),
    Case(
        name="mode_off",
        strategy="off",
        trainer={"max_steps": 6, "accumulate_grad_batches": 2},
        expect=(steps(6), strategy_is("VLMBalanceStrategy", "off")),
    ),
    Case(
        name="exactly_once_epoch",
        trainer={"max_epochs": 1, "accumulate_grad_batches": 2},
        expect=(exactly_once,),
    ),
    Case(
        name="validate_test_predict_after_fit",
        trainer={"max_steps": 4},
        data=VAL,
        flow="eval",
        expect=(steps(4), eval_stages),
    ),
    Case(
        name="two_fits_in_a_row",
        trainer={"max_steps": 3},
        flow="two_fits",
        expect=(steps(3), two_fits(3)),
    ),
    Case(
        name="bad_length_table",
        trainer={"max_steps": 3},
        data={"bad": "nan_length"},
        error=("ValueError", f"sample {BAD_INDEX}", "'total_tokens'"),
    ),
    Case(
        name="bad_sample",
        trainer={"max_epochs": 1},
        data={"bad": "no_input_ids"},
        error=("ValueError", f"sample {BAD_INDEX}", "'input_ids'"),
    ),
    Case(
        name="ddp_loader_without_trainer",
        strategy="ddp",
        trainer={"max_steps": 3, "accumulate_grad_batches": 2},
        data={"with_trainer": False},
        error=("ValueError", "trainer=self.trainer"),
    ),
]
BY_NAME = {c.name: c for c in CASES}

# ------------------------------------------------------------------------------------------------
# the job: one case's fit(s) in this process (Lightning re-executes it for rank 1)


class _WithoutInputIds(Dataset):
    """The dataset, with sample ``BAD_INDEX`` missing its ``input_ids`` (a broken item)."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = dict(self.inner[i])
        if i == BAD_INDEX:
            del sample["input_ids"]
        return sample


class BatteryData(L.LightningDataModule):
    """Synthetic samples packed by ``PackingSampler``; validation, test and predict read a
    separate table of ``val_samples`` samples."""

    def __init__(
        self,
        samples: int = 300,
        val_samples: int = 0,
        num_workers: int = 0,
        with_trainer: bool = True,
        bad: str = "",
    ) -> None:
        super().__init__()
        self.samples, self.val_samples, self.num_workers = samples, val_samples, num_workers
        self.with_trainer, self.bad = with_trainer, bad

    def _loader(self, samples: int, seed: int, train: bool) -> vb.PackedDataLoader:
        table = synthetic_length_table(
            samples, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=seed
        )
        dataset: Dataset = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
        total: Any = table.total_tokens
        if train and self.bad == "nan_length":  # e.g. a length column read with a gap
            total = table.total_tokens.astype(np.float64)
            total[BAD_INDEX] = np.nan
        if train and self.bad == "no_input_ids":
            dataset = _WithoutInputIds(dataset)
        sampler = vb.PackingSampler(total, table.image_tokens, seq_len=SEQ_LEN, seed=3, window=64)
        return vb.PackedDataLoader(
            dataset,
            sampler,
            vb.PackCollator(SEQ_LEN, image_feature_shape=(8,)),
            trainer=self.trainer if self.with_trainer or not train else None,
            num_workers=self.num_workers if train else 0,
        )

    def train_dataloader(self) -> vb.PackedDataLoader:
        return self._loader(self.samples, 1, train=True)

    def val_dataloader(self) -> Any:
        return self._loader(self.val_samples, 2, train=False) if self.val_samples else []

    test_dataloader = predict_dataloader = val_dataloader


class BatteryVLM(ToyVLM):
    """The example VLM with the evaluation steps a user would add."""

    def __init__(self, dim: int = SMALL_VLM["dim"]) -> None:
        super().__init__(**{**SMALL_VLM, "dim": dim}, max_positions=SEQ_LEN)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        out = vb.packed_cross_entropy(self(batch), batch, module=self)
        if out.mean is not None:
            self.log("val/loss", out.mean, batch_size=out.loss_tokens)

    test_step = validation_step

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        out = vb.packed_cross_entropy(self(batch), batch, module=self)
        return {"pack_id": batch["meta"]["pack_id"], "loss_sum": float(out.loss_sum)}


class Recorder(L.Callback):
    """Writes ``OUT/{tag}.rank{r}.json`` after every stage: what this rank trained on and saw."""

    def __init__(self, out: str, tag: str) -> None:
        self.path, self.t0 = Path(out), 0.0
        self.rec: dict[str, Any] = {"out": out, "tag": tag, "pid": os.getpid(), "train": []}
        self.rec.update(val=[], norms_pre=[], norms_post=[], nonfinite=0, train_s=0.0)

    def _batch(self, batch: dict[str, Any]) -> list[Any]:
        meta = batch["meta"]
        return [int(meta["pack_id"]), [int(i) for i in meta["sample_ids"]]]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        pack = self._batch(batch)
        weighted = [int(w) for w in batch["meta"].get("weighted_for", (1, 1))]
        self.rec["train"].append([trainer.current_epoch, *pack, weighted])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rec["nonfinite"] += int(not torch.isfinite(loss).all())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, opt: Any) -> None:
        self.rec["norms_pre"].append(self._grad_norm(pl_module))  # Lightning clips after this

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: Any, opt: Any) -> None:
        if self.rec["norms_pre"] and len(self.rec["norms_post"]) < len(self.rec["norms_pre"]):
            self.rec["norms_post"].append(self._grad_norm(pl_module))  # the step's, clipped

    @staticmethod
    def _grad_norm(module: L.LightningModule) -> float:
        grads = [p.grad.float().norm() for p in module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        run = {"sanity": trainer.sanity_checking, "epoch": trainer.current_epoch, "packs": []}
        self.rec["val"].append(run)
        if trainer.state.fn == "validate":
            self.rec["validate"] = run["packs"]

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *_: Any) -> None:
        self.rec["val"][-1]["packs"].append(self._batch(batch))

    def on_test_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, *_: Any) -> None:
        self.rec.setdefault("test", []).append(self._batch(batch))

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *_: Any) -> None:
        self.rec.setdefault("predict", []).append(self._batch(batch))

    def state_dict(self) -> dict[str, Any]:
        return {"trained": len(self.rec["train"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rec["resumed_at"] = int(state_dict["trained"])

    def dump(self, trainer: L.Trainer) -> None:
        strategy = trainer.strategy
        self.rec.update(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            accumulate=int(trainer.accumulate_grad_batches),
            global_step=trainer.global_step,
            current_epoch=trainer.current_epoch,
            strategy=type(strategy).__name__,
            mode=getattr(strategy, "mode", None),
        )
        data = trainer.datamodule
        if data is not None:
            self.rec.update(num_samples=data.samples, val_samples=data.val_samples)
        path = self.path / f"{self.rec['tag']}.rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.rec))

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.rec["train_s"] = time.perf_counter() - self.t0
        self.dump(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.dump(trainer)

    def on_test_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.dump(trainer)

    def on_predict_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.dump(trainer)


def _trainer(case: Case, out: Path, recorder: Recorder, checkpoints: bool) -> L.Trainer:
    strategy: Any = case.strategy
    if case.strategy in ("sync", "off"):
        strategy = vb.VLMBalanceStrategy(mode=case.strategy)
    callbacks: list[Any] = [recorder]
    if "callbacks" in case.extras:
        callbacks += [
            vb.StragglerMonitor(log_every_n_steps=1),
            vb.ActivationOffload(test_mode=True, log_every_n_steps=1),
        ]
    if {"callbacks", "moe"} & set(case.extras):
        callbacks.append(vb.CompiledMoERouting(backend="aot_eager", log_every_n_steps=1))
    if checkpoints:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1
            )
        )
    logger: Any = False
    if "tensorboard" in case.extras:
        logger = L.pytorch.loggers.TensorBoardLogger(out / "tb", name="battery")
    return L.Trainer(
        accelerator="cpu",
        devices=case.devices,
        strategy=strategy,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        **case.trainer,
    )


def _resume_from(out: Path, phase: int) -> str:
    """Phase 1: the first checkpoint (mid epoch 0); phase 2: the first one in epoch 1."""
    found = []
    for path in (out / "ckpt").glob("*.ckpt"):
        m = re.fullmatch(r"epoch=(\d+)-step=(\d+)\.ckpt", path.name)
        if m and int(m[1]) == phase - 1:
            found.append((int(m[2]), str(path)))
    if not found:
        raise FileNotFoundError(f"no checkpoint of epoch {phase - 1} in {out / 'ckpt'}")
    return min(found)[1]


def _cli(case: Case, out: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = out / "cli.yaml"
    text = (
        "seed_everything: 0\ntrainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: 4\n"
        "  accumulate_grad_batches: 2\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  enable_model_summary: false\n  strategy:\n"
        "    class_path: lightning_vlmbalance.VLMBalanceStrategy\n    init_args:\n"
        "      mode: sync\nmodel:\n  dim: 16\ndata:\n  samples: 300\n"
    )
    tmp = out / f"cli.yaml.{os.getpid()}"  # both ranks write it: atomically
    tmp.write_text(text)
    os.replace(tmp, config)
    LightningCLI(
        BatteryVLM,
        BatteryData,
        args=["fit", "--config", str(config)],
        save_config_callback=None,
        trainer_defaults={"callbacks": [Recorder(str(out), "fit")]},
    )


def run_job(case: Case, out: Path, phase: int) -> None:
    torch.set_num_threads(1)  # one core per rank: two ranks must not fight over two cores
    if case.flow == "cli":
        return _cli(case, out)
    for fit in range(2 if case.flow == "two_fits" else 1):
        L.seed_everything(0, verbose=False)
        tag = f"phase{phase}" if phase else "fit2" if fit else "fit"
        recorder = Recorder(str(out), tag)
        trainer = _trainer(case, out, recorder, checkpoints=case.flow == "resume" and not phase)
        model, data = BatteryVLM(), BatteryData(**case.data)
        ckpt = _resume_from(out, phase) if phase else None
        trainer.fit(model, datamodule=data, ckpt_path=ckpt)
        if case.flow == "eval":
            trainer.validate(model, datamodule=data)
            trainer.test(model, datamodule=data)
            recorder.rec["predictions"] = len(trainer.predict(model, datamodule=data) or [])
            recorder.dump(trainer)
    return None


# ------------------------------------------------------------------------------------------------
# the runner: each case in its own process group, under its cap


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` still running (zombies excluded)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_phase(case: Case, out: Path, phase: int, deadline: float) -> tuple[str, int | None]:
    """Runs one job (``harness.jobs``: its own session, killed as a group at the deadline) with
    its output in ``phase{K}.log``; returns ("ok"|"hang"|"orphan", returncode)."""
    name = f"{case.name}.phase{phase}"
    args = ("--job", case.name, "--out", str(out), "--phase", str(phase))
    job = run_jobs(
        {name: (MODULE, *args)},
        parallel=1,
        timeout=max(deadline - time.monotonic(), 1.0),
        envs={name: {"PYTHONUNBUFFERED": "1"}},
    )[name]
    (out / f"phase{phase}.log").write_text(job.stdout + job.stderr)
    if job.timed_out:
        return "hang", None
    pgid_file = out / f"phase{phase}.pgid"  # absent: the job ended before it could start ranks
    pgid = int(pgid_file.read_text()) if pgid_file.exists() else None
    if pgid is None:
        return "ok", job.returncode
    grace = min(time.monotonic() + ORPHAN_GRACE_S, deadline)
    while _alive_in_group(pgid) and time.monotonic() < grace:
        time.sleep(0.5)
    left = _alive_in_group(pgid)
    _kill_group(pgid)
    return ("orphan" if left else "ok"), job.returncode


def _load(out: Path) -> Records:
    records: Records = {}
    for path in sorted(out.glob("*.rank*.json")):
        rec = json.loads(path.read_text())
        records.setdefault(rec["tag"], []).append(rec)
    for recs in records.values():
        recs.sort(key=lambda rec: rec["rank"])
    return records


def _error_line(text: str, needle: str = "") -> str:
    """The first error line holding ``needle``, else the last error line (or output line)."""
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"\w(Error|Exception)\b", ln)]
    hits = [ln for ln in lines if needle and needle in ln]
    line = hits[0] if hits else (lines or text.strip().splitlines() or ["no output"])[-1]
    return line[:300]


def run_case(case: Case, root: Path) -> dict[str, Any]:
    out = root / case.name
    shutil.rmtree(out, ignore_errors=True)  # no stale record from an earlier --keep run
    out.mkdir(parents=True)
    start = time.monotonic()
    deadline = start + case.cap_s
    status, reason = "PASS", ""
    for phase in range(case.phases):
        state, rc = _run_phase(case, out, phase, deadline)
        text = (out / f"phase{phase}.log").read_text(errors="replace")
        if state == "hang":
            status, reason = "HANG", f"phase {phase} over the {case.cap_s:.0f} s cap, killed"
            break
        if state == "orphan":
            status = "HANG"
            reason = f"phase {phase}: rank 0 exited (rc {rc}) but a rank process was still alive"
            break
        if case.error:
            missing = [s for s in case.error if s not in text]
            if rc == 0 or missing:
                status = "FAIL"
                reason = f"rc {rc}; missing {missing} in the output; last: {_error_line(text)}"
            else:
                reason = f"rc {rc}: {_error_line(text, case.error[-1])}"
            break
        if rc != 0:
            status, reason = "FAIL", f"phase {phase} rc {rc}: {_error_line(text)}"
            break
    if status == "PASS" and not case.error:
        try:
            records = _load(out)
            problem = common(records, case.devices) if "fit" in records else "no record written"
            for check in case.expect:
                problem = problem or check(records)
        except (KeyError, IndexError, ValueError) as err:
            problem = f"records unreadable: {type(err).__name__}: {err}"
        if problem:
            status, reason = "FAIL", problem
        else:
            steps_ = [recs[0]["global_step"] for recs in records.values()]
            reason = f"ok: steps {steps_}, packs/rank {len(records['fit'][0]['train'])}"
    return {
        "name": case.name,
        "status": status,
        "seconds": round(time.monotonic() - start, 1),
        "reason": reason,
    }


def _table(rows: list[dict[str, Any]], w: int = 0) -> str:
    w = max([w, *(len(r["name"]) for r in rows)])
    lines = [f"{'case':<{w}}  status  seconds  reason"]
    lines += [
        f"{r['name']:<{w}}  {r['status']:<6}  {r['seconds']:>7.1f}  {r['reason']}" for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", help="comma list of case names (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--list", action="store_true", help="list the case names and exit")
    p.add_argument("--keep", help="keep every case's records and logs under this folder")
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--phase", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        if os.getpid() == os.getsid(0):  # the runner's job, not a rank Lightning started
            (Path(args.out) / f"phase{args.phase}.pgid").write_text(str(os.getpgrp()))
        run_job(BY_NAME[args.job], Path(args.out), args.phase)
        return None
    if args.list:
        print("\n".join(BY_NAME))
        return None
    names = args.cases.split(",") if args.cases else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown cases {unknown}; --list shows them")
    root = Path(args.keep or tempfile.mkdtemp(prefix="trainer_battery_"))
    start, rows = time.monotonic(), []
    for name in names:
        rows.append(run_case(BY_NAME[name], root))
        if not args.json:
            lines = _table(rows, max(map(len, names))).splitlines()
            print("\n".join(lines if len(rows) == 1 else lines[-1:]), flush=True)
    count = Counter(r["status"] for r in rows)
    result = {
        "cases": rows,
        "passed": count["PASS"],
        "failed": count["FAIL"],
        "hung": count["HANG"],
        "seconds": round(time.monotonic() - start, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
    }
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(_table(rows))
        print(json.dumps(result))
    else:
        print(
            f"{result['passed']} passed, {result['failed']} failed, {result['hung']} hung in"
            f" {result['seconds']} s" + (f"; records in {root}" if args.keep else "")
        )
    return result


if __name__ == "__main__":
    main()
