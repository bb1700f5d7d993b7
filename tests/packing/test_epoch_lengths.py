"""Epochs whose plans have different pack counts, in real fits (``tests.packing.epoch_job``).

Every shuffle packs differently, so an epoch can have more (or fewer) packs than the first,
while Lightning reads the loader's length once, before ``set_epoch``. The invariants checked
here, on tables whose pack count varies by epoch: every sample exactly once in every epoch, on
1 and 2 ranks, under ``"ddp"``, ``"vlmbalance"`` and ``"fsdp_vlmbalance"``, with and without
``reload_dataloaders_every_n_epochs``, and after a resume into a later epoch; every optimizer
step's ``global_loss_tokens`` equal to the loss tokens trained in it (all ranks).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from harness.jobs import check, result, selected
from tests.balance.strategy_job import run_fits
from tests.packing.epoch_job import SAMPLES, sampler

EPOCHS = 5  # the fits that check every epoch run 5 (issue 24); the resumes and the overfit run 3
LONG = ("--epochs", str(EPOCHS))
# 1 rank; 2 ranks, ddp and ours (and ours deciding each epoch)
FIVE_EPOCHS = {"one_plain", "ddp_reload", "vlm_balance_reload", "vlm_auto"}
# (strategy, devices, sampler settings): each plan's pack counts differ by epoch, and some
# later epoch has more packs than the first (the packs Lightning used to cut)
ONE_PLAIN = ("--strategy", "auto", "--devices", "1", "--window", "8", "--seed", "7")
DDP = ("--strategy", "ddp", "--devices", "2", "--window", "16", "--seed", "1")
VLM_BALANCE = ("--strategy", "vlmbalance", "--devices", "2", "--balance", "--seed", "6")
FSDP_BALANCE = ("--strategy", "fsdp_vlmbalance", "--devices", "2", "--balance", "--seed", "6")
# mode="auto" decides each epoch: with this model formed at the source in epochs 0, 3 and 4,
# plain in 1 and 2 (the plans change kind between epochs; the resume lands in epoch 3, formed
# after two plain ones)
VLM_AUTO = (*VLM_BALANCE, "--balance-when", "auto", "--balance-pack-ms", "24")
PLANS = {
    "one_plain": {"seed": 7, "window": 8, "balance": False, "num_replicas": 1},
    "one_balance": {"seed": 6, "window": 16, "balance": True, "num_replicas": 1, "micro_steps": 2},
    "ddp": {"seed": 1, "window": 16, "balance": False, "num_replicas": 2},
    "vlm_balance": {"seed": 6, "window": 16, "balance": True, "num_replicas": 2, "micro_steps": 2},
}
# a checkpoint every 9 optimizer steps; the resumes start from one in epoch 2 (ddp: 20, 21, 21
# steps in epochs 0-2; vlm_balance: 24, 26, 22)
CHECKPOINT = ("--checkpoint-every", "9")
# the training loader validates too (the same object), mid-epoch, with a persistent worker: once
# trained on the packs its validation passes read, and none of its samples in the next epoch
VAL_REUSE = (
    "--validate-with-training-loader",
    "--num-workers",
    "1",
    "--persistent-workers",
    "--val-check-interval",
    "6",
)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fits of the selected tests, two at a time; a resume starts once its fit is done."""
    root = tmp_path_factory.mktemp("epoch_fits")

    def ckpt(job: str, name: str) -> str:
        return str(root / job / "ckpt" / f"{name}.ckpt")

    plain_loader = (
        "--strategy",
        "vlmbalance",
        "--devices",
        "2",
        "--plain-loader",
        "--epochs",
        "1",
        "--accumulate",
        "3",
    )
    overfit = (*ONE_PLAIN, "--overfit-batches", "0.2", "--epochs", "3")
    args = {
        "one_plain": (*ONE_PLAIN, *LONG, "--validate", "--one-cycle"),
        "ddp": (*DDP, *CHECKPOINT),
        "ddp_reload": (*DDP, "--reload", *LONG, "--validate", "--one-cycle"),
        "vlm_balance": (*VLM_BALANCE, *CHECKPOINT),
        "vlm_balance_reload": (*VLM_BALANCE, "--reload", *LONG),
        "vlm_auto": (*VLM_AUTO, *LONG, "--checkpoint-every", "9"),
        "resume_vlm_auto": (*VLM_AUTO, *LONG, "--resume", ckpt("vlm_auto", "epoch=3-step=72")),
        "fsdp_balance_reload": (*FSDP_BALANCE, "--reload"),
        "resume_ddp": (*DDP, "--resume", ckpt("ddp", "epoch=2-step=45")),
        "resume_vlm": (*VLM_BALANCE, "--resume", ckpt("vlm_balance", "epoch=2-step=54")),
        "overfit": (*overfit, "--checkpoint-every", "8"),
        "overfit_resume": (*overfit, "--resume", ckpt("overfit", "epoch=0-step=8")),
        "plain_loader": (*plain_loader, "--checkpoint-every", "4"),
        "plain_loader_resume": (*plain_loader, "--resume", ckpt("plain_loader", "epoch=0-step=4")),
        "ddp_val_reuse": (*DDP, *VAL_REUSE),
        "vlm_val_reuse": (*VLM_BALANCE, *VAL_REUSE),
    }  # fmt: skip
    after = {
        "resume_ddp": ["ddp"],
        "resume_vlm": ["vlm_balance"],
        "resume_vlm_auto": ["vlm_auto"],
        "overfit_resume": ["overfit"],
        "plain_loader_resume": ["plain_loader"],
    }
    args = selected(request, args, after)
    for name in args:
        (root / name).mkdir()
    procs = run_fits(
        {
            name: ("tests.packing.epoch_job", "--out", str(root / name), *a)
            for name, a in args.items()
        },
        # each of the six fits of the every-sample-once test has a launch of its own; a fit
        # of another test runs after one of them in its processes (same world), or with the
        # other resume (fresh processes, after the fits they resume); those with a resume
        # first. plain_loader_resume runs alone: its test reads the warning in its stderr
        [
            ("ddp",),
            ("vlm_balance", "plain_loader"),
            ("one_plain", "overfit"),
            ("ddp_reload",),
            ("vlm_balance_reload",),
            ("vlm_auto",),
            ("resume_vlm_auto",),
            ("fsdp_balance_reload",),
            ("resume_ddp", "resume_vlm"),
            ("plain_loader_resume",),
            ("overfit_resume",),
            ("ddp_val_reuse",),
            ("vlm_val_reuse",),
        ],
        after=after,
    )
    return {"root": root, "procs": procs}


