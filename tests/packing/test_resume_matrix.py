"""Resume from anywhere, for every loader and strategy: a fit resumed from a checkpoint trains
exactly the micro-batches the uninterrupted fit trained from that point on, on every rank, and
every record once per epoch (``tests/packing/resume_job.py``: the example VLM on the CPU, 2 or 4
ranks, 2 DataLoader workers each, accumulation 2, packing windows of 16 records on 2 ranks and 8
on 4, 360 records).

A *cell* is a loader x a strategy x a number of ranks, and one launch of the job: its
uninterrupted reference fit (a checkpoint after every optimizer step and at every mid-epoch
validation), then fits resumed from checkpoints at these *positions*:

=============  ==================================================================================
``window``     an optimizer step beyond the first two packing windows of every stream (the resume
               reads from an anchor past the stream's start)
``val``        the end of a mid-epoch validation (``val_check_interval`` in micro-batches, odd:
               inside an optimizer step)
``exception``  ``OnExceptionCheckpoint`` of a fit that fails at an optimizer step (a failing fit
               between the reference and its resumed fit)
``tail``       (``generic`` only, whose shards are uneven: ``--shares``) an optimizer step inside
               the lending tail, where a rank whose streams ended trains packs lent by another
=============  ==================================================================================

Axes: loaders ``mapstyle`` (``PackedDataLoader`` + ``PackingSampler``), ``generic`` (an
``IterableDataset``), ``hf``, ``hf_shuffled`` (``.shuffle(seed, buffer_size)``, then split by node)
and ``litdata``; strategies ``ddp``, ``vlmbalance`` in modes ``off``, ``sync``, ``overlap``,
``encoder`` (``overlap`` with encoder balancing) and ``fsdp`` (``fsdp_vlmbalance``, ``overlap``);
2 and 4 ranks.

Default run (CI), two cells, about 80 s on this 2-core machine (two launches at a time)::

    litdata-encoder-2   generic-fsdp-4

(two streaming loaders, encoder balancing and FSDP2; the uneven tail on 2 and on 4 ranks).
``generic-overlap-2``, ``hf_shuffled-sync-2`` and ``mapstyle-ddp-2`` were CI cells until the
test job had to fit in 20 minutes: they run with the suite (``tests/packing/test_streaming_fit.py``
resumes generic and Hugging Face streams in CI; ``tests/packing/test_lightning.py``,
``tests/balance/test_strategy.py`` and ``tests/packing/test_epoch_lengths.py`` resume the
map-style loader). The other 58 cells are marked
``suite``: ``pytest -m suite tests/packing/test_resume_matrix.py`` runs them,
``-m "suite or not suite"`` the whole cross product of 60 cells (about 35 minutes here, two
launches at a time). One cell: ``-m "suite or not suite" -k hf-sync-4``.

What each cell asserts, on every rank, micro-batch by micro-batch (``[epoch, global_step, keys,
padding, loss_weight, loss_tokens]``):

* the reference trains every record exactly once per epoch across the ranks, the ranks step
  together in whole optimizer steps (``accumulate`` micro-batches, the epoch's last may be
  shorter), and each step's packs on every rank carry one loss weight, ``ranks * accumulate /
  tokens of the step`` (a global batch that is not one optimizer step shows here);
* a resumed fit trains exactly the reference's micro-batches from the checkpoint's position on,
  and the reference's micro-batches before it plus the resumed fit's are each record exactly once
  per epoch;
* the failing fit trained exactly the reference's micro-batches before the failure.

Equal means equal in every field, the loss weight too, also for the rest of an optimizer step a
resume lands inside (``val``): the guarantee of ``docs/streaming.md`` ("trains exactly the
uninterrupted run's packs, loss weights and steps"), which the streamed loaders under ``ddp``
keep there.

Each position is checked to be what it claims (beyond the first two windows, inside the tail,
inside the epoch, the validation at the step its checkpoint names), so a change of the data
cannot make a test vacuous.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.jobs import result, run_jobs, selected
from lightning_vlmbalance.streams import ShardedRecords
from tests.launch import THEN
from tests.packing.resume_job import INJECTED, SAMPLES

JOB = "tests.packing.resume_job"
ACCUMULATE = 2  # the job's defaults, which the cells keep
WORKERS = 2

LOADERS = ("mapstyle", "generic", "hf", "hf_shuffled", "litdata")
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": ("--strategy", "ddp"),
    "off": ("--strategy", "vlmbalance", "--mode", "off"),
    "sync": ("--strategy", "vlmbalance", "--mode", "sync"),
    "overlap": ("--strategy", "vlmbalance", "--mode", "overlap"),
    "encoder": ("--strategy", "vlmbalance", "--mode", "overlap", "--encoder"),
    "fsdp": ("--strategy", "fsdp_vlmbalance", "--mode", "overlap"),
}
RANKS = (2, 4)
LAUNCH_TIMEOUT_S = 600  # one cell's launch (a hung peer fails its fit within a minute)
# the module fixture runs every selected launch in the first test's setup; each launch is
# bounded by LAUNCH_TIMEOUT_S
pytestmark = pytest.mark.timeout(4 * 3600)
# generic's uneven shards: rank 0 holds 70%; the others' streams end first and it lends packs
# (on 4 ranks three end together: one share each is read ahead for them)
SHARES = {2: (0.7, 0.3), 4: (0.7, 0.1, 0.1, 0.1)}


@dataclass(frozen=True)
class Positions:
    """Where a cell's resumed fits start (360 records: about 36 micro-batches per rank on 2
    ranks, 18 on 4)."""

    buffer: int  # records per packing window (per stream; the map-style sampler's window)
    window: int  # optimizer step of the checkpoint beyond the first packing windows
    tail: int  # optimizer step of the checkpoint inside generic's lending tail
    val_every: int  # micro-batches between validations (odd: some inside an optimizer step)
    val_after: int  # micro-batches trained when the resumed validation checkpoint was saved
    fail: int  # optimizer step at whose first micro-batch the failing fit raises


POSITIONS = {
    2: Positions(buffer=16, window=9, tail=15, val_every=7, val_after=21, fail=12),
    # a rank's streams hold half as many records: windows of 8 make as many windows
    4: Positions(buffer=8, window=5, tail=7, val_every=5, val_after=15, fail=6),
}


@dataclass(frozen=True)
class Cell:
    loader: str
    strategy: str
    ranks: int

    @property
    def name(self) -> str:
        return f"{self.loader}-{self.strategy}-{self.ranks}"

    @property
    def at(self) -> Positions:
        return POSITIONS[self.ranks]

    @property
    def positions(self) -> tuple[str, ...]:
        return ("window", "val", "exception", *(("tail",) if self.loader == "generic" else ()))

    def launch(self, root: Path) -> tuple[str, ...]:
        """The job's argument lists: the reference, the resumed fits, the failing fit and the
        fit resumed from its exception checkpoint (last: a failure leaves the most behind)."""
        at, out = self.at, root / self.name
        base = [
            *("--data", str(root / "data"), "--loader", self.loader),
            *STRATEGIES[self.strategy],
            *("--devices", str(self.ranks), "--buffer", str(at.buffer)),
            *("--val-every", str(at.val_every)),
        ]
        if self.loader == "generic":
            base += ["--shares", *map(str, SHARES[self.ranks])]
        ckpt = out / "reference" / "ckpt"
        fits = [
            ["--out", str(out / "reference"), "--checkpoint-every", "1"],
            ["--out", str(out / "window"), "--resume", str(ckpt / f"step={at.window}.ckpt")],
            ["--out", str(out / "val"), "--resume", str(ckpt / f"val-step={val_step(at)}.ckpt")],
        ]
        if "tail" in self.positions:
            tail = ckpt / f"step={at.tail}.ckpt"
            fits.append(["--out", str(out / "tail"), "--resume", str(tail)])
        failed = out / "failed" / "ckpt" / "on_exception.ckpt"
        fits += [
            ["--out", str(out / "failed"), "--fail-at-step", str(at.fail)],
            ["--out", str(out / "exception"), "--resume", str(failed)],
        ]
        args: list[str] = []
        for k, fit in enumerate(fits):
            args += [*([THEN] if k else []), *base, *fit]
        return (JOB, *args)


def val_step(at: Positions) -> int:
    """The optimizer steps done when the validation after ``val_after`` micro-batches ended
    (its checkpoint's ``step``)."""
    assert at.val_after % at.val_every == 0
    return at.val_after // ACCUMULATE


ALL_CELLS = [
    Cell(loader, strategy, ranks)
    for ranks, loader, strategy in itertools.product(RANKS, LOADERS, STRATEGIES)
]
CI_CELLS = {"litdata-encoder-2", "generic-fsdp-4"}
assert CI_CELLS <= {cell.name for cell in ALL_CELLS}


def _marks(cell: Cell) -> list[Any]:
    marks = [pytest.mark.jobs(cell.name)]
    return marks if cell.name in CI_CELLS else [*marks, pytest.mark.suite]


def _cells() -> list[Any]:
    return [pytest.param(cell, id=cell.name, marks=_marks(cell)) for cell in ALL_CELLS]


def _cell_positions() -> list[Any]:
    return [
        pytest.param(cell, position, id=f"{cell.name}-{position}", marks=_marks(cell))
        for cell in ALL_CELLS
        for position in cell.positions
    ]


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> dict[str, Any]:
    """One launch per selected cell (``@pytest.mark.jobs``), two at a time, 4-rank cells first
    (the longest); the records are written once, to ``root / "data"``, by the first job."""
    root = tmp_path_factory.mktemp("resume_matrix")
    ordered = sorted(ALL_CELLS, key=lambda cell: -cell.ranks)
    jobs = {cell.name: cell.launch(root) for cell in ordered}
    results = run_jobs(selected(request, jobs), parallel=2, timeout=LAUNCH_TIMEOUT_S)
    return {"root": root, "results": results}


Seen = dict[int, list[list[Any]]]  # rank -> micro-batches


def _fit(launches: dict[str, Any], cell: Cell, fit: str) -> tuple[Seen, dict[int, Any]]:
    """What every rank of ``cell``'s fit ``fit`` trained, and each rank's ``error``."""
    job = result(launches["results"], cell.name)
    out = launches["root"] / cell.name / fit
    seen, errors = {}, {}
    output = (job.stdout + job.stderr)[-6000:]
    for r in range(cell.ranks):
        path = out / f"rank{r}.json"
        assert path.exists(), (
            f"{cell.name}: fit {fit!r} wrote no {path.name} (launch exit {job.returncode},"
            f" timed out: {job.timed_out})\n{output}"
        )
        record = json.loads(path.read_text())
        assert record["world_size"] == cell.ranks
        seen[r], errors[r] = record["seen"], record["error"]
    return seen, errors


def _trained(launches: dict[str, Any], cell: Cell, fit: str) -> Seen:
    """A fit that must have ended normally."""
    seen, errors = _fit(launches, cell, fit)
    failed = {r: e for r, e in errors.items() if e is not None}
    assert not failed, f"{cell.name}: fit {fit!r} failed: {failed}"
    return seen


FIELDS = ("epoch", "global_step", "keys", "padding", "loss_weight", "loss_tokens")


def _diff(expected: list[list[Any]], got: list[list[Any]]) -> str | None:
    """``None`` if the micro-batches are equal, else where and how they differ."""
    if got == expected:
        return None
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    lines = [
        f"{len(got)} micro-batches (the uninterrupted fit: {len(expected)}), {len(bad)} of the"
        f" first {min(len(got), len(expected))} differ"
    ]
    for i in bad[:4]:
        fields = [f"{n} {a!r} -> {b!r}" for n, a, b in zip(FIELDS, expected[i], got[i]) if a != b]
        lines.append(f"  #{i} (step {expected[i][1]}): " + "; ".join(fields))
    return "\n".join(lines)


def _keys(seen: Seen, epoch: int) -> list[int]:
    return sorted(k for batches in seen.values() for b in batches if b[0] == epoch for k in b[2])


def _not_once(keys: list[int]) -> str | None:
    """``None`` if ``keys`` are each record exactly once, else what is wrong."""
    if keys == list(range(SAMPLES)):
        return None
    counts = Counter(keys)
    twice = sorted(k for k, n in counts.items() if n > 1)
    missing = sorted(set(range(SAMPLES)) - set(counts))
    foreign = sorted(set(counts) - set(range(SAMPLES)))
    return (
        f"{len(twice)} records trained more than once {twice[:10]}, {len(missing)} never"
        f" {missing[:10]}, {len(foreign)} unknown {foreign[:10]}"
    )


def _step_start(seen: Seen, step: int) -> int:
    """Micro-batches trained before optimizer step ``step`` (epoch 0, the same on every rank)."""
    starts = {sum(1 for b in batches if b[0] == 0 and b[1] < step) for batches in seen.values()}
    assert len(starts) == 1, starts
    return starts.pop()


def _lending_starts(cell: Cell, seen: Seen) -> int:
    """The first micro-batch (epoch 0) at which some rank trains a record outside its own shard
    (lent) or a padding pack: where generic's tail begins."""
    shares = list(SHARES[cell.ranks])
    shards = [
        ShardedRecords(list(range(SAMPLES)), r, cell.ranks, shares) for r in range(cell.ranks)
    ]
    for i in range(len(seen[0])):
        for r, batches in seen.items():
            epoch, _, keys, padding, *_ = batches[i]
            if epoch == 0 and (padding or any(not shards[r].lo <= k < shards[r].hi for k in keys)):
                return i
    raise AssertionError(f"{cell.name}: no rank trained a lent or padding pack: no tail")


def _position(cell: Cell, position: str, reference: Seen) -> int:
    """Micro-batches of epoch 0 the reference trained before the resumed fit's checkpoint,
    found from the checkpoint's optimizer step and the reference's record; checked to be the
    position it stands for."""
    at, length = cell.at, len(reference[0])
    if position == "val":
        start = at.val_after
        assert start < length, f"{cell.name}: the epoch has {length} micro-batches"
        # the checkpoint's step is the step of the next micro-batch to train
        assert all(reference[r][start][1] == val_step(at) for r in reference), (
            f"{cell.name}: after {start} micro-batches the reference was at step"
            f" {reference[0][start][1]}, not {val_step(at)}"
        )
        return start
    step = {"window": at.window, "tail": at.tail, "exception": at.fail}[position]
    start = _step_start(reference, step)
    assert 0 < start < length, f"{cell.name}: step {step} is not inside the epoch ({length})"
    if position == "window":
        # past every stream's second window: a resume reads from an anchor after its start
        # (generic's smaller shards may hold fewer records: its largest, rank 0's, is checked)
        for r in [0] if cell.loader == "generic" else list(reference):
            records = sum(len(b[2]) for b in reference[r][:start])
            assert records > WORKERS * 2 * at.buffer, (cell.name, r, records)
    if position == "tail":
        lending = _lending_starts(cell, reference)
        assert lending < start, f"{cell.name}: the tail starts at micro-batch {lending} > {start}"
    return start


@pytest.mark.parametrize("cell", _cells())
def test_the_uninterrupted_fit_trains_each_record_once_in_whole_optimizer_steps(
    launches, cell
) -> None:
    seen = _trained(launches, cell, "reference")
    epochs = sorted({b[0] for batches in seen.values() for b in batches})
    assert epochs == [0], epochs
    for epoch in epochs:
        wrong = _not_once(_keys(seen, epoch))
        assert wrong is None, f"{cell.name}: epoch {epoch}: {wrong}"
    # the ranks step together
    steps = {r: [(b[0], b[1]) for b in batches] for r, batches in seen.items()}
    assert all(steps[r] == steps[0] for r in steps), f"{cell.name}: the ranks' steps differ"
    per_step = Counter(steps[0])
    last = max(per_step)
    short = {s: n for s, n in per_step.items() if n != ACCUMULATE and s != last}
    assert not short, f"{cell.name}: optimizer steps of other than {ACCUMULATE} micro-batches"
    assert 1 <= per_step[last] <= ACCUMULATE
    # every pack of a step on every rank: one weight, ranks * accumulate / the step's tokens
    weights: dict[tuple[int, int], set[float]] = defaultdict(set)
    tokens: Counter[tuple[int, int]] = Counter()
    for batches in seen.values():
        for epoch, step, keys, padding, weight, loss_tokens in batches:
            assert (keys == []) == padding, (cell.name, epoch, step, keys, padding)
            weights[epoch, step].add(weight)
            tokens[epoch, step] += loss_tokens
    for key, values in weights.items():
        assert len(values) == 1, f"{cell.name}: step {key} has loss weights {sorted(values)}"
        weight, expected = values.pop(), cell.ranks * ACCUMULATE
        if tokens[key] == 0:
            assert weight == 0.0, (cell.name, key, weight)
        else:
            assert weight * tokens[key] == pytest.approx(expected, rel=1e-9), (
                f"{cell.name}: step {key}: weight {weight} for {tokens[key]} tokens"
            )


@pytest.mark.parametrize(("cell", "position"), _cell_positions())
def test_a_resumed_fit_trains_exactly_the_uninterrupted_micro_batches(
    launches, cell, position
) -> None:
    reference = _trained(launches, cell, "reference")
    start = _position(cell, position, reference)
    if position == "exception":  # the failing fit: the reference's first micro-batches
        failed, errors = _fit(launches, cell, "failed")
        for r in range(cell.ranks):
            assert errors[r] is not None and INJECTED in errors[r], (cell.name, r, errors[r])
            assert failed[r] == reference[r][:start], (
                f"{cell.name}: rank {r}: the failing fit's {len(failed[r])} micro-batches are"
                f" not the reference's first {start}"
            )
    resumed = _trained(launches, cell, position)
    for r in range(cell.ranks):
        wrong = _diff(reference[r][start:], resumed[r])
        assert wrong is None, (
            f"{cell.name} resumed at {position} (micro-batch {start}, step"
            f" {reference[r][start][1]}): rank {r}: {wrong}"
        )


@pytest.mark.parametrize(("cell", "position"), _cell_positions())
def test_before_the_checkpoint_and_after_the_resume_each_record_is_trained_once(
    launches, cell, position
) -> None:
    reference = _trained(launches, cell, "reference")
    start = _position(cell, position, reference)
    resumed = _trained(launches, cell, position)
    joined = {r: reference[r][:start] + resumed[r] for r in range(cell.ranks)}
    epochs = sorted({b[0] for batches in joined.values() for b in batches})
    assert epochs == [0], epochs
    for epoch in epochs:
        wrong = _not_once(_keys(joined, epoch))
        assert wrong is None, (
            f"{cell.name} resumed at {position} (micro-batch {start}): epoch {epoch}: {wrong}"
        )
