"""RebalancingLoader on real gloo ranks: every pack once, planned order, global token counts."""

from __future__ import annotations

import pytest
import torch

import lightning_vlmbalance as vb
from harness.ranks import run_ranks
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.loaders.rebalancing import _batch_features as batch_features
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


def _loader_job(rank: int, world: int, mode: str, micro_steps: int) -> dict:
    table = synthetic_length_table(400, tile_tokens=8, max_text_tokens=64, seed=3)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128)
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    inner = vb.PackedDataLoader(ds, sampler)
    group = torch.distributed.new_group(backend="gloo")
    loader = RebalancingLoader(
        inner,
        micro_steps=micro_steps,
        num_replicas=world,
        rank=rank,
        group=group,
        mode=mode,
        exchange_timeout_s=60,
    )
    own = [(b["meta"]["pack_id"], b["loss_tokens"]) for b in inner]  # reading order, no rebalance
    seen = []
    for b in loader:
        seen.append(
            (
                b["meta"]["pack_id"],
                list(b["meta"]["sample_ids"]),
                b["loss_tokens"],
                b["global_loss_tokens"],
            )
        )
    threads = [t.name for t in __import__("threading").enumerate()]
    second = [
        (
            b["meta"]["pack_id"],
            list(b["meta"]["sample_ids"]),
            b["loss_tokens"],
            b["global_loss_tokens"],
        )
        for b in loader
    ]
    return {
        "own": own,
        "seen": seen,
        "len": len(loader),
        "stats": list(loader.stats),
        "threads": threads,
        "second_pass": second,
    }


@pytest.mark.parametrize(("mode", "G"), [("overlap", 4), ("sync", 7)])
def test_every_pack_once_with_the_global_token_count(mode, G) -> None:
    """G = 7 leaves a short last global batch (the pack count is not a multiple of it). Mode
    "off" is covered in real fits (tests/balance/test_loss.py)."""
    out = run_ranks(_loader_job, 2, mode, G, timeout=180, start_method="forkserver")
    assert all(status == "ok" for status, _ in out.values()), out
    res = {r: payload for r, (_, payload) in out.items()}
    n = res[0]["len"]
    assert n == res[1]["len"] == len(res[0]["seen"]) == len(res[1]["seen"])
    if G == 7:
        assert n % G, "the short last global batch is not exercised"
    assert res[0]["second_pass"] == res[0]["seen"]  # a second pass: the same packs, same places
    # every sample exactly once over both ranks
    samples = sorted(s for r in res for _, ids, _, _ in res[r]["seen"] for s in ids)
    assert samples == list(range(400))
    for start in range(0, n, G):
        # the global batch is the same set of packs, only placed differently
        before = {p for r in res for p, _ in res[r]["own"][start : start + G]}
        after = {p for r in res for p, *_ in res[r]["seen"][start : start + G]}
        assert before == after
        tokens = sum(t for r in res for _, t in res[r]["own"][start : start + G])
        assert {g for r in res for *_, g in res[r]["seen"][start : start + G]} == {tokens}
    moved = sum(s["moved_packs"] for s in res[0]["stats"])
    if mode == "off":
        assert [p for p, *_ in res[0]["seen"]] == [p for p, _ in res[0]["own"]]
        assert moved == 0
    else:
        assert moved > 0
    # the exchange thread is joined when the pass ends
    assert not any(name == "vlmbalance-exchange" for r in res for name in res[r]["threads"])


def test_batch_without_metadata_is_named() -> None:
    with pytest.raises(ValueError, match="'meta' and 'loss_tokens'"):
        batch_features({"input_ids": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"batch\['meta'\]\['doc_lens'\]"):
        batch_features(
            {
                "loss_tokens": 3,
                "meta": {"total_tokens": 1, "image_tokens": 0, "images": 0, "image_sizes": []},
            }
        )


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="mode='fast'"):
        RebalancingLoader([], micro_steps=2, num_replicas=1, rank=0, mode="fast")
    with pytest.raises(ValueError, match="micro_steps=0"):
        RebalancingLoader([], micro_steps=0, num_replicas=1, rank=0)


