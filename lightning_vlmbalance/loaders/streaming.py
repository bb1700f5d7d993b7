"""``PackedStreamLoader``: packed batches from a streamed dataset, equal steps on every rank.

A streamed dataset (Hugging Face ``datasets`` in streaming mode, LitData's ``StreamingDataset``,
WebDataset shards, any ``IterableDataset``) is read in order, without random access and without a
length table of the whole epoch. This loader takes this rank's iterable of records (the source
shards itself across ranks and, inside each ``DataLoader`` worker, across workers: each worker's
share is one *stream*), and in each worker:

1. measures each record with ``lengths(record)`` (a cheap function: the token count, the image
   tokens from the image's size; no decoding, no pass ahead of training);
2. packs the stream one bounded window at a time with the package's greedy packer
   (:func:`~lightning_vlmbalance.packing.stream.pack_stream_windows`: whole samples, images never
   cut, ``buffer`` new samples per window);
3. decodes the records of each pack (``transform(record)`` gives the sample dict of
   :mod:`~lightning_vlmbalance.packing.collate`) and collates the pack into a ``PackedBatch``.

The main process takes the workers' packs in a fixed round-robin order (so a resumed pass
continues the same order) and hands them out a global batch at a time (``micro_steps`` packs:
one optimizer step). **Equal steps, no hang**: before a global batch is handed out, the ranks
exchange how many packs each has for it (one all-gather of a few integers per global batch on a
process group of the loader's own, started one global batch ahead so it does not wait on the
step path; nothing per micro-batch). A rank whose streams have ended trains packs its peers
lend it (:func:`tail_plan`), and pads where there are too few (no tokens to learn, weight 0):
every global batch but the last is ``micro_steps`` packs on every rank (one optimizer step),
every sample of a finite stream is trained once in the epoch, on some rank, and the ranks stop
together at the first global batch for which no rank has a pack. A rank whose source yields
nothing at all in an epoch ends the epoch on every rank, with a warning that names it (the
other ranks' data of that epoch is left untrained and counted).

**Exact resume**: the checkpoint holds, per stream, how many packs were handed out and where the
packer stood a window before the last of them (:class:`~lightning_vlmbalance.packing.stream.
WindowState`: stream positions and lengths, never pixels). A resumed worker reads its stream from
that position again, re-packs (the packer is deterministic), skips the packs already handed out
without decoding them, and continues: the packs are exactly the uninterrupted run's. The source
must yield the same records in the same order when iterated again (a seeded shuffle: the loader
calls the source's ``set_epoch(epoch)`` if it has one); a source that can seek skips faster, one
that cannot is read from the start of its stream (records read, not decoded). Each anchor holds
a digest of the records read at it: a seek that lands elsewhere (a Hugging Face shuffle buffer)
is replaced by reading from the start, and a source whose records differ even then is refused
by name. The state differs by rank and Lightning saves one rank's copy, so ``state_dict``
gathers every process's state and each resumes from its own; the position is where Lightning
restarts (micro-batches processed). Resuming mid-epoch on another number of ranks or workers is
refused (the streams are sharded differently), naming both; a checkpoint from an epoch's end
resumes on any number.

**Bad input** (``on_bad_sample``): a record whose ``lengths`` fail or are out of ``[1, seq_len]``,
or whose ``transform`` fails, is skipped and counted with its stream, position and key
(``"skip"``, the default; :attr:`PackedStreamLoader.bad_samples`), or raises naming them
(``"raise"``). A decoded sample whose token count differs from what ``lengths`` said is always an
error (the lengths function and the data disagree).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

from lightning_vlmbalance import _lightning as seam
from lightning_vlmbalance.loaders._dataloader_settings import (
    DataLoaderSettings,
    OfSource,
    check_dataloader_kwargs,
)
from lightning_vlmbalance.loaders.global_batch import (
    STEP_LEAD,
    GlobalBatchFormer,
    cut_steps,
    handed_packs,
)
from lightning_vlmbalance.loaders.stream_source import (
    BAD_SAMPLE_POLICIES,
    OVERLONG_POLICIES,
    StreamPackSource,
    hand_size,
    loader_group,
    sample_tokens,
    tail_plan,
    trained_counts,
)
from lightning_vlmbalance.packing.collate import PackCollator
from lightning_vlmbalance.parallel import data_parallel_world, step_spec

__all__ = [
    "BAD_SAMPLE_POLICIES",
    "PackedStreamLoader",
    "hand_size",
    "tail_plan",
    "trained_counts",
]


class _EpochSetter:
    """What Lightning calls ``set_epoch`` on (a loader's ``sampler``)."""

    balanced = False  # never balances at the source (the strategy reads this)

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


class PackedStreamLoader(DataLoaderSettings):
    """A Lightning-ready, resumable loader of packed batches from a streamed dataset.

    See the module docstring for what it does. Like
    :class:`~lightning_vlmbalance.PackedDataLoader` it yields one ``PackedBatch`` per batch;
    unlike it, it has no length (Lightning runs the epoch until the loader ends it, on every
    rank at the same global batch).

    Args:
        source: this rank's iterable of records (it shards itself across ranks and workers;
            iterated again, it yields the same records in the same order).
        seq_len: tokens per pack.
        lengths: ``record -> tokens`` (or ``(tokens, image_tokens)``): what the decoded sample
            will have, computed cheaply (no decoding).
        transform: ``record -> sample dict`` (decoding), run in the workers for packed records
            only; default: the records are sample dicts already.
        collate_fn: default ``PackCollator(seq_len)``.
        buffer: new records per packing window (memory: about ``buffer`` records per worker).
        min_fill: packs filled below this are dissolved once and their samples packed again in
            the next window.
        micro_steps: packs per rank per global batch without a trainer (with one: its
            :class:`~lightning_vlmbalance.parallel.StepSpec`'s).
        trainer: the Lightning ``Trainer`` (``self.trainer`` in ``train_dataloader``): the
            loader then groups its packs into the Trainer's optimizer steps and weighs each
            step's loss (:mod:`lightning_vlmbalance.loss`) from the same all-gather (under a
            ``"vlmbalance"`` strategy, its rebalancing forms the steps from
            :meth:`global_batches`).
        on_bad_sample: ``"skip"`` (count and report) or ``"raise"``: for a record whose
            ``lengths`` or ``transform`` fail.
        overlong: a record longer than ``seq_len``: ``"error"`` (the default, as the map-style
            sampler's ``PackingConfig.overlong``) raises naming it; ``"skip"`` leaves it out,
            counted in ``bad_samples``, with one warning.
        key: ``record -> str``, a record's name in reports (default: its ``__key__``, ``key``,
            ``id`` or ``uid`` field, if any).
        timeout_s: how long a rank waits for its peers at a global batch before it fails
            (the timeout of the loader's process group).
        **dataloader_kwargs: passed to the inner ``DataLoader`` (``num_workers``,
            ``pin_memory``, ``prefetch_factor``, ``multiprocessing_context``, ...).

    Raises:
        ValueError: for a bad setting, naming it.
    """

    batch_sampler = None
    # the settings and the epoch's reports are the pack source's (read here)
    source = OfSource()
    seq_len = OfSource()
    lengths = OfSource()
    transform = OfSource()
    collate_fn = OfSource()
    buffer = OfSource()
    min_fill = OfSource()
    on_bad_sample = OfSource()
    overlong = OfSource()
    key = OfSource()
    timeout_s = OfSource()
    rank = OfSource()
    bad_samples = OfSource()
    padding_packs = OfSource()
    packs = OfSource()
    left_over = OfSource()
    lent_packs = OfSource()

    def __init__(
        self,
        source: Iterable[Any],
        *,
        seq_len: int,
        lengths: Callable[[Any], Any] | None = None,
        transform: Callable[[Any], dict[str, Any]] | None = None,
        collate_fn: PackCollator | None = None,
        buffer: int = 4096,
        min_fill: float = 0.98,
        micro_steps: int = 1,
        trainer: Any = None,
        on_bad_sample: str = "skip",
        overlong: str = "error",
        key: Callable[[Any], str] | None = None,
        timeout_s: float = 600.0,
        **dataloader_kwargs: Any,
    ) -> None:
        if on_bad_sample not in BAD_SAMPLE_POLICIES:
            raise ValueError(
                f"`PackedStreamLoader(on_bad_sample={on_bad_sample!r})` must be one of"
                f" {BAD_SAMPLE_POLICIES}"
            )
        if seq_len < 1 or buffer < 1 or micro_steps < 1:
            raise ValueError(
                f"`PackedStreamLoader(seq_len={seq_len}, buffer={buffer},"
                f" micro_steps={micro_steps})`: each must be >= 1"
            )
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(
                f"`PackedStreamLoader(overlong={overlong!r})` must be one of {OVERLONG_POLICIES}"
                " (a streamed record is never cut: its lengths were counted before decoding)"
            )
        check_dataloader_kwargs("PackedStreamLoader", dataloader_kwargs, "the stream packer")
        if dataloader_kwargs.get("persistent_workers"):
            raise ValueError(
                "`PackedStreamLoader(persistent_workers=True)`: each pass starts its workers"
                " with the pass's epoch and resume position"
            )
        self.dataloader_kwargs = dataloader_kwargs
        # reads, packs and agrees on the packs of each global batch; holds no trainer
        self.pack_source = StreamPackSource(
            source,
            seq_len=seq_len,
            lengths=lengths if lengths is not None else sample_tokens,
            transform=transform,
            collate_fn=collate_fn or PackCollator(seq_len),
            buffer=buffer,
            min_fill=min_fill,
            on_bad_sample=on_bad_sample,
            overlong=overlong,
            key=key,
            timeout_s=timeout_s,
            dataloader_kwargs=dataloader_kwargs,
        )
        self._micro_steps = int(micro_steps)
        self.trainer = trainer
        self.sampler = _EpochSetter()

    # -- what Lightning and the strategies read ----------------------------------------------

    @property
    def dataset(self) -> Any:
        return self.source

    @property
    def streams(self) -> int:
        """Streams this rank reads (its ``DataLoader`` workers, or one)."""
        return self.pack_source.streams

    @property
    def micro_steps(self) -> int:
        if self.trainer is not None:
            return step_spec(self.trainer).micro_steps
        return self._micro_steps

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.pack_source.begin()
        return self._generate()

    def _generate(self) -> Iterator[dict[str, Any]]:
        """The packs of the pass, each global batch formed (weighed) by a
        :class:`~lightning_vlmbalance.loaders.global_batch.GlobalBatchFormer` from the features
        its ranks agreed on (with a trainer); while training, the last one ends where the
        epoch's training batches do (``limit_train_batches``)."""
        steps = self._global_batches()
        trainer = self.trainer
        if trainer is None:
            for packs, _, lead in steps:
                for k, pack in enumerate(packs):
                    self.pack_source.handed(pack, trained=k >= lead)
                    if k >= lead:  # (the first were trained before the checkpoint)
                        yield pack
            return
        world = data_parallel_world(trainer.strategy)
        if trainer.training:
            steps = cut_steps(
                steps,
                num_replicas=world.size,
                start=lambda: self.start,
                stop=lambda: trainer.num_training_batches,
            )
        former = GlobalBatchFormer(
            micro_steps=self.micro_steps,
            num_replicas=world.size,
            rank=world.rank,
            gradient_ranks=world.gradient_ranks,
        )
        yield from handed_packs(former, steps, self.pack_source.handed)

    def global_batches(
        self, micro_steps: int | None = None
    ) -> Iterator[tuple[list[dict[str, Any]], np.ndarray, int]]:
        """The pass's global batches, for a loader that forms them itself (a
        :class:`~lightning_vlmbalance.RebalancingLoader`, which the ``"vlmbalance"`` strategies
        make): per optimizer step of ``micro_steps`` packs (default :attr:`micro_steps`), this
        rank's packs (not weighed), every data-parallel rank's pack features as the ranks
        agreed on them (rank by rank, one row per pack in order:
        :data:`~lightning_vlmbalance.loaders.global_batch.COLUMNS`; no second collective), and
        how many of this rank's first packs a resume inside the step trained before."""
        self.pack_source.begin()

        def steps() -> Iterator[tuple[list[dict[str, Any]], np.ndarray, int]]:
            for packs, features, skip in self._global_batches(micro_steps):
                for i, pack in enumerate(packs):
                    self.pack_source.handed(pack, trained=i >= skip)
                yield packs, features, skip

        return steps()

    def _global_batches(
        self, micro_steps: int | None = None
    ) -> Iterator[tuple[list[dict[str, Any]], np.ndarray, int]]:
        """The pack source's global batches of the epoch, for the fit's data-parallel world;
        the epoch is read at the first ``next()`` (Lightning calls ``set_epoch`` after
        ``iter``)."""
        world = data_parallel_world(self.trainer.strategy if self.trainer is not None else None)
        size = self.micro_steps if micro_steps is None else int(micro_steps)
        yield from self.pack_source.global_batches(self.epoch, world, size, self._collective_group)

    def _collective_group(self) -> Any:
        """The loaders' own process group (gloo; its collectives may run in a wrapper's thread
        while the training loop uses the world group), one per world, timeout and role
        (training or evaluation) for the whole process. Made at the first pass with more than
        one data-parallel rank, on every rank at the same point: the loop's first fetch."""
        role = "train" if self.trainer is not None and self.trainer.training else "eval"
        return loader_group(self.timeout_s, role)

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def start(self) -> int:
        """Position in this rank's packs of the epoch where the current pass started."""
        return self.pack_source.start_of(self.epoch)

    def _position(self) -> int:
        if self.trainer is not None and self.pack_source.passing(self.epoch):
            # where Lightning resumes a checkpoint saved now (it fetches one batch ahead of a
            # loader without a length; at validation or on an exception, that batch was not
            # trained), in every stage of the fit
            return seam.resume_position(self.trainer)
        return self.pack_source.position()

    def state_dict(self) -> dict[str, Any]:
        return self.state_at(self._position())

    def state_at(self, position: int) -> dict[str, Any]:
        """The state that resumes every rank at ``position`` (packs of this epoch handed out and
        trained on each rank) of the pass in progress.

        A stream's state differs by rank (where each of its streams stands), and Lightning
        writes one rank's copy, which every rank loads: so every rank's state is gathered here
        (one all-gather of small objects on the world group: Lightning saves a checkpoint on
        every rank at the same point) and each rank resumes from its own entry.
        """
        world = data_parallel_world(self.trainer.strategy if self.trainer is not None else None)
        own = self.pack_source.rank_state(position, self.epoch, world)
        states: list[Any] = [own]
        if world.world_size > 1 and dist.is_available() and dist.is_initialized():
            states = [None] * world.world_size
            dist.all_gather_object(states, own)
        return {
            "epoch": self.epoch,
            "ranks": world.size,
            "streams": self.streams,
            "processes": len(states),
            "per_rank": states,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes from :meth:`state_at`'s state. A state saved once its epoch was trained to the
        end (at the last micro-batch, or at the epoch's end) resumes at the next epoch's start:
        Lightning goes on with that epoch, and reads its first batch from the iterator it made
        before calling ``set_epoch``."""
        states = state_dict.get("per_rank", [state_dict])
        if all(s.get("finished") for s in states):
            self.pack_source.restore(None)
            self.sampler.set_epoch(int(state_dict["epoch"]) + 1)
            return
        lead = int(state_dict.get(STEP_LEAD, 0))
        if lead:  # saved by a RebalancingLoader inside a step: its first packs were trained
            moved = [
                {**s, "offset": int(s["offset"]) + lead} if "group" in s else s for s in states
            ]
            state_dict = {**state_dict, "per_rank": moved} if "per_rank" in state_dict else moved[0]
        self.pack_source.restore(dict(state_dict))
        self.sampler.set_epoch(int(state_dict["epoch"]))
