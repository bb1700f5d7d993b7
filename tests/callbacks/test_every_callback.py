"""Every callback of the package through the same checks, as composer does for its methods:

- world size 1 (an in-process ``Trainer``) and 2 (one subprocess fit with
  ``strategy="vlmbalance"`` and all callbacks at once, shared by the module's tests; with
  ``pytest -m suite``: in CI, test_strategy.py's bf16 fit runs every callback on 2 ranks);
- disabled = no-op: a callback constructed with nothing to do leaves the parameters bitwise those
  of a fit without it (float64, same seed);
- resume: fit, checkpoint after step 2, resume: the callback's state comes back, training
  continues, and the parameters are bitwise those of the uninterrupted fit;
- cleanup after an exception: every forward, hook and loop method a callback patched is
  restored and no thread is left.

A callback that leaves the math unchanged (StragglerMonitor, ActivationOffload) also leaves the
parameters bitwise equal to a fit without it; CompiledMoERouting changes the rounding only.
Adding a callback to the package means adding it to ``CALLBACKS`` (``every_callback_job.py``)
and a ``Case`` here.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_vlmbalance as vb
from tests.callbacks.every_callback_job import CALLBACKS, NOTHING_LEFT, Observer, leftovers
from tests.cpu_fit import Float64VLM, packed_loader
from tests.launch import run_module
from tests.packing.lightning_job import SMALL_VLM

STEPS = 4  # optimizer steps of 2 micro-batches; the checkpoint to resume from is at step 2
MOE_VLM = SMALL_VLM  # the example VLM with an MoE feed-forward, small
DENSE_VLM = {**SMALL_VLM, "moe_experts": 0}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the tiny ops only fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- what each callback does, and what "nothing to do" means for it -----------------------------


def _jsonl(cb: vb.StragglerMonitor) -> list[dict]:
    return [json.loads(x) for x in cb.jsonl_path.read_text().splitlines()]


def _monitor_worked(cb: vb.StragglerMonitor, trainer: L.Trainer, first_step: int) -> None:
    rows = _jsonl(cb)
    assert [r["global_step"] for r in rows] == list(range(first_step + 1, STEPS + 1))
    assert all(r["micro_batches"] == 2 for r in rows)
    assert cb.steps_timed == STEPS  # totals include the steps before a resume


def _offload_worked(cb: vb.ActivationOffload, trainer: L.Trainer, first_step: int) -> None:
    stats = cb.last_stats
    assert stats["offloaded_tensors"] > 0 and stats["reloaded_tensors"] > 0
    assert stats["live_handles"] == 0 and stats["pool_in_use_bytes"] == 0
    assert "offload/offloaded_mib_total" in trainer.logged_metrics


def _routing_worked(cb: vb.CompiledMoERouting, trainer: L.Trainer, first_step: int) -> None:
    assert {"moe/lb_loss", "moe/max_load", "moe/llm.blocks.0.ffn/lb_loss"} <= set(
        trainer.logged_metrics
    )
    assert float(trainer.logged_metrics["moe/max_load"]) >= 1.0


def _monitor_idle(cb: vb.StragglerMonitor, warned: list[str]) -> None:
    assert cb.steps_timed == 0 and _jsonl(cb) == []


def _offload_idle(cb: vb.ActivationOffload, warned: list[str]) -> None:
    # the hooks were active (the offloader existed) but nothing reached min_bytes
    assert cb.last_stats["offloaded_tensors"] == 0 and cb.last_stats["live_handles"] == 0


def _routing_idle(cb: vb.CompiledMoERouting, warned: list[str]) -> None:
    assert cb.patched == []
    assert any("found no MoE module it knows" in w for w in warned), warned


def _ws2_monitor(rank: dict, first_step: int) -> None:
    rows = rank["jsonl"]
    assert [r["global_step"] for r in rows] == list(range(first_step + 1, STEPS + 1))
    assert all(r["world_size"] == 2 and r["micro_batches"] == 2 for r in rows)
    assert rank["summary"]["steps_timed"] == STEPS


def _ws2_offload(rank: dict, first_step: int) -> None:
    assert rank["offloading"] == rank["micro_batches"]  # active in every training forward
    assert rank["offload_stats"]["offloaded_tensors"] > 0
    assert rank["offload_stats"]["live_handles"] == 0 and not rank["offloader_left"]


def _ws2_routing(rank: dict, first_step: int) -> None:
    assert rank["patched"] == rank["micro_batches"]  # the sorted dispatch in every micro-batch
    assert rank["patched_left"] == 0
    if rank["rank"] == 0:
        assert {"moe/lb_loss", "moe/max_load"} <= set(rank["logged"])


def _disabled_monitor(out: Path) -> vb.StragglerMonitor:
    monitor = CALLBACKS["StragglerMonitor"](out)
    monitor.enabled = False
    return monitor


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    worked: Callable[[Any, L.Trainer, int], None]  # (callback, trainer, step it started from)
    worked_on_rank: Callable[[dict, int], None]  # (a rank's report of the 2-rank job, start step)
    idle: Callable[[Path], Callback]  # constructed, with nothing to do
    idle_model: dict[str, Any]
    was_idle: Callable[[Any, list[str]], None]  # (callback, warnings of the fit)
    same_math: bool  # bitwise the same parameters as without it

    def make(self, out: Path) -> Callback:
        return CALLBACKS[self.name](out)


CASES = [
    Case(
        name="StragglerMonitor",
        worked=_monitor_worked,
        worked_on_rank=_ws2_monitor,
        idle=_disabled_monitor,
        idle_model=MOE_VLM,
        was_idle=_monitor_idle,
        same_math=True,
    ),
    Case(
        name="ActivationOffload",
        worked=_offload_worked,
        worked_on_rank=_ws2_offload,
        # on this small model nothing reaches the default min_bytes of 1 MiB
        idle=lambda out: vb.ActivationOffload(test_mode=True),
        idle_model=MOE_VLM,
        was_idle=_offload_idle,
        same_math=True,
    ),
    Case(
        name="CompiledMoERouting",
        worked=_routing_worked,
        worked_on_rank=_ws2_routing,
        idle=CALLBACKS["CompiledMoERouting"],
        idle_model=DENSE_VLM,  # no MoE layer to patch
        was_idle=_routing_idle,
        same_math=False,
    ),
]
assert sorted(c.name for c in CASES) == sorted(CALLBACKS) == sorted(vb.callbacks.__all__), (
    "every callback of the package goes through these tests"
)
IDS = [c.name for c in CASES]


# -- world size 1: in-process fits --------------------------------------------------------------


@dataclass
class Fit:
    out: Path
    model: L.LightningModule
    trainer: L.Trainer
    observer: Observer
    warned: list[str]
    left: dict[str, Any]  # what was left behind after fit (see ``leftovers``)
    error: Exception | None

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())


class FailingVLM(Float64VLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:  # in the middle of optimizer step 2, after a forward under the hooks
            batch["pixel_values"] = batch["pixel_values"].double()
            self(batch)
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def _fit(
    out: Path,
    callbacks: list[Callback],
    vlm: dict[str, Any] = MOE_VLM,
    resume: Path | None = None,
    fails: bool = False,
) -> Fit:
    """``STEPS`` optimizer steps of 2 micro-batches in float64, a checkpoint every 2 steps
    (``fails``: the model raises in step 2, and the error is returned)."""
    torch.manual_seed(0)
    model = (FailingVLM if fails else Float64VLM)(**vlm).double()
    observer = Observer(callbacks)
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=2,
        callbacks=[*callbacks, observer, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    threads, error = set(threading.enumerate()), None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, packed_loader(trainer), ckpt_path=resume)
        except RuntimeError as err:
            if not fails:
                raise
            error = err
    warned = [str(w.message) for w in record]
    return Fit(out, model, trainer, observer, warned, leftovers(trainer, model, threads), error)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Fits shared by the tests, each run once: ``fits("ref", "moe")``, ``fits("with", name)``."""
    root = tmp_path_factory.mktemp("every_callback")
    done: dict[tuple[str, str], Fit] = {}

    def get(kind: str, name: str) -> Fit:
        if (kind, name) not in done:
            out = root / f"{kind}_{name}"
            if kind == "ref":
                done[kind, name] = _fit(out, [], MOE_VLM if name == "moe" else DENSE_VLM)
            else:
                case = CASES[IDS.index(name)]
                done[kind, name] = _fit(out, [case.make(out)])
        return done[kind, name]

    return get


