"""RebalancingLoader on real gloo ranks: every pack once, planned order, global token counts."""

from __future__ import annotations

import pytest
import torch

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.loader import RebalancingLoader, batch_features
from tests.multiproc import run_ranks


def _loader_job(rank: int, world: int, mode: str, micro_steps: int) -> dict:
    table = vb.synthetic_length_table(400, tile_tokens=8, max_text_tokens=64, seed=3)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=128)
    ds = vb.SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    inner = vb.PackedDataLoader(ds, sampler)
    group = torch.distributed.new_group(backend="gloo")
    loader = RebalancingLoader(
        inner,
        micro_steps=micro_steps,
        world_size=world,
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
    return {"own": own, "seen": seen, "len": len(loader), "stats": loader.stats, "threads": threads}


@pytest.mark.parametrize("mode", ["sync", "overlap", "off"])
def test_every_pack_once_with_the_global_token_count(mode) -> None:
    G = 4
    out = run_ranks(_loader_job, 2, mode, G, timeout=180)
    assert all(status == "ok" for status, _ in out.values()), out
    res = {r: payload for r, (_, payload) in out.items()}
    n = res[0]["len"]
    assert n == res[1]["len"] == len(res[0]["seen"]) == len(res[1]["seen"])
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
        RebalancingLoader([], micro_steps=2, world_size=1, rank=0, mode="fast")
    with pytest.raises(ValueError, match="micro_steps=0"):
        RebalancingLoader([], micro_steps=0, world_size=1, rank=0)
