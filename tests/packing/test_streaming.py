"""``PackedStreamLoader`` in one process: packs of a stream, every record once, exact resume at
any position, bad input, the resume policies. The 2-rank fits are in ``test_streaming_fit``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_vlmbalance as vb
from lightning_vlmbalance import streams as stream_data
from lightning_vlmbalance.packing.stream import WindowState, pack_stream, pack_stream_windows

SEQ_LEN = 256
RECORDS = stream_data.synthetic_records(300, seed=4)


def _loader(records=RECORDS, source=None, **kw) -> vb.PackedStreamLoader:
    source = source if source is not None else stream_data.ShardedRecords(records)
    return stream_data.stream_loader(source, SEQ_LEN, **{"buffer": 32, "micro_steps": 2, **kw})


def _keys(packs) -> list[list[str]]:
    return [p["meta"]["keys"] for p in packs]


def test_windows_resume_at_any_window_with_the_same_packs() -> None:
    lengths = np.random.default_rng(0).integers(1, 300, 2000).tolist()
    whole = [p.tolist() for p in pack_stream(lengths, 512, buffer=100)]
    windows = list(pack_stream_windows(lengths, 512, buffer=100))
    for state, _ in windows[1:]:
        restored = WindowState.from_list(state.to_list())
        again = pack_stream_windows(lengths[restored.read :], 512, buffer=100, start=restored)
        packs = [p.tolist() for _, w in again for p in w]
        assert packs == whole[restored.packs_before :]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_record_is_packed_once_and_a_resume_at_any_position_continues_the_same_packs(
    num_workers,
) -> None:
    """Whole records in packs of at most ``seq_len`` tokens (the lengths from the PNG headers
    equal the decoded samples'), each record in one pack; the workers' streams in a fixed
    order; resuming from ``state_at(p)`` yields exactly the packs from ``p`` on (positions
    inside a global batch too)."""
    loader = _loader(num_workers=num_workers)
    packs = list(loader)
    keys = [k for ks in _keys(packs) for k in ks]
    assert sorted(map(int, keys)) == list(range(len(RECORDS)))
    assert all(int(p["meta"]["total_tokens"]) <= SEQ_LEN for p in packs)
    real = [p for p in packs if not p["meta"]["padding"]]
    efficiency = sum(p["meta"]["total_tokens"] for p in real) / (len(real) * SEQ_LEN)
    assert efficiency > 0.9
    assert len(packs) % 2 == 0 or loader.padding_packs == 0  # whole global batches, one rank
    assert _keys(list(_loader(num_workers=num_workers))) == _keys(packs)  # deterministic
    for position in (1, 2, 9, len(packs) // 2, len(packs) - 1):
        state = loader.state_at(position)
        resumed = _loader(num_workers=num_workers)
        resumed.load_state_dict(state)
        assert _keys(list(resumed)) == _keys(packs[position:]), position
        # the epoch's counts as the uninterrupted pass's (a resume inside a global batch too)
        assert (resumed.packs, resumed.padding_packs) == (loader.packs, loader.padding_packs)


def test_a_checkpoint_of_a_finished_epoch_resumes_at_the_next_epochs_start() -> None:
    """Lightning goes on with the next epoch after a checkpoint saved at an epoch's last
    micro-batch or end, reading its first batch before it calls ``set_epoch``: the loader is at
    that epoch already."""
    loader = _loader()
    packs = list(loader)
    state = loader.state_at(len(packs))
    assert state["processes"] == 1 and state["per_rank"][0]["finished"]
    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert _keys(list(resumed)) == _keys(packs)  # no shuffle in this source: the same order
    # the policy on another number of ranks or workers: an epoch's end resumes on any number
    other = _loader(num_workers=2)
    other.load_state_dict(_with_own(state, ranks=4, streams=3))
    assert other.epoch == 1
    assert sorted(int(k) for ks in _keys(list(other)) for k in ks) == list(range(len(RECORDS)))


def test_bad_records_are_skipped_and_reported_with_stream_position_and_key_or_raise() -> None:
    records = [dict(r) for r in RECORDS[:80]]
    records[5]["images"] = b"not a png" + bytes(records[5]["images"])[9:]  # header broken
    records[7]["text"] = np.zeros(0, dtype=np.int32)  # text-only and empty: 0 tokens
    records[11]["image_ends"] = [*records[11]["image_ends"]]
    broken = bytearray(records[11]["images"])
    broken[40:] = b"\0" * (len(broken) - 40)  # a header that reads, pixels that do not decode
    records[11]["images"] = bytes(broken)
    loader = _loader(records)
    keys = [k for ks in _keys(list(loader)) for k in ks]
    bad = {b["key"]: b for b in loader.bad_samples}
    has_images = bool(RECORDS[11]["image_ends"])
    assert set(bad) == {"5", "7"} | ({"11"} if has_images else set())
    assert bad["5"]["reason"].startswith("lengths") and bad["5"]["position"] == 5
    assert bad["7"]["stream"] == 0 and "0 tokens" in bad["7"]["reason"]
    assert sorted(map(int, keys)) == sorted(set(range(80)) - {5, 7, 11 if has_images else -1})
    with pytest.raises(ValueError, match=r"stream 0, record 5 \(5\): lengths"):
        list(_loader(records, on_bad_sample="raise"))


def test_lengths_that_disagree_with_the_decoded_sample_are_an_error() -> None:
    def off_by_one(record):
        return stream_data.record_tokens(record)[0] - 1

    with pytest.raises(ValueError, match=r"decoded sample has .* tokens but `lengths` said"):
        list(_loader(lengths=off_by_one))


def test_settings_are_checked_and_a_mid_epoch_state_does_not_resume_on_other_shards() -> None:
    with pytest.raises(ValueError, match="persistent_workers"):
        _loader(num_workers=1, persistent_workers=True)
    with pytest.raises(ValueError, match="on_bad_sample"):
        _loader(on_bad_sample="drop")
    with pytest.raises(ValueError, match="batch_size"):
        _loader(batch_size=2)
    loader = _loader()
    packs = iter(loader)
    for _ in range(3):
        next(packs)
    state = loader.state_at(3)
    other = _loader(num_workers=2)  # two streams instead of one
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"1 rank\(s\) x 1 stream\(s\).* 1 x 2"):
        next(iter(other))
    ranks = _with_own(state, ranks=2)  # as if saved by 2 ranks
    other = _loader()
    other.load_state_dict(ranks)
    with pytest.raises(ValueError, match="cannot resume the PackedStreamLoader mid-epoch"):
        next(iter(other))
    # every process's state is saved: one saved by two processes is not resumed by one
    two = {**state, "processes": 2, "per_rank": state["per_rank"] * 2}
    other = _loader()
    other.load_state_dict(two)
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) and this run has 1"):
        next(iter(other))


def _with_own(state: dict, **changes) -> dict:
    """``state`` (every process's, as ``state_at`` saves it) with its one entry changed."""
    return {**state, "per_rank": [dict(state["per_rank"][0], **changes)]}


def test_padding_packs_carry_no_loss_and_keep_the_pixel_shape() -> None:
    loader = _loader(RECORDS[:3], micro_steps=4)
    packs = list(loader)
    assert len(packs) == 1  # one rank: no padding for a short last step
    pad = loader.pack_source._padding(packs[0]["pixel_values"][:0])
    assert pad["loss_tokens"] == 0 and pad["meta"]["padding"]
    assert pad["pixel_values"].shape == (0, 8) and pad["pixel_values"].dtype == torch.float32


@pytest.mark.parametrize(
    ("counts", "G", "used", "moves"),
    [
        ([4, 4], 2, [2, 2], []),  # before the tail: every rank its own share, nothing moves
        ([4, 1], 2, [3, 1], [(0, 2, 1)]),  # rank 1 short by one: rank 0's next pack
        ([4, 0, 3], 2, [4, 0, 2], [(0, 2, 1), (0, 3, 1)]),
        ([3, 0, 3], 2, [3, 0, 3], [(0, 2, 1), (2, 2, 1)]),  # lenders in rank order
        ([1, 0], 2, [1, 0], []),  # the very end: nobody has a pack to spare
        ([0, 0], 2, [0, 0], []),
        ([5, 0], 4, [5, 0], [(0, 3, 1), (0, 4, 1)]),  # the last batch 3 + 2, not 4 + 1
        ([7, 0, 0], 4, [7, 0, 0], [(0, 3, 1), (0, 4, 1), (0, 5, 1), (0, 6, 2)]),
    ],
)
def test_the_tail_plan_lends_the_next_packs_of_longer_ranks_to_short_ones(
    counts, G, used, moves
) -> None:
    from lightning_vlmbalance.loaders.streaming import tail_plan

    assert tail_plan(counts, G) == (used, moves)


class _Seekable(stream_data.ShardedRecords):
    """Records with their own state (as Hugging Face's IterableDataset has): ``state_dict``
    after ``n`` records resumes at record ``n``; counts the records it yields."""

    def __init__(self, records) -> None:
        super().__init__(records)
        self.start, self.pulled, self.next = 0, 0, 0

    def __iter__(self):
        self.next = self.start
        for record in self.records[self.start :]:
            self.pulled += 1
            self.next += 1
            yield record

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["next"]


def test_a_source_with_its_own_state_resumes_near_the_anchor_without_rereading_the_stream() -> None:
    first = _loader(source=_Seekable(RECORDS))
    packs = list(first)
    position = len(packs) - 6
    source = _Seekable(RECORDS)
    resumed = _loader(source=source)
    resumed.load_state_dict(first.state_at(position))
    assert _keys(list(resumed)) == _keys(packs[position:])
    # read again: from the last save (every buffer / 4 records) before the anchor window on,
    # not the whole stream up to the checkpoint
    assert source.pulled < len(RECORDS) // 2
    assert source.start > 0


class _ItsOwnIterator(stream_data.ShardedRecords):
    """A source whose ``__iter__`` returns itself and starts again from its first record, as
    LitData's ``StreamingDataset`` does."""

    def __iter__(self):
        self.next = self.lo
        return self

    def __next__(self):
        if self.next >= self.hi:
            raise StopIteration
        self.next += 1
        return self.records[self.next - 1]


def test_a_source_that_is_its_own_iterator_resumes_where_it_stopped_not_at_its_start() -> None:
    """Skipping to the anchor and reading on go through one iterator: a second ``iter()`` of a
    source that returns itself would start it again (every record read twice)."""
    packs = list(_loader(source=_ItsOwnIterator(RECORDS)))
    for position in (3, len(packs) // 2, len(packs) - 2):
        first = _loader(source=_ItsOwnIterator(RECORDS))
        assert _keys(list(first)) == _keys(packs)
        state = first.state_at(position)
        resumed = _loader(source=_ItsOwnIterator(RECORDS))
        resumed.load_state_dict(state)
        assert _keys(list(resumed)) == _keys(packs[position:]), position


class _Unseeded(stream_data.ShardedRecords):
    """A new order on every pass (an unseeded shuffle)."""

    def __init__(self, records) -> None:
        super().__init__(records)
        self.rng = np.random.default_rng()

    def __iter__(self):
        yield from (self.records[i] for i in self.rng.permutation(len(self.records)))


def test_a_source_whose_order_is_not_reproducible_is_refused_at_the_resume_by_name() -> None:
    """Nothing is silently trained twice or never: the anchor's records are compared with
    those the saving run read there."""
    loader = _loader(source=_Unseeded(RECORDS))
    packs = list(loader)
    state = loader.state_at(len(packs) // 2)
    resumed = _loader(source=_Unseeded(RECORDS))
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"cannot resume rank 0's stream 0 at record \d+: the"):
        list(resumed)


class _LossySeek(_Seekable):
    """A source whose own state resumes elsewhere than where it was saved (the shuffle buffer a
    Hugging Face state does not keep), or fails to load (``fail``)."""

    def __init__(self, records, fail: bool = False) -> None:
        super().__init__(records)
        self.fail = fail

    def load_state_dict(self, state: dict) -> None:
        if self.fail and state["next"]:
            raise IndexError("list index out of range")
        self.start = state["next"] + 3 if state["next"] else 0


@pytest.mark.parametrize("fail", [False, True])
def test_a_source_whose_own_state_resumes_elsewhere_is_read_again_from_its_start(fail) -> None:
    """A seek whose records differ from the saving run's at the anchor (or fails) falls back to
    reading the stream from its start: exact for a seeded shuffle."""
    first = _loader(source=_LossySeek(RECORDS))
    packs = list(first)
    position = len(packs) - 6
    source = _LossySeek(RECORDS, fail=fail)
    resumed = _loader(source=source)
    resumed.load_state_dict(first.state_at(position))
    assert _keys(list(resumed)) == _keys(packs[position:])
    assert source.start == 0  # read from the start


def test_an_overlong_record_is_an_error_by_default_or_skipped_counted_and_warned_once() -> None:
    """The map-style sampler's policy and default (``overlong="error"``) on the stream too."""
    records = [dict(r) for r in RECORDS[:60]]
    for i in (4, 9):
        records[i]["text"] = np.ones(SEQ_LEN + 1, dtype=np.int32)
    with pytest.raises(ValueError, match=r"stream 0, record 4 \(4\): overlong: \d+ tokens"):
        list(_loader(records))
    loader = _loader(records, overlong="skip")
    with pytest.warns(UserWarning, match="overlong='skip'") as caught:
        keys = [int(k) for ks in _keys(list(loader)) for k in ks]
    assert len([w for w in caught if "overlong" in str(w.message)]) == 1
    assert sorted(keys) == sorted(set(range(60)) - {4, 9})
    assert sorted(b["key"] for b in loader.bad_samples) == ["4", "9"]
    with pytest.raises(ValueError, match="overlong"):
        _loader(overlong="truncate")


@pytest.mark.parametrize(
    ("counts", "G", "final", "used", "moves"),
    [
        # four ranks, three of them ended, the last one still reading: whole steps of G, lent
        (
            [8, 0, 0, 0],
            2,
            False,
            [8, 0, 0, 0],
            [(0, 2, 1), (0, 3, 1), (0, 4, 2), (0, 5, 2), (0, 6, 3), (0, 7, 3)],
        ),
        # not enough to lend yet: a global batch is still G on every rank (padding), not 1
        ([4, 0, 0, 0], 2, False, [4, 0, 0, 0], [(0, 2, 1), (0, 3, 1)]),
        ([4, 0, 0, 0], 2, True, [4, 0, 0, 0], [(0, 1, 1), (0, 2, 2), (0, 3, 3)]),
    ],
)
def test_before_the_last_global_batch_every_rank_trains_whole_steps(
    counts, G, final, used, moves
) -> None:
    from lightning_vlmbalance.loaders.streaming import hand_size, tail_plan, trained_counts

    assert tail_plan(counts, G, final=final) == (used, moves)
    if not final:
        assert max(trained_counts(used, moves)) == G  # the others pad to G
    assert hand_size(2, 4, 0) == 4 and hand_size(2, 4, 3) == 8 and hand_size(2, 2, 1) == 4


class _NotSplit(stream_data.ShardedRecords):
    """Every worker reads every record: a source that ignores ``get_worker_info``."""

    def __iter__(self):
        yield from self.records[self.lo : self.hi]


def test_a_source_that_does_not_split_across_workers_is_named_in_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"record '0' comes from two DataLoader workers"):
        list(_loader(RECORDS[:60], source=_NotSplit(RECORDS[:60]), num_workers=2))


def test_a_fit_resumed_from_its_epochs_last_micro_batch_trains_the_next_epoch_whole(
    tmp_path,
) -> None:
    """A real ``Trainer``: a checkpoint written at the last micro-batch of epoch 0 resumes with
    epoch 1 trained whole (the loader had ended epoch 0; Lightning reads epoch 1's first batch
    from the iterator it made before ``set_epoch``, where an empty epoch 0 lost all of it)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.vlm import SMALL_VLM, ToyVLM

    records = RECORDS[:120]

    class Model(ToyVLM):
        def __init__(self) -> None:
            super().__init__(**SMALL_VLM, max_positions=SEQ_LEN)
            self.seen: list[tuple[int, list[str]]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, list(batch["meta"]["keys"])))
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            source = stream_data.ShardedRecords(records)
            return _loader(records, source=source, buffer=16, trainer=self.trainer)

    def fit(ckpt=None) -> Model:
        L.seed_everything(0, verbose=False)
        model = Model()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            accumulate_grad_batches=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
            ],
        )
        trainer.fit(model, ckpt_path=ckpt)
        return model

    full = fit()
    epoch0 = [keys for e, keys in full.seen if e == 0]
    step = -(-len(epoch0) // 2)  # the optimizer step of epoch 0's last micro-batch
    resumed = fit(str(tmp_path / f"step={step}.ckpt"))
    assert resumed.seen == [s for s in full.seen if s[0] == 1] and resumed.seen


def test_a_setting_changed_on_the_loader_reaches_its_pack_source() -> None:
    """The loader's settings and reports are its pack source's: setting one on the loader sets
    it there (a loader attribute of its own would shadow it and the passes would not see it)."""
    loader = vb.PackedStreamLoader([], seq_len=64)
    loader.seq_len, loader.buffer = 32, 16
    assert (loader.pack_source.seq_len, loader.pack_source.buffer) == (32, 16)
    assert "seq_len" not in vars(loader) and loader.seq_len == 32
