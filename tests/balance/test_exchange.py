"""Pack exchange: exact round trips, real gloo transfers, and errors instead of hangs."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from harness.ranks import run_ranks
from lightning_vlmbalance.balance.exchange import (
    ExchangeError,
    decode_pack,
    encode_pack,
    exchange_packs,
    wait_pack_ready,
)


def _pack(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (1, 37), generator=g),
        "pixel_values": torch.randn(5, 6, generator=g, dtype=torch.float64).t(),  # not contiguous
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(4, generator=g) > 0.5,
        "cu_seqlens": torch.tensor([0, 10, 37], dtype=torch.int32),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "max_seqlen": 27,
        "global_loss_tokens": 30,
        "meta": {"pack_id": seed, "doc_lens": [10, 27], "name": "x", "none": None, "t": (1, 2.5)},
    }


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_encode_decode_round_trip_is_exact() -> None:
    pack = _pack(1)
    spec, payload = encode_pack(pack)
    assert spec.dtype == payload.dtype == torch.uint8
    _assert_same(decode_pack(spec, payload), pack)


def test_encode_rejects_what_is_not_a_pack() -> None:
    with pytest.raises(TypeError, match=r"pack\['meta'\]\['obj'\] is a object"):
        encode_pack({"meta": {"obj": object()}})
    with pytest.raises(TypeError, match="non-string key 3"):
        encode_pack({3: torch.zeros(1)})


def _exchange_job(rank: int, world: int, moves: list) -> list:
    group = torch.distributed.new_group(backend="gloo")
    payload_group = torch.distributed.new_group(backend="gloo")  # as NCCL is on GPUs
    mine = {p: _pack(p) for p, src, _ in moves if src == rank}
    got = exchange_packs(
        mine, moves, rank=rank, group=group, timeout_s=30, payload_group=payload_group
    )
    for p, pack in got.items():
        _assert_same(pack, _pack(p))
    return sorted(got)


def test_packs_arrive_intact_over_gloo() -> None:
    """Only moved packs travel; each arrives bit-identical at its destination (specs on one
    group, payloads on another, as on GPUs)."""
    moves = [(0, 0, 1), (1, 0, 2), (2, 1, 0), (5, 2, 0), (6, 2, 1), (7, 1, 1)]  # 7: stays
    out = run_ranks(_exchange_job, 3, moves, start_method="forkserver")
    assert out == {0: ("ok", [2, 5]), 1: ("ok", [0, 6]), 2: ("ok", [1])}


DEADLINE_S = 1  # exchange_timeout_s of the failing-peer jobs: waited out in every run


def _faulty_job(rank: int, world: int, how: str, done_flag: str) -> str:
    moves = [(0, 1, 0), (1, 0, 1)]
    if rank == 1:
        if how == "raise":
            # alive but never sends, until rank 0 has its answer: rank 0 can only get out
            # through its own deadline, however slow the machine is
            flag, cap = Path(done_flag), time.monotonic() + 120
            while not flag.exists() and time.monotonic() < cap:
                time.sleep(0.05)
            raise RuntimeError("rank 1 failed on purpose")
        os._exit(3)  # killed mid-exchange
    start = time.monotonic()
    try:
        exchange_packs({1: _pack(1)}, moves, rank=0, timeout_s=DEADLINE_S)
    except ExchangeError as err:
        return f"{time.monotonic() - start:.3f}s {err}"
    finally:
        Path(done_flag).touch()
    return "no error"


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_failing_peer_is_an_error_within_the_timeout(how, tmp_path) -> None:
    """A peer that never sends (alive, or dead) is an ``ExchangeError`` naming the timeout and
    the pending pack, never a hang: rank 0 reports at all (``run_ranks`` kills a rank stuck past
    its 120 s cap), while a silent peer is still alive. An error is never raised before the
    deadline while the peer lives (a lower bound, whatever the load); how long after it comes
    depends on the machine, and is not asserted."""
    flag = str(tmp_path / "rank0_done")
    out = run_ranks(_faulty_job, 2, how, flag, timeout=120, start_method="forkserver")
    status, message = out[0]
    assert status == "ok" and message != "no error", out
    assert re.search(rf"exchange_timeout_s={DEADLINE_S}\b", message), message
    assert "pack 0 from 1" in message
    seconds = float(message.split("s ", 1)[0])
    if how == "raise":
        # the peer was alive and silent until rank 0 answered: only the deadline got it out
        assert seconds >= DEADLINE_S - 0.01, message  # gloo rounds its wait to milliseconds
        assert out[1] == ("error", "RuntimeError: rank 1 failed on purpose"), out
    else:
        assert out[1] == ("missing", 3), out


def _cuda_exchange_job(rank: int, world: int, moves: list) -> list:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = torch.distributed.new_group(backend="gloo")
    payload_group = torch.distributed.new_group(backend="nccl")
    mine = {p: _pack(p) for p, src, _ in moves if src == rank}
    events: dict = {}
    side = torch.cuda.Stream(device)
    got = exchange_packs(
        mine,
        moves,
        rank=rank,
        group=group,
        timeout_s=60,
        payload_group=payload_group,
        device=device,
        stream=side,
        ready_events=events,
    )
    assert sorted(events) == sorted(got)
    for p, pack in got.items():
        wait_pack_ready(pack, events[p])  # the compute stream waits for this pack only
        assert pack["input_ids"].device == device
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in pack.items()}
        _assert_same(cpu, _pack(p))
    return sorted(got)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="the NCCL payload path needs two GPUs",
)
def test_packs_arrive_intact_over_nccl_on_a_side_stream() -> None:
    moves = [(0, 0, 1), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    out = run_ranks(_cuda_exchange_job, 2, moves)
    assert out == {0: ("ok", [2]), 1: ("ok", [0, 1])}