def _ranks(runs: dict, name: str) -> list[dict]:
    check(result(runs["procs"], name))
    out = runs["root"] / name
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _epochs_exactly_once(ranks: list[dict], epochs: range) -> None:
    for epoch in epochs:
        ids = sorted(
            s for r in ranks for e, _, sids, *_ in r["trained"] if e == epoch for s in sids
        )
        missing = sorted(set(range(SAMPLES)) - set(ids))
        assert ids == list(range(SAMPLES)), f"epoch {epoch}: missing {missing[:10]}"


def _weights_follow_what_is_trained(ranks: list[dict]) -> None:
    """Every optimizer step's ``global_loss_tokens`` is the loss tokens of its packs, all ranks."""
    tokens: dict[int, int] = defaultdict(int)
    claimed: dict[int, set[int]] = defaultdict(set)
    for r in ranks:
        for _, step, _, loss_tokens, global_tokens in r["trained"]:
            tokens[step] += loss_tokens
            claimed[step].add(global_tokens)
    wrong = {s: (tokens[s], sorted(claimed[s])) for s in tokens if claimed[s] != {tokens[s]}}
    assert not wrong, f"steps whose weight counts other packs (trained, claimed): {wrong}"


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_the_tables_pack_differently_by_epoch(plan: str) -> None:
    """The premise of this module: some later epoch has more packs than the first."""
    counts = [sampler(**PLANS[plan], rank=0).packs_per_rank(e) for e in range(EPOCHS)]
    assert max(counts[1:3]) > counts[0], counts  # within the 3 epochs of the shorter fits
    assert len(set(counts)) > 1, counts