def test_the_wrapper_shows_lightning_the_inner_loaders_sampler_and_nothing_else() -> None:
    """What Lightning reads of a training loader (the sampler and batch sampler it calls
    ``set_epoch`` on, the dataset it checks for iterability, the worker iterator it shuts down
    at teardown) is the inner loader's; anything else of the inner loader is not the wrapper's."""
    table = synthetic_length_table(40, tile_tokens=8, max_text_tokens=64, seed=3)
    sampler = vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=128, num_replicas=1, rank=0
    )
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    inner = vb.PackedDataLoader(ds, sampler, num_workers=0)
    wrapped = RebalancingLoader(inner, micro_steps=2, num_replicas=1, rank=0)
    assert wrapped.sampler is inner.sampler and wrapped.batch_sampler is inner.batch_sampler
    assert wrapped.dataset is ds and wrapped._iterator is None
    wrapped._iterator = None  # Lightning's teardown: reaches the inner loader
    for name in ("collate_fn", "dataloader_kwargs", "trainer", "pack_source", "state_at"):
        assert hasattr(inner, name) and not hasattr(wrapped, name), name
    plain = RebalancingLoader([], micro_steps=2, num_replicas=1, rank=0)  # any iterable of packs
    assert plain.sampler is None and plain.dataset is None and plain._iterator is None
    # Lightning's set_epoch reaches the inner sampler through the wrapper
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(wrapped, 3)
    assert inner.sampler.epoch == 3


def _overlapped_loader(rank: int, world: int, *, micro_steps: int, timeout_s: float):
    """The overlapped RebalancingLoader over 400 synthetic samples that the jobs below share."""
    table = synthetic_length_table(400, tile_tokens=8, max_text_tokens=64, seed=3)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128)
    inner = vb.PackedDataLoader(SyntheticVLMDataset(table, vocab_size=32, patch_dim=4), sampler)
    return RebalancingLoader(
        inner,
        micro_steps=micro_steps,
        num_replicas=world,
        rank=rank,
        group=torch.distributed.new_group(backend="gloo"),
        mode="overlap",
        exchange_timeout_s=timeout_s,
    )


def _early_close_job(rank: int, world: int) -> dict:
    import threading
    import time

    loader = _overlapped_loader(rank, world, micro_steps=4, timeout_s=30)
    start = time.monotonic()
    for i, _ in enumerate(loader):  # stop mid global batch, as max_steps may
        if i == 5:
            break
    closed_in = time.monotonic() - start
    alive = [t.name for t in threading.enumerate() if t.name == "vlmbalance-exchange"]
    ids = [s for b in loader for s in b["meta"]["sample_ids"]]  # a new full pass still works
    return {"closed_in": closed_in, "alive": alive, "ids": ids}


def test_closing_early_joins_the_thread_without_a_stray_collective() -> None:
    """Both ranks stop after the same micro-batch: no rank waits in a collective its peer
    skipped, the thread is joined at once, and the next pass is complete."""
    out = run_ranks(_early_close_job, 2, timeout=180, start_method="forkserver")
    assert all(status == "ok" for status, _ in out.values()), out
    for _, res in out.values():
        assert res["alive"] == []
        assert res["closed_in"] < 20  # far from the 30 s exchange deadline
    assert sorted(out[0][1]["ids"] + out[1][1]["ids"]) == list(range(400))


def _failing_job(rank: int, world: int) -> str:
    import time

    import lightning_vlmbalance.loaders.global_batch as loader_mod

    if rank == 1:

        def failing(*args, **kwargs):
            raise RuntimeError("rank 1 failed on purpose in its exchange")

        loader_mod.exchange_packs = failing
    loader = _overlapped_loader(rank, world, micro_steps=4, timeout_s=5)
    start = time.monotonic()
    try:
        for _ in loader:
            pass
    except Exception as err:
        if rank == 1:
            raise
        return f"{time.monotonic() - start:.1f}s {type(err).__name__}: {err}"
    return "no error"


