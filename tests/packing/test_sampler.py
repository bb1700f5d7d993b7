"""PackingSampler and PackedDataLoader outside Lightning: resume, epochs, mismatches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_vlmbalance as vb
from lightning_vlmbalance.synthetic import LengthTable, SyntheticVLMDataset, synthetic_length_table


def _setup(n: int = 400, rank: int = 0, world_size: int = 2, **kw):
    table = synthetic_length_table(n, tile_tokens=8, max_text_tokens=64, seed=5)
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    sampler = vb.PackingSampler(
        table.total_tokens,
        table.image_tokens,
        seq_len=128,
        num_replicas=world_size,
        rank=rank,
        window=50,
        **kw,
    )
    loader = vb.PackedDataLoader(ds, sampler, vb.PackCollator(128, image_feature_shape=(4,)))
    return table, ds, sampler, loader


def _ids(loader) -> list[int]:
    return [b["meta"]["pack_id"] for b in loader]


def test_sampler_yields_the_plan_of_its_rank() -> None:
    _, _, s0, _ = _setup(rank=0)
    _, _, s1, _ = _setup(rank=1)
    packs = list(s0) + list(s1)
    assert len(list(s0)) == len(list(s1)) == len(s0)
    assert sorted(i for p in packs for i in p) == list(range(400))


@settings(max_examples=15, deadline=None)
@given(k=st.integers(0, 40), epoch=st.integers(0, 2))
def test_resume_after_k_packs_yields_exactly_the_rest(k: int, epoch: int) -> None:
    """Resume after k packs yields exactly the remaining sequence."""
    _, _, sampler, loader = _setup(rank=1)
    sampler.set_epoch(epoch)
    full = _ids(loader)
    k = min(k, len(full))
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    assert state["consumed"] == k and state["epoch"] == epoch
    _, _, _, fresh = _setup(rank=1)
    fresh.load_state_dict(state)
    assert _ids(fresh) == full[k:]
    assert _ids(fresh) == full  # the resume position applies to one pass only


def test_set_epoch_after_resume_of_an_older_epoch_starts_fresh() -> None:
    _, _, sampler, loader = _setup()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    _, _, s2, fresh = _setup()
    fresh.load_state_dict(state)
    s2.set_epoch(1)
    sampler.set_epoch(1)
    assert _ids(fresh) == _ids(loader)


def test_epochs_reshuffle() -> None:
    _, _, sampler, _ = _setup()
    e0 = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != e0


def test_config_mismatch_on_resume_is_named() -> None:
    _, _, _, loader = _setup()
    state = loader.state_dict()
    _, _, _, other = _setup(seed=11)
    with pytest.raises(ValueError, match="seed: saved 0, now 11"):
        other.load_state_dict(state)


def test_length_table_and_dataset_size_mismatch() -> None:
    _, ds, sampler, _ = _setup()
    short = torch.utils.data.Subset(ds, range(len(ds) - 1))
    with pytest.raises(ValueError, match="399 samples but the sampler's length table has 400"):
        vb.PackedDataLoader(short, sampler)


def test_length_table_and_sample_mismatch_names_the_sample() -> None:
    table, ds, _, _ = _setup(world_size=1)
    wrong = table.total_tokens.copy()
    wrong[7] += 1
    sampler = vb.PackingSampler(wrong, table.image_tokens, seq_len=128, num_replicas=1, rank=0)
    loader = vb.PackedDataLoader(ds, sampler, vb.PackCollator(128))
    with pytest.raises(ValueError, match=r"sample 7 has \d+ tokens .* length table says"):
        list(loader)


def test_loader_refuses_settings_the_sampler_owns() -> None:
    _, ds, sampler, _ = _setup()
    with pytest.raises(ValueError, match="batch_size"):
        vb.PackedDataLoader(ds, sampler, batch_size=2)


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank=2, num_replicas=2"):
        vb.PackingSampler(np.array([5, 5]), seq_len=8, num_replicas=2, rank=2)


def test_padding_pack_is_empty_and_carries_no_loss() -> None:
    """A rank one pack short gets a padding pack: no sample, no loss token."""
    total = np.array([60, 60, 60])  # 3 packs for 2 ranks
    ds_table = LengthTable(
        total_tokens=total, image_tokens=np.zeros(3, np.int64), images=np.zeros(3, np.int64)
    )
    ds = SyntheticVLMDataset(ds_table, vocab_size=16)
    batches = []
    for rank in (0, 1):
        sampler = vb.PackingSampler(total, seq_len=100, num_replicas=2, rank=rank, shuffle=False)
        batches += list(vb.PackedDataLoader(ds, sampler, vb.PackCollator(100)))
    pads = [b for b in batches if b["meta"]["padding"]]
    assert len(batches) == 4 and len(pads) == 1
    assert pads[0]["loss_tokens"] == 0 and pads[0]["meta"]["sample_ids"] == []
    assert sorted(i for b in batches for i in b["meta"]["sample_ids"]) == [0, 1, 2]


def test_persistent_workers_serve_every_epoch_and_resume() -> None:
    """One inner DataLoader (and its persistent worker) is reused across epochs and resumes."""
    table, ds, sampler, _ = _setup(world_size=1)
    loader = vb.PackedDataLoader(
        ds,
        sampler,
        vb.PackCollator(128, image_feature_shape=(4,)),
        num_workers=1,
        persistent_workers=True,
    )
    e0 = _ids(loader)
    worker_iter = loader.pack_source._inner._iterator
    sampler.set_epoch(1)
    e1 = _ids(loader)
    assert loader.pack_source._inner._iterator is worker_iter
    assert sorted(e0) == sorted(e1) == list(range(len(sampler)))
    seen = [i for b in loader for i in b["meta"]["sample_ids"]]
    assert sorted(seen) == list(range(len(table)))
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["consumed"] == 2
    loader.load_state_dict(state)
    assert _ids(loader) == e1[2:]


def test_state_after_set_epoch_points_at_the_new_epoch() -> None:
    """Saved between epochs (after set_epoch, before the first batch): nothing of the new epoch
    is consumed; restored and saved again before iterating: the restored position."""
    _, _, sampler, loader = _setup()
    list(loader)
    sampler.set_epoch(1)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0
    _, _, _, fresh = _setup()
    fresh.load_state_dict({**loader.state_dict(), "consumed": 5, "epoch": 0})
    assert fresh.state_dict()["consumed"] == 5 and fresh.state_dict()["epoch"] == 0


def test_default_collator_learns_the_image_feature_shape() -> None:
    """A pack without images still gets pixel_values of shape (0, patch_dim)."""
    _, ds, sampler, _ = _setup(world_size=1)
    loader = vb.PackedDataLoader(ds, sampler)
    assert loader.collate_fn.image_feature_shape == (4,)
    shapes = {tuple(b["pixel_values"].shape[1:]) for b in loader}
    assert shapes == {(4,)}


def _two_ranks(rank: int, port: int, queue, table_shift: int) -> None:
    import torch.distributed as dist

    table = synthetic_length_table(300, tile_tokens=8, max_text_tokens=64, seed=5)
    # built before the process group exists, as in a DataModule's __init__
    sampler = vb.PackingSampler(
        table.total_tokens + (table_shift if rank == 1 else 0), table.image_tokens, seq_len=256
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ds = SyntheticVLMDataset(
            LengthTable(
                total_tokens=sampler.total_tokens,
                image_tokens=table.image_tokens,
                images=table.images,
            ),
            vocab_size=32,
            patch_dim=4,
        )
        loader = vb.PackedDataLoader(ds, sampler)
        try:
            ids = [i for b in loader for i in b["meta"]["sample_ids"]]
            queue.put((rank, "ok", sampler.num_replicas, ids))
        except ValueError as err:
            queue.put((rank, "error", sampler.num_replicas, str(err)))
    finally:
        dist.destroy_process_group()


def _spawn_two(table_shift: int) -> dict:
    import socket

    from harness.ranks import context

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # two processes of their own, forked from a server that imported the package once
    ctx = context("forkserver")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, queue, table_shift)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, status, world, payload = queue.get(timeout=120)
        out[rank] = (status, world, payload)
    for p in procs:
        p.join(timeout=60)
    return out


def test_sampler_built_before_the_process_group_follows_it() -> None:
    """Defaulted rank/world size are re-read once the group exists: no rank plans alone."""
    out = _spawn_two(table_shift=0)
    assert out[0][:2] == out[1][:2] == ("ok", 2)
    assert sorted(out[0][2] + out[1][2]) == list(range(300))


def test_ranks_with_different_length_tables_fail_instead_of_hanging() -> None:
    out = _spawn_two(table_shift=1)
    for r in (0, 1):
        status, _, message = out[r]
        assert status == "error" and "ranks disagree on the packing plan" in message


def _tensor_parallel_pair(rank: int, world: int, seed_shift: int) -> int:
    """A 2-rank world of one tensor-parallel pair (data-parallel size 1): both ranks plan the
    same packs, and a rank whose settings differ is caught before a step is taken."""
    table = synthetic_length_table(300, tile_tokens=8, max_text_tokens=64, seed=5)
    sampler = vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=256, seed=rank * seed_shift
    )
    sampler.set_data_parallel(1, 0)  # what the strategy's sampler kwargs say under TP 2
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    return len([b for b in vb.PackedDataLoader(ds, sampler)])


def test_tensor_parallel_ranks_with_different_settings_fail_instead_of_hanging() -> None:
    """The plan check covers tensor-parallel peers (world 2, data-parallel size 1)."""
    from harness.ranks import run_ranks

    same = run_ranks(_tensor_parallel_pair, 2, 0, start_method="forkserver")
    assert same[0] == same[1] and same[0][0] == "ok"
    differ = run_ranks(_tensor_parallel_pair, 2, 1, start_method="forkserver")
    for r in (0, 1):
        status, message = differ[r]
        assert status == "error" and "ranks disagree on the packing plan" in str(message)


def test_explicit_world_ranks_under_tensor_parallelism_are_refused() -> None:
    """``num_replicas=world, rank=global_rank`` (the DDP idiom) cannot stand where the
    data-parallel group is smaller: the message names the data-parallel size."""
    table = synthetic_length_table(100, tile_tokens=8, max_text_tokens=64, seed=5)
    sampler = vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=256, num_replicas=4, rank=3
    )
    with pytest.raises(ValueError, match=r"rank=3.*2 data-parallel ranks, this one rank 1"):
        sampler.set_data_parallel(2, 1)
    sampler.set_data_parallel(4, 3)  # the same values: fine
    defaulted = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=256)
    defaulted.set_data_parallel(2, 1)  # defaulted values follow the strategy's


def test_the_images_column_is_checked_and_fingerprinted() -> None:
    """A wrong-length or inconsistent ``images`` column is named; a sampler with other image
    counts (a cost feature of the balanced plan) does not accept another's saved state."""
    table = synthetic_length_table(100, tile_tokens=8, max_text_tokens=64, seed=5)
    total, image = table.total_tokens, table.image_tokens
    with pytest.raises(ValueError, match=r"'images' has shape \(99,\)"):
        vb.PackingSampler(total, image, seq_len=256, images=table.images[:-1])
    with_image = int(np.flatnonzero(image > 0)[0])
    no_images = table.images.copy()
    no_images[with_image] = 0
    with pytest.raises(ValueError, match=rf"sample {with_image} has 0 images and \d+ image"):
        vb.PackingSampler(total, image, seq_len=256, images=no_images)
    text = int(np.flatnonzero(image == 0)[0])
    stray = table.images.copy()
    stray[text] = 1
    with pytest.raises(ValueError, match=rf"sample {text} has 1 images and 0 image tokens"):
        vb.PackingSampler(total, image, seq_len=256, images=stray)
    more = np.where(table.images > 0, table.images + 1, 0)
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    saved = vb.PackedDataLoader(
        ds, vb.PackingSampler(total, image, seq_len=256, images=table.images, balance=True)
    ).state_dict()
    other = vb.PackedDataLoader(
        ds, vb.PackingSampler(total, image, seq_len=256, images=more, balance=True)
    )
    with pytest.raises(ValueError, match="length_table_sha1"):
        other.load_state_dict(saved)


