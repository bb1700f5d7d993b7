"""Streamed data in a real ``Trainer(devices=2, accelerator="cpu")``: every record trained once
per epoch across ranks (2 workers each), equal steps when the shards differ, an empty shard
ends the epoch everywhere, exact mid-epoch resume; from a generic ``IterableDataset``, Hugging
Face ``datasets`` parquet in streaming mode, and a LitData ``optimize()`` directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.jobs import selected
from tests.launch import THEN, run_modules

JOB = "tests.packing.stream_job"
SAMPLES = 360  # tests.packing.stream_job.SAMPLES


def _seen(out: Path) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


# which launch each fit is in; the LitData launch runs with the suite (``pytest -m suite``):
# the resume matrix's CI cell ``litdata-encoder-2`` resumes a LitData stream under overlap
LAUNCH = {
    **dict.fromkeys(("uneven_ddp", "full", "resume", "empty"), "generic"),
    **dict.fromkeys(("hf_full", "hf_resume", "fsdp"), "hf"),
    **dict.fromkeys(("litdata_full", "litdata_resume"), "litdata"),
}


def _fit(*names: str) -> list[Any]:
    """The marks of a test of these fits: the launches they need (suite: the LitData one)."""
    launches = sorted({LAUNCH[n] for n in names})
    return [pytest.mark.jobs(*launches)] + [pytest.mark.suite] * ("litdata" in launches)


@pytest.fixture(scope="module")
def fits(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three launches, two at a time, each several fits in the same two processes (those the
    selected tests need)."""
    root = tmp_path_factory.mktemp("stream_fits")

    def fit(name: str, fmt: str, *args: str) -> list[str]:
        data = str(root / f"data_{fmt}")
        return ["--data", data, "--out", str(root / name), "--format", fmt, *args]

    uneven = ("--shares", "0.7", "0.3")  # rank 1's streams end first: rank 0 lends packs
    generic = [
        *fit("uneven_ddp", "generic", "--strategy", "ddp", *uneven),
        THEN,
        *fit("full", "generic", "--encoder", *uneven, "--checkpoint-every", "6"),
        THEN,
        *fit("resume", "generic", "--encoder", *uneven, "--resume"),
        str(root / "full" / "ckpt" / "step=12.ckpt"),  # lending began at step 9
        THEN,
        *fit("empty", "generic", "--strategy", "ddp", "--shares", "1", "0"),
    ]
    formats = []
    # every mode of the rebalancing strategies: overlap above, sync here, off under FSDP
    # HF resumes in its second epoch (about 18 steps each), LitData in its first
    for fmt, mode, epochs, step in (("hf", "sync", "2", 27), ("litdata", "overlap", "1", 9)):
        formats.append(
            [
                *fit(f"{fmt}_full", fmt, "--mode", mode, "--checkpoint-every", "9"),
                *("--epochs", epochs),
                THEN,
                *fit(f"{fmt}_resume", fmt, "--mode", mode, "--epochs", epochs, "--resume"),
                str(root / f"{fmt}_full" / "ckpt" / f"step={step}.ckpt"),
            ]
        )
    fsdp = fit("fsdp", "generic", "--strategy", "fsdp_vlmbalance", "--mode", "off", *uneven)
    formats[0] += [THEN, *fsdp]
    launches = {"generic": generic, "hf": formats[0], "litdata": formats[1]}
    wanted = selected(request, launches)
    run_modules([(JOB, *argv) for argv in wanted.values()], timeout=600)
    return root


def _trained(seen: dict[int, dict], epoch: int = 0) -> list[int]:
    return [int(k) for r in seen for s in seen[r]["seen"] if s[0] == epoch for k in s[2]]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=_fit(n))
        for n in ("uneven_ddp", "full", "fsdp", "hf_full", "litdata_full")
    ],
)
def test_every_record_is_trained_once_per_epoch_and_the_ranks_step_together(fits, name) -> None:
    seen = _seen(fits / name)
    epochs = {s[0] for s in seen[0]["seen"]}
    for epoch in epochs:
        assert sorted(_trained(seen, epoch)) == list(range(SAMPLES)), (name, epoch)
    steps = [[(s[0], s[1]) for s in seen[r]["seen"]] for r in range(2)]
    assert steps[0] == steps[1]  # the same micro-batches at the same optimizer steps
    for r in range(2):
        for s in seen[r]["seen"]:
            assert (s[2] == []) == s[3], s  # padding packs, and only they, have no records


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=_fit(n)) for n in ("uneven_ddp", "full", "fsdp")]
)
def test_uneven_shards_end_together_the_longer_rank_lending_packs(fits, name) -> None:
    """Rank 1 holds 30% of the records: once its streams end, rank 0 hands it packs, so both
    train real packs to the end (at most one padding pack, in the last global batch) and the
    epoch takes about half the records' packs per rank, not rank 0's count."""
    seen = _seen(fits / name)
    report = [seen[r]["report"] for r in range(2)]
    assert report[0]["lent_packs"] > 0 and report[1]["lent_packs"] == 0
    assert report[0]["padding_packs"] + report[1]["padding_packs"] <= 1
    per_epoch = [s for s in seen[0]["seen"] if s[0] == 0]
    trained = sum(1 for r in range(2) for s in seen[r]["seen"] if s[0] == 0 and not s[3])
    assert len(per_epoch) == -(-trained // 2)  # ceil(packs / 2): no step wasted on padding


@pytest.mark.jobs("generic")
def test_a_rank_without_records_ends_the_epoch_on_every_rank(fits) -> None:
    seen = _seen(fits / "empty")
    assert seen[0]["seen"] == [] and seen[1]["seen"] == []
    assert seen[0]["report"]["left_over"] > 0  # rank 0 read packs it could not train


@pytest.mark.parametrize(
    ("full", "resumed"),
    [
        pytest.param(full, resumed, marks=_fit(full, resumed))
        for full, resumed in (
            ("full", "resume"),
            ("hf_full", "hf_resume"),
            ("litdata_full", "litdata_resume"),
        )
    ],
)
def test_a_mid_epoch_resume_trains_exactly_the_uninterrupted_packs(fits, full, resumed) -> None:
    a, b = _seen(fits / full), _seen(fits / resumed)
    for r in range(2):
        rest = b[r]["seen"]
        assert rest and a[r]["seen"][-len(rest) :] == rest  # keys, padding, step, loss weight
        # it starts at the checkpoint's step
        assert rest[0][1] == {"resume": 12, "hf_resume": 27, "litdata_resume": 9}[resumed]