def test_a_rank_failing_in_its_exchange_is_an_error_on_the_others() -> None:
    out = run_ranks(_failing_job, 2, timeout=120, start_method="forkserver")
    assert out[1] == ("error", "RuntimeError: rank 1 failed on purpose in its exchange"), out
    status, message = out[0]
    assert status == "ok" and message.split("s ", 1)[1].startswith("ExchangeError"), out
    assert float(message.split("s ", 1)[0]) < 5 + 5, message  # the deadline, with slack


def _abandoned_pass_job(rank: int, world: int) -> dict:
    import threading
    import time

    import lightning_vlmbalance.loaders.global_batch as loader_mod

    # the old pass's exchanges take a while, so its thread is inside one when the new pass
    # begins (the new pass's own exchanges need not be slow: its first global batch is where an
    # old thread still running shows); every global batch records how many exchange threads
    # were alive when it started
    exchange, started_with, old_threads = loader_mod.exchange_packs, [], []

    def slow_exchange(*args, **kwargs):
        if not old_threads or threading.current_thread() in old_threads:
            time.sleep(0.5)
        return exchange(*args, **kwargs)

    def counted(self, *step):
        started_with.append(sum(t.name == "vlmbalance-exchange" for t in threading.enumerate()))
        return rebalance(self, *step)

    rebalance = RebalancingLoader._rebalance
    loader_mod.exchange_packs = slow_exchange
    RebalancingLoader._rebalance = counted
    loader = _overlapped_loader(rank, world, micro_steps=2, timeout_s=30)
    abandoned = iter(loader)  # kept alive, as Lightning's data fetcher keeps its iterator
    for _ in range(3):  # mid global batch; the thread is preparing the next one
        next(abandoned)
    time.sleep(0.1)  # the old thread is now in its exchange of the next global batch
    old_threads.extend(t for t in threading.enumerate() if t.name == "vlmbalance-exchange")
    assert len(old_threads) == 1, old_threads  # the abandoned pass's, still slow
    started_with.clear()
    ids = [s for batch in loader for s in batch["meta"]["sample_ids"]]  # the new pass
    del abandoned
    return {"started_with": started_with, "ids": ids}


def test_a_new_pass_stops_an_abandoned_one_before_it_starts() -> None:
    """The new pass's first collective must not run while the old pass's thread still runs its
    own on the same group: the old one is closed (joined) first, and the new pass is complete."""
    out = run_ranks(_abandoned_pass_job, 2, timeout=180, start_method="forkserver")
    assert all(status == "ok" for status, _ in out.values()), out
    for r in (0, 1):  # the new pass's first global batch is prepared in the caller's thread
        assert max(out[r][1]["started_with"]) == 1, out[r][1]["started_with"]
    assert sorted(out[0][1]["ids"] + out[1][1]["ids"]) == list(range(400))


def _reused_dicts_job(rank: int, world: int) -> dict:
    """A loader that yields the same dicts every pass (a list), under encoder balancing: its
    dicts come back as it made them, and a second pass plans its own routes."""
    table = synthetic_length_table(120, tile_tokens=8, max_text_tokens=64, seed=3)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128)
    sampler.set_data_parallel(world, rank)
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    packs = list(vb.PackedDataLoader(ds, sampler))
    keys = [set(b) for b in packs]
    loader = RebalancingLoader(
        packs, micro_steps=2, num_replicas=world, rank=rank, mode="sync", encoder=True
    )
    first = [b["encoder_route"] for b in loader]
    second = [b["encoder_route"] for b in loader]
    return {
        "unchanged": [set(b) == k for b, k in zip(packs, keys)],
        "routes": len(first),
        "fresh_routes": all(a is not b for a, b in zip(first, second)),
    }


def test_a_loader_that_yields_the_same_dicts_again_gets_them_back_as_it_made_them() -> None:
    """Routes, received images and loss weights stay with the training step they were planned
    for: the inner loader's dicts (reused for another epoch, or for validation) are not written
    (a reused dict once handed its stale route to validation: mismatched all-to-alls)."""
    out = run_ranks(_reused_dicts_job, 2, timeout=120, start_method="forkserver")
    assert all(status == "ok" for status, _ in out.values()), out
    for _, res in out.values():
        assert res["routes"] > 0 and all(res["unchanged"]) and res["fresh_routes"], res