def test_plain_model_parallel_resolves_auto_to_microstep() -> None:
    """Under a strategy other than ours with more than one rank (FSDP's collectives, Lightning's
    per-micro-batch flag broadcast) the ranks meet every micro-batch: a balanced sampler's
    ``objective="auto"`` plans for ``"microstep"``."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    table = synthetic_length_table(100, tile_tokens=8, max_text_tokens=64, seed=5)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=256, balance=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), accumulate_grad_batches=3
    )
    ds = SyntheticVLMDataset(table, vocab_size=32, patch_dim=4)
    len(vb.PackedDataLoader(ds, sampler, trainer=trainer))
    assert (sampler.objective, sampler.micro_steps) == ("microstep", 3)


def test_a_loader_without_its_trainer_warns_when_an_epoch_has_another_length() -> None:
    """Without ``trainer=`` the loader cannot tell Lightning each epoch's length: when an epoch's
    plan differs from what ``len`` said, it says so (once) instead of losing packs silently."""
    from tests.packing.epoch_job import length_table, sampler

    s = sampler(seed=7, window=8, balance=False, num_replicas=1, rank=0)
    counts = [s.packs_per_rank(e) for e in range(3)]
    assert counts[1] != counts[0], counts  # the premise: epoch 1 packs differently
    ds = SyntheticVLMDataset(length_table(), vocab_size=64, patch_dim=8)
    loader = vb.PackedDataLoader(ds, s, vb.PackCollator(128, image_feature_shape=(8,)))
    assert len(loader) == counts[0]
    s.set_epoch(1)
    assert len(loader) == counts[1]  # asked again (Lightning does): the first answer counts
    with pytest.warns(UserWarning, match=rf"epoch 1 has {counts[1]} packs .* said {counts[0]}"):
        next(iter(loader))


class _Marked(vb.PackCollator):
    def __init__(self, mark: str) -> None:
        super().__init__(128, image_feature_shape=(4,))
        self.mark = mark

    def __call__(self, items):
        batch = super().__call__(items)
        batch["meta"]["mark"] = self.mark
        return batch


class _Fives(SyntheticVLMDataset):
    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        sample["input_ids"] = torch.full_like(sample["input_ids"], 5)
        return sample


@pytest.mark.parametrize("workers", [0, 1])
def test_settings_assigned_after_a_pass_reach_the_next_pass(workers: int) -> None:
    """``collate_fn``, ``dataset`` and ``num_workers`` set after a pass made the inner
    ``DataLoader`` (and its persistent worker) reach the next pass; they once read back the new
    value while every later pass used the first (silently)."""
    table, ds, sampler, _ = _setup(world_size=1)
    persistent = {"persistent_workers": True} if workers else {}
    loader = vb.PackedDataLoader(ds, sampler, _Marked("A"), num_workers=workers, **persistent)
    assert {b["meta"]["mark"] for b in loader} == {"A"}
    loader.collate_fn = _Marked("B")
    loader.dataset = _Fives(table, vocab_size=32, patch_dim=4)
    batches = list(loader)
    assert {b["meta"]["mark"] for b in batches} == {"B"}
    assert all(int(b["input_ids"][0, 0]) == 5 for b in batches if b["meta"]["sample_ids"])
    loader.num_workers = workers + 1
    assert loader.num_workers == workers + 1
    assert _ids(loader) == [b["meta"]["pack_id"] for b in batches]
    assert loader.pack_source._inner.num_workers == workers + 1
    if workers:
        with pytest.raises(ValueError, match="persistent workers need at least one worker"):
            loader.num_workers = 0
    with pytest.raises(ValueError, match="the length table does not match the dataset"):
        loader.dataset = SyntheticVLMDataset(
            synthetic_length_table(10, tile_tokens=8, max_text_tokens=64, seed=5),
            vocab_size=32,
            patch_dim=4,
        )
    assert loader.dataset.__class__ is _Fives  # refused: nothing changed


def test_vision_token_budget_per_pack_through_the_loader() -> None:
    """``PackingSampler(max_image_tokens_per_pack=...)``: the collated packs of both ranks hold
    every sample once and no more image tokens than the budget (the same table packs above it
    without one); the budget is part of the fingerprint; settings it cannot keep are refused."""
    free = _setup()[3]
    most = max(b["meta"]["image_tokens"] for b in free)
    budget = most // 2
    seen, loads = [], []
    for rank in (0, 1):
        table, _, _, loader = _setup(rank=rank, max_image_tokens_per_pack=budget)
        for b in loader:
            seen += b["meta"]["sample_ids"]
            loads.append(b["meta"]["image_tokens"])
    assert sorted(seen) == list(range(len(table.total_tokens)))
    assert max(loads) <= budget < most
    state = loader.state_dict()
    with pytest.raises(ValueError, match=f"max_image_tokens_per_pack: saved {budget}, now None"):
        _setup(rank=1)[3].load_state_dict(state)
    with pytest.raises(ValueError, match="image tokens, more than `max_image_tokens_per_pack=1`"):
        _setup(max_image_tokens_per_pack=1)[2].plan(0)
    with pytest.raises(ValueError, match="'greedy' packer"):
        vb.PackingConfig(seq_len=8, packer="bfd", max_image_tokens_per_pack=4)
    with pytest.raises(ValueError, match="balance="):
        _setup(max_image_tokens_per_pack=budget, balance=True)
