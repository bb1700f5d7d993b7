"""Packing in a real ``Trainer(devices=2, accelerator="cpu", strategy="ddp")`` (subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.jobs import check, result, selected
from tests.balance.strategy_job import run_fits

# 40 packs per rank per epoch, accumulate 2: epoch 0 ends at step 20
RESUME_CASES = [
    ("epoch=0-step=5.ckpt", 5),  # mid-epoch
    ("epoch=0-step=20.ckpt", 20),  # saved on the last batch of an epoch
    ("end-epoch=0.ckpt", 20),  # saved when the epoch ended (ModelCheckpoint's default)
    ("epoch=1-step=30.ckpt", 30),  # mid-epoch, second epoch
]


def _seen(out: Path) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fits of this module's selected tests (``@pytest.mark.jobs``), two at a time (their
    start-up overlaps), each in ``root / name``: the full run, a resume from each of its
    checkpoints (started once it is done) and the independent fits. A test checks its own fit's
    exit."""
    root = tmp_path_factory.mktemp("fits")
    args = {
        "full": ("--checkpoint-every", "5", "--epoch-checkpoint", "--epochs", "3"),
        "no_image": ("--text-only-second-half", "--epochs", "1", "--max-steps", "3"),
        **{
            f"resume_{pattern}": (
                "--resume",
                str(root / "full" / "ckpt" / pattern),
                "--epochs",
                "3",
            )
            for pattern, _ in RESUME_CASES
        },
        "workers": ("--epochs", "1", "--num-workers", "2"),
    }
    after = {name: ["full"] for name in args if name.startswith("resume_")}
    args = selected(request, args, after)
    for name in args:
        (root / name).mkdir()
    resumes = [f"resume_{pattern}" for pattern, _ in RESUME_CASES]
    procs = run_fits(
        {
            name: ("tests.packing.lightning_job", "--out", str(root / name), *a)
            for name, a in args.items()
        },
        # fits of one launch run one after the other in the same processes (process start-up
        # is most of these fits' time); the resumes in processes that never ran the full fit
        [("full",), ("no_image", "workers"), tuple(resumes[:2]), tuple(resumes[2:])],
        after=after,
    )
    return {"root": root, "procs": procs}


def _run(runs: dict, name: str) -> dict[int, dict]:
    check(result(runs["procs"], name))
    return _seen(runs["root"] / name)


@pytest.fixture(scope="module")
def full_run(runs: dict) -> tuple[Path, dict[int, dict]]:
    return runs["root"] / "full", _run(runs, "full")


@pytest.mark.jobs("full")
def test_every_sample_once_per_epoch_across_ranks(full_run: tuple[Path, dict]) -> None:
    """Each sample is used exactly once per epoch across all ranks; ranks run equal step counts."""
    _, seen = full_run
    assert len(seen[0]["seen"]) == len(seen[1]["seen"]) > 0
    for epoch in (0, 1, 2):
        ids = [s for r in (0, 1) for e, _, sids in seen[r]["seen"] if e == epoch for s in sids]
        assert sorted(ids) == list(range(300))
    # a new epoch reshuffles: the packs differ
    e0 = [tuple(s) for e, _, s in seen[0]["seen"] if e == 0]
    e1 = [tuple(s) for e, _, s in seen[0]["seen"] if e == 1]
    assert e0 != e1


@pytest.mark.parametrize(
    ("pattern", "step"),
    [pytest.param(*c, marks=pytest.mark.jobs(f"resume_{c[0]}")) for c in RESUME_CASES],
)
def test_resume_continues_with_exactly_the_remaining_packs(
    full_run: tuple[Path, dict], runs: dict, pattern: str, step: int
) -> None:
    """A checkpoint at optimizer step k resumes with the packs the uninterrupted run saw after k,
    also at epoch boundaries (no epoch replayed or skipped)."""
    out, seen = full_run
    ckpt = out / "ckpt" / pattern
    assert ckpt.exists(), sorted(p.name for p in (out / "ckpt").iterdir())
    resumed = _run(runs, f"resume_{pattern}")  # --resume ckpt --epochs 3
    micro = step * 2  # accumulate_grad_batches=2
    for r in (0, 1):
        full = [tuple(map(str, x)) for x in seen[r]["seen"]]
        again = [tuple(map(str, x)) for x in resumed[r]["seen"]]
        assert again == full[micro:], f"rank {r}: resumed run diverges"


@pytest.mark.jobs("no_image")
def test_rank_with_no_image_in_its_shard(runs: dict) -> None:
    """Packs without images (rank 1's whole shard) train under DDP: no unused-parameter error."""
    seen = _run(runs, "no_image")  # --text-only-second-half --epochs 1 --max-steps 3
    assert len(seen[1]["seen"]) == 6


@pytest.mark.jobs("workers")
def test_with_dataloader_workers(runs: dict) -> None:
    """Workers prefetch packs; every rank still trains on its planned packs in order."""
    seen = _run(runs, "workers")  # --epochs 1 --num-workers 2
    ids = sorted(s for r in (0, 1) for _, _, sids in seen[r]["seen"] for s in sids)
    assert ids == list(range(300))
