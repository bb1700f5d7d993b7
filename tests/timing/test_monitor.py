"""The monitor's framework-free core, :class:`StragglerRecorder`, without a Lightning Trainer.

Steps are timed on the fake host clock (``tests/timing/fake_clock.py``), so every millisecond in
the JSON lines and the totals is exact.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import lightning_vlmbalance.timing as timing_pkg
from harness.ranks import run_ranks
from lightning_vlmbalance.timing import (
    LIGHTNING_SYNC,
    SERIES,
    SYNC_WAIT,
    StragglerRecorder,
)
from tests.timing import fake_clock
from tests.timing.fake_clock import FakeClock

RECORD_FIELDS = {
    "v", "rank", "world_size", "global_step", "epoch", "micro_batches", "step_ms",
    "between_steps_ms", "outside_step_ms", "phases_ms", "micro",
}  # fmt: skip


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return fake_clock.install(monkeypatch)


def _train(recorder: StragglerRecorder, clock: FakeClock, steps: range, vision_s: float) -> None:
    """Optimizer steps of two micro-batches: 1 ms of data, ``vision_s`` of vision forward, and
    2 ms waiting at the all-reduce in the second; each step is collected as it ends."""
    timer = recorder.timer
    for step in steps:
        for micro in range(2):
            timer.set_features({"pack_id": 10 * step + micro})
            timer.start("data", host=True)
            clock.sleep(0.001)
            timer.stop("data")
            timer.start("vision_fwd")
            clock.sleep(vision_s)
            timer.stop("vision_fwd")
            timer.start("backward")
            if micro == 1:
                timer.mark_sync_entry()
                clock.sleep(0.002)
            timer.stop_backward()
            timer.end_micro()
        timer.end_step(step, epoch=0)
        recorder.collect()


def test_records_steps_writes_json_lines_and_round_trips_its_totals(clock, tmp_path) -> None:
    """Each optimizer step is one JSON line; a gather adds it to the whole-run totals, which
    the state dict carries to a new recorder unchanged."""
    path = tmp_path / "straggler" / "rank_0.jsonl"
    path.parent.mkdir()
    recorder = StragglerRecorder()
    recorder.start(path, start_step=0)
    _train(recorder, clock, range(1, 4), vision_s=0.01)
    recorder.gather()  # one rank, no process group: its own row; flushes the file
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == RECORD_FIELDS
    assert rows[0]["rank"] == 0 and rows[0]["world_size"] == 1 and rows[0]["micro_batches"] == 2
    assert rows[0]["phases_ms"]["vision_fwd"] == pytest.approx(20.0)
    assert rows[0]["phases_ms"][SYNC_WAIT] == pytest.approx(2.0)
    assert rows[0]["step_ms"] == pytest.approx(24.0)
    assert [m["pack_id"] for m in rows[2]["micro"]] == [30, 31]

    assert recorder.steps_timed == 3
    assert recorder.total_step_ms.tolist() == pytest.approx([72.0])
    assert recorder.total_wait_ms.tolist() == pytest.approx([6.0])
    metrics = recorder.metrics()  # means since the last call
    assert set(metrics) == {f"straggler/{s}_ms/rank_0" for s in SERIES} | {
        "straggler/waste_frac", "straggler/worst_rank", "straggler/max_over_median"
    }  # fmt: skip
    assert metrics["straggler/vision_fwd_ms/rank_0"] == pytest.approx(20.0)
    assert metrics[f"straggler/{LIGHTNING_SYNC}_ms/rank_0"] == 0.0
    assert metrics["straggler/waste_frac"] == pytest.approx(6 / 72)
    assert recorder.metrics() == {}  # nothing gathered since

    state = recorder.state_dict()
    assert state == json.loads(json.dumps(state))  # plain values: any checkpoint format
    restored = StragglerRecorder()
    restored.load_state_dict(state)
    assert restored.state_dict() == state and restored.summary() == recorder.summary()
    assert restored.summary()["steps_timed"] == 3
    assert restored.summary()["wait_ms_per_rank"] == [6.0]
    recorder.close()
    assert not recorder.is_open


def test_a_resume_truncates_the_file_past_its_step_and_keeps_counting(clock, tmp_path) -> None:
    """Restarting at step 2 drops the records of steps 3 and later and a line cut short by a
    crash; the file then holds each step once, and the totals go on from the state dict."""
    path = tmp_path / "rank_0.jsonl"
    first = StragglerRecorder()
    first.start(path, start_step=0)
    _train(first, clock, range(1, 3), vision_s=0.01)
    first.gather()  # a checkpoint at step 2
    state = first.state_dict()
    _train(first, clock, range(3, 5), vision_s=0.01)  # trained again after the resume
    first.flush()
    first.close()
    with open(path, "a") as fh:
        fh.write('{"v": 1, "rank": 0, "global_')  # a crash mid-line
    resumed = StragglerRecorder()
    resumed.load_state_dict(state)
    resumed.start(path, start_step=2)
    assert [json.loads(x)["global_step"] for x in path.read_text().splitlines()] == [1, 2]
    _train(resumed, clock, range(3, 5), vision_s=0.03)
    resumed.gather()
    resumed.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["phases_ms"]["vision_fwd"] == pytest.approx(60.0)
    assert resumed.steps_timed == 4
    assert resumed.total_step_ms.tolist() == pytest.approx([2 * 24.0 + 2 * 64.0])


def test_a_new_world_size_restarts_the_totals(clock, tmp_path) -> None:
    """Totals of 2 ranks cannot continue on 1: they restart (with a warning)."""
    recorder = StragglerRecorder()
    recorder.load_state_dict({"total_step_ms": [5.0, 6.0], "total_wait_ms": [1.0, 0.0],
                              "steps_timed": 2})  # fmt: skip
    recorder.start(tmp_path / "rank_0.jsonl", start_step=2, rank=0, world_size=1)
    assert recorder.state_dict() == {"total_step_ms": [0.0], "total_wait_ms": [0.0],
                                     "steps_timed": 0}  # fmt: skip


def _two_ranks(rank: int, world: int, out: str) -> dict:
    """Rank 1's vision forward takes 30 ms more; rank 0 times one step fewer."""
    from lightning_vlmbalance.timing import timer as timer_mod

    clock = FakeClock()
    timer_mod.time = clock  # this process's own module: nothing to restore
    recorder = StragglerRecorder()
    recorder.start(Path(out) / f"rank_{rank}.jsonl", start_step=0, rank=rank, world_size=world)
    _train(recorder, clock, range(1, 4 - (rank == 0)), vision_s=0.01 + 0.015 * rank)
    recorder.gather()  # the default (gloo) process group
    return {"state": recorder.state_dict(), "summary": recorder.summary()}