def _assert_same(got: dict, ref: dict, exact: bool) -> None:
    assert list(got) == list(ref)
    for name, a in got.items():
        if exact:
            assert torch.equal(a, ref[name]), name
        else:  # the same math up to float rounding
            torch.testing.assert_close(a, ref[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_world_size_1_trains_as_without_the_callback(fits, case: Case) -> None:
    run, ref = fits("with", case.name), fits("ref", "moe")
    assert run.trainer.global_step == STEPS
    case.worked(run.trainer.callbacks[0], run.trainer, 0)
    _assert_same(run.params(), ref.params(), exact=case.same_math)
    assert run.left == NOTHING_LEFT


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_disabled_callback_is_a_no_op(fits, case: Case, tmp_path) -> None:
    """Constructed, with nothing to do: bitwise the parameters of a fit without it."""
    ref = fits("ref", "moe" if case.idle_model is MOE_VLM else "dense")
    run = _fit(tmp_path, [case.idle(tmp_path)], case.idle_model)
    case.was_idle(run.trainer.callbacks[0], run.warned)
    _assert_same(run.params(), ref.params(), exact=True)
    assert run.left == NOTHING_LEFT


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_resume_restores_the_state_and_continues(fits, case: Case, tmp_path) -> None:
    """Resumed from the step-2 checkpoint of a fit with the callback: the callback starts from
    the state saved there, works for the remaining steps, and the parameters are bitwise those
    of the uninterrupted fit."""
    whole = fits("with", case.name)
    ckpt = whole.out / "ckpt" / "step=2.ckpt"
    run = _fit(tmp_path, [case.make(tmp_path)], resume=ckpt)
    cb = run.trainer.callbacks[0]
    saved = torch.load(ckpt, weights_only=False)["callbacks"].get(cb.state_key, {})
    assert run.observer.report["start_step"] == 2
    assert run.observer.report["state_at_start"][case.name] == json.loads(json.dumps(saved))
    assert run.observer.report["micro_batches"] == 2 * (STEPS - 2)
    case.worked(cb, run.trainer, 2)
    _assert_same(run.params(), whole.params(), exact=True)
    assert run.left == NOTHING_LEFT


def test_the_monitor_state_is_in_the_checkpoint(fits) -> None:
    """Only StragglerMonitor has state (its whole-run totals); the others save nothing."""
    ckpt = torch.load(
        fits("with", "StragglerMonitor").out / "ckpt" / "step=2.ckpt", weights_only=False
    )
    (state,) = (v for k, v in ckpt["callbacks"].items() if k.startswith("StragglerMonitor"))
    assert state["steps_timed"] == 2 and all(t > 0 for t in state["total_step_ms"])
    for name in ("ActivationOffload", "CompiledMoERouting"):
        assert CALLBACKS[name](Path()).state_dict() == {}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cleanup_after_an_exception(case: Case, tmp_path) -> None:
    """The model raises in the middle of step 2, after a forward under every hook: Lightning
    skips ``teardown``, and the callback must still restore everything it patched."""
    run = _fit(tmp_path, [case.make(tmp_path)], fails=True)
    assert "boom in training_step" in str(run.error)
    assert run.observer.report["micro_batches"] == 4  # batch 3 of the epoch raised
    assert run.left == NOTHING_LEFT
    cb = run.trainer.callbacks[0]
    if isinstance(cb, vb.StragglerMonitor):
        assert not cb.recorder.is_open  # closed, keeping the step finished before the failure
        assert [r["global_step"] for r in _jsonl(cb)] == [1]
    if isinstance(cb, vb.ActivationOffload):
        assert cb.offloader is None and cb.last_stats["live_handles"] == 0
        assert run.observer.report["offloading"] == run.observer.report["micro_batches"]
    if isinstance(cb, vb.CompiledMoERouting):
        assert cb.patched == [] and run.observer.report["patched"] == 4  # it failed patched


# -- world size 2: one fit with every callback and strategy="vlmbalance", and its resume ----------


def _job(out: Path, *args: str) -> dict[str, Any]:
    run_module("tests.callbacks.every_callback_job", "--out", str(out), *args, timeout=600)
    return {
        r: {
            **json.loads((out / f"report{r}.json").read_text()),
            "seen": json.loads((out / f"rank{r}.json").read_text())["seen"],
            "params": torch.load(out / f"params{r}.pt"),
        }
        for r in (0, 1)
    }


@pytest.fixture(scope="module")
def ws2(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("every_callback_ws2")
    whole = _job(root / "whole")
    ckpt = root / "whole" / "ckpt" / "step=2.ckpt"
    return {"whole": whole, "resumed": _job(root / "resumed", "--resume", str(ckpt)), "ckpt": ckpt}


@pytest.mark.suite
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_world_size_2_every_rank_runs_the_callback(ws2, case: Case) -> None:
    for run, first_step in ((ws2["whole"], 0), (ws2["resumed"], 2)):
        for r in (0, 1):
            rank = run[r]
            assert rank["world_size"] == 2 and rank["strategy"] == "VLMBalanceStrategy"
            assert rank["global_step"] == STEPS
            assert rank["micro_batches"] == 2 * (STEPS - first_step)
            case.worked_on_rank(rank, first_step)


@pytest.mark.suite
def test_world_size_2_ranks_agree_and_nothing_is_left(ws2) -> None:
    for run in (ws2["whole"], ws2["resumed"]):
        for name, p in run[0]["params"].items():
            assert torch.equal(p, run[1]["params"][name]), name
        for r in (0, 1):
            assert run[r]["leftovers"] == NOTHING_LEFT, (r, run[r]["leftovers"])


@pytest.mark.suite
def test_world_size_2_resume_continues_the_uninterrupted_fit(ws2) -> None:
    """Every rank's callbacks start from the state saved at step 2, the ranks train the packs
    the uninterrupted fit trained after step 2, and end with bitwise its parameters."""
    whole, resumed = ws2["whole"], ws2["resumed"]
    saved = torch.load(ws2["ckpt"], weights_only=False)["callbacks"]
    assert saved["StragglerMonitor"]["steps_timed"] == 2
    for r in (0, 1):
        assert resumed[r]["start_step"] == 2
        assert resumed[r]["seen"] == whole[r]["seen"][2 * 2 :]
        for case in CASES:
            state = saved.get(case.make(Path()).state_key, {})
            assert resumed[r]["state_at_start"][case.name] == json.loads(json.dumps(state))
    for name, p in whole[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], p), name
