"""A streamed loader under tensor parallelism: 4 gloo processes, 2 data-parallel ranks of 2
tensor-parallel peers each (consecutive processes, as a ``(data_parallel, tensor_parallel)``
device mesh orders them), uneven shards (the data-parallel ranks' streams end at different
global batches).

Tensor-parallel peers read the same records and never lend packs; each data-parallel rank
trains its own packs and pads once its streams have ended. So: both peers of a data-parallel
rank train the same packs in the same order; the data-parallel ranks together train every
record exactly once; every process takes the same number of steps; and each step's packs carry
one loss-token count, that of the data-parallel ranks' packs (each counted once, not once per
peer).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch

from harness.ranks import run_ranks
from lightning_vlmbalance import streams as stream_data

SEQ_LEN = 256
RECORDS = 120
COPIES = 2  # tensor-parallel peers of each data-parallel rank
SHARES = [0.75, 0.25]  # data-parallel rank 1's streams end first


def _tensor_parallel_trainer(rank: int, world: int) -> Any:
    """What the loader reads of a Trainer under a (data_parallel, tensor_parallel) mesh."""
    strategy = SimpleNamespace(
        world_size=world,
        global_rank=rank,
        distributed_sampler_kwargs={"num_replicas": world // COPIES, "rank": rank // COPIES},
        root_device=torch.device("cpu"),
    )
    return SimpleNamespace(
        strategy=strategy,
        accumulate_grad_batches=2,
        training=True,
        num_training_batches=float("inf"),
    )


def _tensor_parallel_job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    records = stream_data.synthetic_records(RECORDS, seed=7)
    dp_rank = rank // COPIES
    source = stream_data.ShardedRecords(records, dp_rank, world // COPIES, SHARES)
    loader = stream_data.stream_loader(
        source, SEQ_LEN, buffer=16, trainer=_tensor_parallel_trainer(rank, world)
    )
    loader.sampler.set_epoch(0)
    packs = [
        {
            "keys": list(p["meta"]["keys"]),
            "padding": bool(p["meta"]["padding"]),
            "global_loss_tokens": int(p["global_loss_tokens"]),
            "loss_tokens": int(p["loss_tokens"]),
            "weighted_for": list(p["meta"]["weighted_for"]),
        }
        for p in loader
    ]
    return {"packs": packs, "padding_packs": loader.padding_packs}


def test_tensor_parallel_peers_train_the_same_packs_and_every_record_once() -> None:
    out = run_ranks(_tensor_parallel_job, 4, timeout=240)
    assert all(status == "ok" for status, _ in out.values()), out
    runs = [out[r][1]["packs"] for r in range(4)]
    # peers of one data-parallel rank: the same packs, in the same order
    assert runs[0] == runs[1] and runs[2] == runs[3]
    # every process steps together: as many micro-batches each
    assert len({len(run) for run in runs}) == 1
    # the data-parallel ranks train every record exactly once
    trained = Counter(key for run in (runs[0], runs[2]) for p in run for key in p["keys"])
    assert len(trained) == RECORDS and set(trained.values()) == {1}, trained.most_common(3)
    # rank 1's streams ended first: it padded while rank 0 still had packs (none lent)
    assert out[2][1]["padding_packs"] > 0
    # each optimizer step's loss tokens: the data-parallel ranks' packs, each counted once
    for start in range(0, len(runs[0]), 2):
        step = [p for run in (runs[0], runs[2]) for p in run[start : start + 2]]
        total = sum(p["loss_tokens"] for p in step)
        assert {p["global_loss_tokens"] for p in step} == {total}, start
        assert {tuple(p["weighted_for"]) for p in step} == {(2, 2)}
