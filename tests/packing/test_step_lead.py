"""A resume inside an optimizer step across loaders and strategies (in one process).

Every loader saves the position itself (a ``RebalancingLoader``, the ``"vlmbalance"``
strategies' front, saves its source's state at the training loop's position); the source starts
a pass resumed inside a step at the step's first pack and says how many of its packs were
trained (its lead), so the step is formed whole and those packs are not handed on again. A
state an older wrapper saved (the step's start and ``rebalanced_step_lead``) resumes at the same
pack under either front; a step that ended its epoch (the epoch's last, short one) is whole, and
resumes at the next epoch's start; a stream's last step cut by ``limit_train_batches`` counts
only the packs Lightning trains.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import lightning_vlmbalance as vb
from lightning_vlmbalance import streams as stream_data
from lightning_vlmbalance.loaders.global_batch import STEP_LEAD
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table

G = 3  # micro-steps per optimizer step


def _map_loader() -> vb.PackedDataLoader:
    table = synthetic_length_table(120, tile_tokens=16, max_text_tokens=128, seed=0)
    dataset = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8, seed=0)
    sampler = vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=256, num_replicas=1, rank=0
    )
    return vb.PackedDataLoader(dataset, sampler, vb.PackCollator(256, image_feature_shape=(8,)))


def _wrapped(loader, position: list[int], batches: int) -> vb.RebalancingLoader:
    return vb.RebalancingLoader(
        loader,
        micro_steps=G,
        num_replicas=1,
        rank=0,
        mode="sync",
        epoch_position=lambda: position[0],
        epoch_batches=lambda: batches,
    )


def test_a_checkpoint_at_the_epochs_short_last_step_has_no_lead() -> None:
    loader = _map_loader()
    batches = len(loader) - (len(loader) % G == 0)  # the epoch's last step is short
    position = [0]
    wrapped = _wrapped(loader, position, batches)
    taken = list(wrapped)
    assert len(taken) == batches and batches % G
    position[0] = batches  # trained to the epoch's end
    state = wrapped.state_dict()
    assert STEP_LEAD not in state and state["consumed"] == batches
    position[0] = batches - 1  # inside that last step: the position itself (the source leads)
    state = wrapped.state_dict()
    assert STEP_LEAD not in state and state["consumed"] == batches - 1
    reference = [b["meta"]["sample_ids"] for b in taken]
    resumed = _wrapped(_map_loader(), position, batches)
    resumed.load_state_dict(state)
    assert [b["meta"]["sample_ids"] for b in resumed] == reference[batches - 1 :]


def test_an_older_wrappers_state_with_a_lead_resumes_at_the_same_pack() -> None:
    """Saved by the old wrapper inside a step (the step's start and the lead), resumed by the
    wrapper at the loop's position: the packs after the lead, each once."""
    reference = [b["meta"]["sample_ids"] for b in _map_loader()]
    start, lead = G, 2
    position = [start + lead]
    wrapped = _wrapped(_map_loader(), position, len(reference))
    wrapped.load_state_dict({**_map_loader().state_dict(), "consumed": start, STEP_LEAD: lead})
    assert [b["meta"]["sample_ids"] for b in wrapped] == reference[start + lead :]


def test_a_map_style_state_from_inside_a_step_resumes_under_either_front() -> None:
    reference = [b["meta"]["sample_ids"] for b in _map_loader()]
    inside = 4  # packs trained: one step of 3 and one pack of the next
    # saved by the loader itself (plain ddp): a wrapper resumes at the step's start, skipping
    saved = {**_map_loader().state_dict(), "consumed": inside}
    position = [inside]
    wrapped = _wrapped(_map_loader(), position, len(reference))
    wrapped.load_state_dict(dict(saved))
    assert [b["meta"]["sample_ids"] for b in wrapped] == reference[inside:]
    # saved by a wrapper (the step's start and the lead): the loader alone resumes at the pack
    loader = _map_loader()
    loader.load_state_dict({**saved, "consumed": inside - inside % G, STEP_LEAD: inside % G})
    assert loader.consumed == inside
    assert [b["meta"]["sample_ids"] for b in loader] == reference[inside:]


def _stream_trainer(batches: float) -> SimpleNamespace:
    strategy = SimpleNamespace(
        world_size=1,
        global_rank=0,
        distributed_sampler_kwargs={"num_replicas": 1, "rank": 0},
        root_device=torch.device("cpu"),
    )
    return SimpleNamespace(
        strategy=strategy, accumulate_grad_batches=2, training=True, num_training_batches=batches
    )


def test_a_streams_step_cut_by_the_epochs_limit_counts_only_its_trained_packs() -> None:
    records = stream_data.synthetic_records(120, seed=4)

    def loader(batches: float):
        source = stream_data.ShardedRecords(records)
        return stream_data.stream_loader(source, 256, buffer=32, trainer=_stream_trainer(batches))

    whole = list(loader(float("inf")))
    cut = list(loader(5))  # limit_train_batches=5 with 2 micro-steps: the last step is 1 pack
    assert len(cut) == 5 and len(whole) > 6
    assert [p["meta"]["keys"] for p in cut] == [p["meta"]["keys"] for p in whole[:5]]
    assert cut[4]["global_loss_tokens"] == cut[4]["loss_tokens"]
    assert cut[4]["loss_weight"] == 2 / cut[4]["loss_tokens"]
    assert whole[4]["global_loss_tokens"] == whole[4]["loss_tokens"] + whole[5]["loss_tokens"]


def test_a_stream_state_saved_with_a_lead_resumes_at_the_pack() -> None:
    records = stream_data.synthetic_records(120, seed=4)

    def loader():
        return stream_data.stream_loader(
            stream_data.ShardedRecords(records), 256, buffer=32, micro_steps=2
        )

    reference = [p["meta"]["keys"] for p in loader()]
    first = loader()
    packs = iter(first)
    for _ in range(5):  # two whole steps and the first pack of the third (read, as a wrapper does)
        next(packs)
    state = first.state_at(4)  # the third step's start: what a wrapper saves, with the lead
    assert state["per_rank"][0]["offset"] == 0
    again = loader()
    again.load_state_dict({**state, STEP_LEAD: 1})  # the step's first pack was trained
    assert [p["meta"]["keys"] for p in again] == reference[5:]