# vlm_balance_reload and fsdp_balance_reload (five and three epochs, a new loader each) run with
# the suite since the test job had to fit in 20 minutes: ddp_reload reloads in CI. ddp and its
# resume too (in CI, ddp_reload covers "ddp" and resume_vlm the resume into a later epoch)
SUITE_FITS = {"ddp", "vlm_balance_reload", "fsdp_balance_reload"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.jobs(n)] + [pytest.mark.suite] * (n in SUITE_FITS))
        for n in (
            "one_plain",
            "ddp",
            "ddp_reload",
            "vlm_balance",
            "vlm_balance_reload",
            "fsdp_balance_reload",
            "vlm_auto",
        )
    ],
)
def test_every_sample_once_in_every_epoch(runs: dict, name: str) -> None:
    """Each epoch trains every pack of its own plan, whatever the first epoch's count: every
    sample exactly once per epoch, equal steps on every rank, weights of what is trained."""
    ranks = _ranks(runs, name)
    for r in ranks:
        trained = defaultdict(int)
        for e, *_ in r["trained"]:
            trained[e] += 1
        assert {str(e): n for e, n in trained.items()} == r["planned"]
    epochs = len(ranks[0]["planned"])
    assert epochs == (EPOCHS if name in FIVE_EPOCHS else 3)
    counts = [ranks[0]["planned"][str(e)] for e in range(epochs)]
    assert max(counts[1:]) > counts[0], counts  # epochs Lightning would have cut
    _epochs_exactly_once(ranks, range(epochs))
    _weights_follow_what_is_trained(ranks)
    assert len({r["optimizer_steps"] for r in ranks}) == 1


@pytest.mark.jobs("vlm_auto")
def test_auto_decides_each_epoch_and_every_rank_agrees(runs: dict) -> None:
    """``mode="auto"`` with ``SourceBalance(when="auto")``: some epochs formed at the source,
    some plain, each the same on every rank (the counts above: every sample once in each)."""
    ranks = _ranks(runs, "vlm_auto")
    taken = [ranks[0]["taken"][str(e)] for e in range(EPOCHS)]
    assert {"plain", "formed"} <= set(taken), taken
    assert all(r["taken"] == ranks[0]["taken"] for r in ranks)


@pytest.mark.parametrize(
    ("name", "full"),
    [
        pytest.param(
            "resume_ddp", "ddp", marks=[pytest.mark.jobs("resume_ddp"), pytest.mark.suite]
        ),
        pytest.param("resume_vlm", "vlm_balance", marks=pytest.mark.jobs("resume_vlm")),
        pytest.param(
            "resume_vlm_auto", "vlm_auto", marks=pytest.mark.jobs("resume_vlm_auto", "vlm_auto")
        ),
    ],
)
def test_resume_into_a_later_epoch(runs: dict, name: str, full: str) -> None:
    """A resume into epoch 2 or later trains exactly the packs the uninterrupted run trained
    after the checkpoint, to the end of every later epoch."""
    resumed, whole = _ranks(runs, name), _ranks(runs, full)
    first_step = resumed[0]["trained"][0][1]
    assert resumed[0]["trained"][0][0] >= 2  # a later epoch
    for again, before in zip(resumed, whole):
        assert again["trained"] == [t for t in before["trained"] if t[1] >= first_step]
    _weights_follow_what_is_trained(resumed)


