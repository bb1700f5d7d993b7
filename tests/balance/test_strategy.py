"""`strategy="vlmbalance"` in real 2-process fits: same math, coverage, one sync per step."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vlmbalance as vb
from harness.jobs import check, result, selected
from tests.balance.fits import fit_result as _result
from tests.balance.fits import job as _job
from tests.balance.fits import max_rel_diff as _max_rel_diff
from tests.balance.fits import packs as _packs
from tests.balance.strategy_job import run_fits

EPOCH = ("--epochs", "1", "--max-steps", "-1")  # 84 packs per rank: 21 steps of 4


PRECISIONS = ["bf16-mixed"]  # test_bf16_trains_with_the_strategy_and_every_callback
OVERFIT = [("vlmbalance", "0.1", 8)]  # test_overfit_batches_trains_the_same_packs_every_epoch


def _fail(mode: str) -> tuple[str, ...]:
    """Rank 1 raises inside its 3rd exchange."""
    args = ("--mode", mode, "--fail-rank", "1", "--fail-at", "3", "--exchange-timeout-s", "10")
    return ("--strategy", "vlmbalance", *args)


FITS = ("ddp", "sync", "overlap")  # the jobs of the `fits` fixture


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict:
    """The 2-process jobs of this module's selected tests (``@pytest.mark.jobs``), two at a time
    (their start-up overlaps), each in ``root / name``; a test checks its own job's exit. The
    resumed fits start from the step-8 checkpoints of the uninterrupted ones (``after``)."""
    root = tmp_path_factory.mktemp("fits")
    every8 = ("--checkpoint-every", "8")
    args = {  # the longest first
        "ddp": ("--strategy", "ddp", *EPOCH, *every8),
        "overlap": ("--strategy", "vlmbalance", "--mode", "overlap", *EPOCH, *every8),
        "sync": ("--strategy", "vlmbalance", "--mode", "sync", *EPOCH),
        **{
            f"precision_{precision}": (
                *("--strategy", "vlmbalance", "--precision", precision, "--all-callbacks"),
                *("--max-steps", "4", "--accumulate", "2"),
            )
            for precision in PRECISIONS
        },
        # resumed after step 8 of the uninterrupted fits (the strategy's default mode: overlap)
        "overlap_resumed": (
            *("--strategy", "vlmbalance", *EPOCH),
            *("--resume", str(root / "overlap" / "ckpt" / "step=8.ckpt")),
        ),
        "ddp_resumed": (
            *("--strategy", "ddp", *EPOCH),
            *("--resume", str(root / "ddp" / "ckpt" / "step=8.ckpt")),
        ),
        **{
            f"overfit_{strategy}_{overfit}": (
                *("--strategy", strategy, "--overfit-batches", overfit),
                *("--epochs", "3", "--max-steps", "-1", "--accumulate", "2"),
            )
            for strategy, overfit, _ in OVERFIT
        },
        "fail_sync": _fail("sync"),
        "fail_overlap": _fail("overlap"),
        # a user-wrapped RebalancingLoader(micro_steps=3) under accumulate_grad_batches=4
        "mismatch": ("--strategy", "vlmbalance", "--global-tokens", "--data-micro-steps", "3"),
        "world_size_one": ("--strategy", "vlmbalance", "--devices", "1", "--max-steps", "5"),
    }
    after = {"overlap_resumed": ["overlap"], "ddp_resumed": ["ddp"]}
    procs = run_fits(
        {name: _job(root / name, *a) for name, a in selected(request, args, after).items()},
        # fits of one launch run one after the other in the same 2 processes (process start-up
        # is most of a short fit's time): plain DDP first, before any of the strategy's code;
        # the resumes in fresh processes; a failing job alone
        [
            ("ddp", "overlap", "sync"),
            (*(f"precision_{p}" for p in PRECISIONS), *(f"overfit_{s}_{o}" for s, o, _ in OVERFIT)),
            ("fail_sync",),
            ("fail_overlap",),
            ("mismatch",),
            ("ddp_resumed", "overlap_resumed"),
        ],
        after=after,
        # a hang of a failing job runs into its timeout (an error of the test)
        timeouts={"fail_sync": 240, "fail_overlap": 240, "mismatch": 300},
    )
    return {"root": root, "procs": procs}


def _fit_of(jobs: dict, name: str) -> dict:
    check(result(jobs["procs"], name))
    return _result(jobs["root"] / name)


@pytest.fixture(scope="module")
def fits(jobs) -> dict:
    """One epoch each of plain DDP (same loss normalisation) and vlmbalance sync / overlap."""
    return {
        "root": jobs["root"],
        **{name: _fit_of(jobs, name) for name in FITS},
    }


@pytest.mark.jobs(*FITS)
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_same_parameters_as_ddp(fits, mode) -> None:
    """Float64, GA 4, 21 optimizer steps: rebalancing changes where packs run, not the math."""
    run, ddp = fits[mode], fits["ddp"]
    assert run[0]["optimizer_steps"] == ddp[0]["optimizer_steps"] == 21
    assert _max_rel_diff(run["params"], ddp["params"]) < 1e-10
    moved = sum(s["moved_packs"] for s in run[0]["stats"])
    assert moved > 0, f"{mode}: nothing was rebalanced, the test would prove nothing"
    assert _packs(run) == _packs(ddp)  # the same packs, in other places
    assert [s["moved_packs"] for s in run[0]["stats"]] == [
        s["moved_packs"] for s in run[1]["stats"]
    ]
    # one SIGTERM broadcast per optimizer step, not per micro-batch
    assert run[0]["broadcasts"] == 21
    assert set(run[0]["logged"]) == {
        "balance/moved_packs",
        "balance/planned_waste_frac",
        "balance/exchange_ms",
        "balance/exposed_exchange_ms",
    }


@pytest.mark.jobs(*FITS)
def test_plain_ddp_broadcasts_every_micro_batch(fits) -> None:
    assert fits["ddp"][0]["broadcasts"] == 84


@pytest.mark.jobs(*FITS)
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_every_sample_once_per_epoch_with_rebalancing(fits, mode) -> None:
    run = fits[mode]
    ids = sorted(s for r in (0, 1) for _, _, sample_ids in run[r]["seen"] for s in sample_ids)
    assert ids == list(range(600))


@pytest.mark.jobs(*FITS, "overlap_resumed", "ddp_resumed")
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(fits, jobs) -> None:
    """Kill after step 8, resume from its checkpoint: the same packs in the same places, and the
    same parameters as plain DDP resumed the same way.

    (A resumed float64 fit differs from the uninterrupted one by ~6e-8 relative under plain
    ``"ddp"`` too, with identical batches: a property of Lightning's resume, not of rebalancing.)
    """
    resumed = _fit_of(jobs, "overlap_resumed")  # from overlap/ckpt/step=8.ckpt
    for r in (0, 1):  # 8 optimizer steps x 4 micro-batches were done before the checkpoint
        assert resumed[r]["seen"] == fits["overlap"][r]["seen"][8 * 4 :]
    ddp_resumed = _fit_of(jobs, "ddp_resumed")  # from ddp/ckpt/step=8.ckpt
    assert _max_rel_diff(resumed["params"], ddp_resumed["params"]) < 1e-10


@pytest.mark.parametrize(
    "mode",
    [  # sync in the suite: overlap's failing exchange stops every rank in CI
        pytest.param("sync", marks=[pytest.mark.jobs("fail_sync"), pytest.mark.suite]),
        pytest.param("overlap", marks=pytest.mark.jobs("fail_overlap")),
    ],
)
def test_a_rank_failing_in_its_exchange_stops_every_rank(jobs, mode) -> None:
    """Rank 1 raises inside its exchange: the whole job stops soon, no hang. (That the other
    rank's loader raises ExchangeError itself is shown without Lightning in test_loader.py;
    here Lightning may also stop rank 0 when it sees rank 1 exit.) A hang would run into the
    subprocess timeout (an error of the test), not into a wall-clock assertion."""
    proc = result(jobs["procs"], f"fail_{mode}")
    assert not proc.timed_out, proc.stderr[-3000:]
    assert proc.returncode != 0
    assert "failed on purpose" in proc.stderr or "ExchangeError" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.suite
@pytest.mark.jobs("world_size_one")
def test_world_size_one_is_a_no_op(jobs) -> None:
    run = _fit_of(jobs, "world_size_one")  # --devices 1 --max-steps 5
    assert all(s["moved_packs"] == 0 for s in run[0]["stats"])


def test_registered_by_name() -> None:
    assert {"vlmbalance", "ddp_vlmbalance"} <= set(StrategyRegistry)
    for name in ("vlmbalance", "DDP_VLMBalance"):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, vb.VLMBalanceStrategy)
    trainer = L.Trainer(
        strategy=vb.VLMBalanceStrategy(mode="sync"), accelerator="cpu", devices=2, logger=False
    )
    assert trainer.strategy.mode == "sync" and trainer.strategy.resolved_objective == "step"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fast"}, "mode='fast'"),
        ({"objective": "speed"}, "objective='speed'"),
        ({"tolerance": -1}, "tolerance=-1"),
        ({"exchange_timeout_s": 0}, "exchange_timeout_s=0"),
    ],
)
def test_bad_settings_are_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        vb.VLMBalanceStrategy(**kwargs)


@pytest.mark.jobs("mismatch")
def test_loader_with_other_micro_steps_is_named(jobs) -> None:
    """A user-wrapped RebalancingLoader must agree with accumulate_grad_batches."""
    proc = result(jobs["procs"], "mismatch")  # RebalancingLoader(micro_steps=3), accumulate 4
    assert not proc.timed_out, proc.stderr[-3000:]
    assert proc.returncode != 0
    assert "RebalancingLoader(micro_steps=3)" in proc.stderr
    assert "accumulate_grad_batches=4" in proc.stderr


@pytest.mark.parametrize(
    "precision", [pytest.param(p, marks=pytest.mark.jobs(f"precision_{p}")) for p in PRECISIONS]
)
def test_bf16_trains_with_the_strategy_and_every_callback(jobs, precision) -> None:
    """bf16 used to fail in the example VLM (the projector's bf16 output put into float32
    embeddings); with the strategy moving packs and every callback on, it trains. (bf16-true:
    tests/examples/test_vlm.py and the Trainer battery.)"""
    run = _fit_of(jobs, f"precision_{precision}")  # --all-callbacks --max-steps 4 --accumulate 2
    assert run[0]["optimizer_steps"] == 4
    assert all(torch.isfinite(v.float()).all() for v in run["params"].values())
    assert sum(s["moved_packs"] for s in run[0]["stats"]) > 0


@pytest.mark.parametrize(
    ("strategy", "overfit", "per_epoch"),
    [pytest.param(*c, marks=pytest.mark.jobs(f"overfit_{c[0]}_{c[1]}")) for c in OVERFIT],
)
def test_overfit_batches_trains_the_same_packs_every_epoch(jobs, strategy, overfit, per_epoch):
    """overfit_batches used to fail ("needs to subclass torch.utils.data.DataLoader"). Now: the
    same few packs every epoch (0.1 of 84 packs per rank = 8), each sample once per epoch.
    (overfit_batches=4 and plain "ddp": the Trainer battery.)"""
    run = _fit_of(jobs, f"overfit_{strategy}_{overfit}")  # --epochs 3 --accumulate 2
    for r in (0, 1):
        epochs = [[ids for e, _, ids in run[r]["seen"] if e == epoch] for epoch in range(3)]
        assert [len(packs) for packs in epochs] == [per_epoch] * 3
        assert epochs[0] == epochs[1] == epochs[2]
    first = [s for r in (0, 1) for e, _, ids in run[r]["seen"] if e == 0 for s in ids]
    assert len(first) == len(set(first))  # exactly once within the overfit set


def _one_rank_fit(rank: int, world: int, case: str) -> dict:
    """A 1-rank ``"vlmbalance"`` fit in this (spawned) process: ``case`` is ``"two_loaders"``
    (``train_dataloader`` returns two) or ``"seeded_workers"`` (``seed_everything(workers=
    True)``, a plain DataLoader of packs and a PackedDataLoader, two workers each)."""
    from functools import partial

    from lightning.fabric.utilities.seed import pl_worker_init_function
    from torch.utils.data import DataLoader

    from lightning_vlmbalance.preemption import WorkersIgnoreSigterm
    from tests.cpu_fit import cpu_trainer, packed_loader
    from tests.packing.lightning_job import SMALL_VLM, RecordingVLM

    L.seed_everything(0, workers=case == "seeded_workers", verbose=False)
    seen: dict[str, object] = {}

    class Model(RecordingVLM):
        def train_dataloader(self):
            packed = packed_loader(self.trainer)
            if case == "two_loaders":
                return [packed, packed_loader(self.trainer)]
            packed.dataloader_kwargs["num_workers"] = 2
            plain = DataLoader(
                packed.dataset,
                batch_sampler=[ids for ids in packed.sampler],
                collate_fn=vb.PackCollator(128, image_feature_shape=(8,)),
                num_workers=2,
            )
            self.loaders = {"packed": packed, "plain": plain}
            return plain if self.trainer.current_epoch == 0 else packed

        def training_step(self, batch, batch_idx):
            loader = self.trainer.strategy.rebalancing_loader.loader
            inner = loader.pack_source._inner if isinstance(loader, vb.PackedDataLoader) else loader
            fn = inner.worker_init_fn
            if isinstance(fn, WorkersIgnoreSigterm):  # the strategy's wrapper keeps it
                fn = fn.init_fn
            key = "packed" if isinstance(loader, vb.PackedDataLoader) else "plain"
            seen[key] = isinstance(fn, partial) and fn.func is pl_worker_init_function
            # its workers start with SIGTERM blocked (until the wrapper ignores it)
            seen[f"{key}_blocked"] = getattr(inner.multiprocessing_context, "_sigterm_blocked", 0)
            return super().training_step(batch, batch_idx)

    trainer = cpu_trainer(
        [],
        4,
        strategy="vlmbalance",
        max_epochs=2,
        reload_dataloaders_every_n_epochs=1,
        use_distributed_sampler=False,
    )
    trainer.limit_train_batches = 2
    model = Model("/tmp", **SMALL_VLM, max_positions=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    seen["unpacked_warnings"] = [
        str(w.message) for w in caught if "not a `PackedDataLoader`" in str(w.message)
    ]
    return seen


def test_several_training_loaders_are_refused() -> None:
    """Each loader would get its own exchange thread on the one process group: refused."""
    from harness.ranks import run_ranks

    status, message = run_ranks(_one_rank_fit, 1, "two_loaders", start_method="forkserver")[0]
    assert status == "error" and "rebalances one training dataloader" in message


def test_seed_everything_seeds_the_workers_the_strategy_runs() -> None:
    """``seed_everything(workers=True)``: Lightning's ``worker_init_fn`` reaches the loader
    whose workers run (a plain DataLoader inside the strategy's wrapper, and the
    PackedDataLoader's own DataLoader), not an attribute of a wrapper."""
    from harness.ranks import run_ranks

    status, seen = run_ranks(_one_rank_fit, 1, "seeded_workers", start_method="forkserver")[0]
    assert status == "ok", seen
    warned = seen.pop("unpacked_warnings")
    assert seen == {"plain": True, "packed": True, "plain_blocked": True, "packed_blocked": True}
    # the plain DataLoader of epoch 0 is named, once, with the packed loaders to use instead
    assert len(warned) == 1 and "DataLoader, not a `PackedDataLoader`" in warned[0], warned


def _blocked_in_child(queue) -> None:
    import os
    import signal
    import time

    from lightning_vlmbalance.preemption import WorkersIgnoreSigterm

    before = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    WorkersIgnoreSigterm(None)(0)  # what a worker runs first
    after = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.kill(os.getpid(), signal.SIGTERM)  # not from the parent (a group signal): ignored
    time.sleep(0.3)
    queue.put((before, after, "alive"))
    time.sleep(60)  # until the parent's SIGTERM ends it


def test_workers_start_with_sigterm_blocked_until_they_ignore_it() -> None:
    """A signal to the process group as a pass starts its workers must not kill one between its
    fork and its worker_init_fn (torch's handler dies of a SIGTERM its parent did not send):
    the strategy's worker context starts each worker with SIGTERM blocked, and the wrapper keeps
    it blocked for a thread that ignores a SIGTERM from anyone but the parent; the parent's
    SIGTERM (Python's exit handler ends daemonic workers so) ends the worker with status 0; the
    parent's own mask is left as it was."""
    import multiprocessing
    import signal

    from lightning_vlmbalance.preemption import _sigterm_blocked_start

    for method in ("fork", "spawn"):
        context = _sigterm_blocked_start(method)
        assert _sigterm_blocked_start(context) is context  # once
        queue = context.SimpleQueue()
        child = context.Process(target=_blocked_in_child, args=(queue,))
        child.start()
        assert queue.get() == (True, True, "alive"), method
        child.terminate()
        child.join(timeout=10)
        assert child.exitcode == 0, method
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert _sigterm_blocked_start(None).get_start_method() == multiprocessing.get_start_method()


def test_fabric_refuses_the_strategies_by_name() -> None:
    """The strategies are Trainer-only: ``Fabric(strategy="vlmbalance")`` says so (it was
    Fabric's generic "invalid strategy name")."""
    for name in ("vlmbalance", "ddp_vlmbalance", "fsdp_vlmbalance"):
        with pytest.raises(ValueError, match=r"work with the Lightning `Trainer` only"):
            L.Fabric(strategy=name, accelerator="cpu", devices=1)


def test_a_loader_built_before_the_trainer_is_attached_is_named() -> None:
    """``PackedDataLoader(..., trainer=self.trainer)`` in a DataModule's ``__init__`` gets
    ``None``; under ``"ddp"``-like accumulation the step's error told the user to do exactly
    that: it now says the trainer was ``None`` where the loader was built."""
    from tests.cpu_fit import cpu_trainer, packed_loader
    from tests.packing.lightning_job import SMALL_VLM, RecordingVLM

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.loader = packed_loader(self.trainer)  # self.trainer is None here

        def train_dataloader(self):
            return self.loader

    trainer = cpu_trainer([], 2, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"built with `trainer=None`.*`train_dataloader\(\)`"):
        trainer.fit(RecordingVLM("/tmp", **SMALL_VLM, max_positions=128), datamodule=Data())