def test_gather_over_a_process_group_gives_every_rank_the_same_totals(tmp_path) -> None:
    """A real 2-rank gloo gather: both ranks hold every rank's totals; ``steps_timed`` counts
    the steps that every rank timed."""
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=60, start_method="forkserver")
    assert {r: status for r, (status, _) in results.items()} == {0: "ok", 1: "ok"}, results
    (_, a), (_, b) = results[0], results[1]
    assert a == b
    assert a["state"]["steps_timed"] == 2
    assert a["state"]["total_step_ms"] == pytest.approx([2 * 24.0, 3 * 54.0])
    assert a["summary"]["slowest_rank"] == 1
    row = json.loads((tmp_path / "rank_1.jsonl").read_text().splitlines()[0])
    assert row["rank"] == 1 and row["world_size"] == 2


def test_the_core_imports_no_lightning() -> None:
    """The timing core runs without Lightning: no module of ``timing/`` imports it."""
    for path in Path(timing_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), (
                path.name,
                names,
            )


def test_collective_waits_subtract_each_calls_shortest_time() -> None:
    """Time in FSDP's collectives -> the wait there: call by call, the rank that arrived last
    (the shortest time in that call) waited for nobody; its time is the call's own cost."""
    import numpy as np

    from lightning_vlmbalance.timing import MEASURED_PHASES, SERIES
    from lightning_vlmbalance.timing.summary import collective_waits

    column = 1 + MEASURED_PHASES.index("collective_wait")
    table = np.zeros((2, 1 + len(SERIES)))
    table[:, 0] = 1  # one step each
    # rank 0 is last at call 0 (3 ms of cost), rank 1 is last at call 1 (2 ms of cost)
    calls = np.array([[3.0, 12.0], [43.0, 2.0]])
    table[:, column] = calls.sum(axis=1)
    exact = collective_waits(table, calls)
    assert exact[:, column].tolist() == [10.0, 40.0]
    # without the calls: the excess over the rank with the least in all, which misses rank 0's
    # wait at call 1 when the last rank changes from call to call
    rough = collective_waits(table)
    assert rough[:, column].tolist() == [0.0, 30.0]
    assert (exact[:, column] >= rough[:, column]).all()


def test_packing_efficiency_rides_the_gather_over_every_rank(clock, tmp_path) -> None:
    """``packing/efficiency`` is the real tokens over the capacity of the packs noted on every
    rank since the last ``metrics()``, gathers at checkpoint saves included; it rides the
    timings' gather (the rows stay those of the timings) and is absent without a noted pack."""
    recorder = StragglerRecorder()
    recorder.start(tmp_path / "rank_0.jsonl", start_step=0, rank=0, world_size=2)
    gathered: list[list[float]] = []

    def all_gather(row):  # two ranks: rank 1 noted packs holding 100 of 128 tokens
        gathered.append(row.tolist())
        other = row.clone()
        other[-2:] = torch.tensor([100.0, 128.0], dtype=row.dtype)
        return torch.stack([row, other])

    _train(recorder, clock, range(1, 3), vision_s=0.01)
    recorder.note_pack(tokens=128, capacity=128)
    recorder.note_pack(tokens=64, capacity=128)
    recorder.gather(all_gather)  # a checkpoint save: gathered, not reported yet
    recorder.note_pack(tokens=96, capacity=128)
    recorder.gather(all_gather)  # a log point
    assert [row[-2:] for row in gathered] == [[192.0, 256.0], [96.0, 128.0]]
    assert all(len(row) == 1 + len(SERIES) + 2 for row in gathered)
    metrics = recorder.metrics()
    assert metrics["packing/efficiency"] == pytest.approx((192 + 96 + 2 * 100) / (5 * 128))
    assert metrics["straggler/vision_fwd_ms/rank_1"] == pytest.approx(20.0)
    assert recorder.steps_timed == 2  # the packs' columns are not timings
    assert recorder.metrics() == {}  # nothing gathered since

    alone = StragglerRecorder()  # no pack noted (batches that are not packed batches): no value
    alone.start(tmp_path / "alone.jsonl", start_step=0)
    _train(alone, clock, range(1, 2), vision_s=0.01)
    alone.gather()
    assert "packing/efficiency" not in alone.metrics()
    alone.close()
    recorder.close()