@pytest.mark.jobs("overfit", "overfit_resume")
def test_overfit_batches_resumed_at_an_epoch_end_trains_every_epoch(runs: dict) -> None:
    """``Trainer(overfit_batches=...)`` trains the same first packs every epoch; resumed from a
    checkpoint saved at an epoch's last batch, the next epochs train them all again."""
    (whole,), (resumed,) = _ranks(runs, "overfit"), _ranks(runs, "overfit_resume")
    per_epoch = defaultdict(list)
    for e, _, sids, *_ in whole["trained"]:
        per_epoch[e].append(sids)
    assert len(per_epoch) == 3 and per_epoch[0] == per_epoch[1] == per_epoch[2]
    assert len(per_epoch[0]) == 16 and whole["optimizer_steps"] == 24
    assert resumed["trained"] == [t for t in whole["trained"] if t[0] >= 1]
    assert resumed["optimizer_steps"] == 24


@pytest.mark.jobs("plain_loader", "plain_loader_resume")
def test_a_loader_that_cannot_resume_is_not_made_resumable(runs: dict) -> None:
    """A plain DataLoader of packs under ``"vlmbalance"``: Lightning warns on a mid-epoch resume
    that it cannot resume it, and each step's weight counts the packs trained in it (the loop
    counts on from the checkpoint while the loader starts again)."""
    whole, resumed = _ranks(runs, "plain_loader"), _ranks(runs, "plain_loader_resume")
    assert len(whole[0]["trained"]) % 3  # the epoch ends in a short step
    assert "dataloader is not resumable" in result(runs["procs"], "plain_loader_resume").stderr
    _weights_follow_what_is_trained(whole)
    _weights_follow_what_is_trained(resumed)
    assert resumed[0]["optimizer_steps"] == whole[0]["optimizer_steps"]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.jobs(n)) for n in ("one_plain", "ddp_reload")]
)
def test_a_packed_validation_loader_validates_every_sample_at_every_epoch(runs, name) -> None:
    """A ``PackedDataLoader`` given its trainer validates epoch 0's plan every time: Lightning
    reads a validation loader's length once, and a later epoch's longer plan lost its last
    packs (297 of 300, then 296 of 300 samples validated)."""
    ranks = _ranks(runs, name)
    for epoch in range(EPOCHS):
        ids = sorted(s for r in ranks for e, sids in r["validated"] if e == epoch for s in sids)
        assert ids == list(range(SAMPLES)), f"epoch {epoch}: {len(ids)} validated"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.jobs(n)) for n in ("one_plain", "ddp_reload")]
)
def test_an_lr_schedule_sized_from_lightnings_estimate_is_never_stepped_past_its_end(
    runs, name
) -> None:
    """OneCycleLR over ``trainer.estimated_stepping_batches`` (5 epochs): Lightning multiplies
    the loader's first length by the epochs, and these epochs plan more packs than the first
    (estimate 100 and 205 steps, 102 and 206 trained: "Tried to step 101 times" at the end).
    The loader's first answer is the longest plan of the fit's epochs."""
    for r in _ranks(runs, name):
        assert r["optimizer_steps"] <= r["estimated_steps"], r["estimated_steps"]
        assert r["optimizer_steps"] >= r["estimated_steps"] - 5  # and not far from it


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.jobs(n)) for n in ("ddp_val_reuse", "vlm_val_reuse")]
)
def test_the_training_loader_reused_to_validate_mid_epoch_trains_every_sample_once(runs, name):
    """The training ``PackedDataLoader`` is also the validation loader, validated every 6
    batches, with a persistent worker: each validation pass reads epoch 0's plan whole (every
    sample once per validation run) and the training pass goes on where it stood. Validation
    once restarted the training pass's persistent iterator: 52 of 120 samples trained in epoch
    0, some four times."""
    ranks = _ranks(runs, name)
    _epochs_exactly_once(ranks, range(3))
    _weights_follow_what_is_trained(ranks)
    for epoch in range(3):
        counts = Counter(s for r in ranks for e, sids in r["validated"] if e == epoch for s in sids)
        assert set(counts) == set(range(SAMPLES)) and len(set(counts.values())) == 1, epoch
        assert next(iter(counts.values())) >= 2, "validated mid-epoch and at the epoch's end"
