"""The map-style pack source: a :class:`~lightning_vlmbalance.PackingSampler`'s packs of an epoch,
read through one inner ``DataLoader``, from any position, with the state that resumes there.

It holds no trainer and weighs no loss: the loader in front of it
(:class:`~lightning_vlmbalance.PackedDataLoader`) says which epoch and plan a pass reads and how
many packs make an optimizer step, and hands the steps to the
:class:`~lightning_vlmbalance.loaders.global_batch.GlobalBatchFormer`. What it keeps is the
position: where the pass started, how far the inner ``DataLoader`` has read (workers read
ahead), how many packs were handed on, and the checkpoint state of a position.

**A resume inside an optimizer step** (a checkpoint at a mid-epoch validation, on an exception)
starts the pass at the step's first pack: the step is formed again whole (its loss weight counts
the tokens of the whole step), and :meth:`MapPackSource.global_batches` says how many of this
rank's first packs of it were trained before the checkpoint (the front does not hand them on).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.loaders.global_batch import STEP_LEAD
from lightning_vlmbalance.loss import optimizer_steps
from lightning_vlmbalance.packing.collate import PackCollator, PackItem
from lightning_vlmbalance.packing.plan import PADDING
from lightning_vlmbalance.parallel import data_parallel_world

__all__ = ["MapPackSource", "PassSources"]

log = logging.getLogger(__name__)


def _image_feature_shape(dataset: Dataset, sampler: Any) -> tuple[int, ...] | None:
    """Shape of one ``pixel_values`` row, read from the first sample with images (or None)."""
    with_images = np.flatnonzero(sampler.image_tokens > 0)
    if len(with_images) == 0:
        return None
    return tuple(torch.as_tensor(dataset[int(with_images[0])]["pixel_values"]).shape[1:])


def _check_ranks_agree(sampler: Any, epoch: int) -> None:
    """All ranks must plan ``epoch`` from the same table and settings, or DDP would hang on
    unequal step counts: one small all-gather per pass turns that into an error on every rank."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = data_parallel_world().world_size
    if world == 1:
        return
    # every rank of the world, tensor-parallel peers too: they plan the same packs
    mine = (epoch, sampler.packs_per_rank(epoch), json.dumps(sampler.fingerprint(), sort_keys=True))
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    if any(other != everyone[0] for other in everyone):
        detail = "; ".join(
            f"rank {r}: epoch {e}, {n} packs, {json.loads(f)}"
            for r, (e, n, f) in enumerate(everyone)
        )
        raise ValueError(f"the ranks disagree on the packing plan (config mismatch): {detail}")


def _check_sizes(dataset: Dataset, sampler: Any) -> None:
    if len(dataset) != len(sampler.total_tokens):
        raise ValueError(
            f"the dataset has {len(dataset)} samples but the sampler's length table has"
            f" {len(sampler.total_tokens)}: the length table does not match the dataset"
        )


class _PackDataset(Dataset):
    """Fetches the samples of a pack and checks each against the length table."""

    def __init__(self, dataset: Dataset, sampler: Any, collate_fn: PackCollator) -> None:
        self.dataset = dataset
        self.total_tokens = sampler.total_tokens
        self.image_tokens = sampler.image_tokens
        self.lengths = getattr(collate_fn, "sample_lengths", PackCollator.sample_lengths)

    def __getitem__(self, key: tuple[int, int]) -> PackItem:
        pack_id, index = key
        if pack_id == PADDING:
            return PackItem(pack_id, -1, None)
        sample = self.dataset[index]
        n, n_image = self.lengths(sample, index)
        if n != self.total_tokens[index] or n_image != self.image_tokens[index]:
            raise ValueError(
                f"sample {index} has {n} tokens ({n_image} image tokens) but the length table"
                f" says {int(self.total_tokens[index])} ({int(self.image_tokens[index])}): the"
                " length table does not match the dataset"
            )
        return PackItem(pack_id, index, sample)

    def __len__(self) -> int:
        return len(self.dataset)


class _PackRefs(Sampler[list[tuple[int, int]]]):
    """The batch sampler of the inner ``DataLoader``: one batch = one pack.

    It reads the packs to yield from its source at each iteration, so one inner ``DataLoader``
    (and its persistent workers) serves every epoch and every resume position.
    """

    def __init__(self, owner: MapPackSource) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        owner = self.owner
        refs, k = owner._refs, 0  # the pass's list: a re-plan changes its tail in place
        while True:
            with owner._refs_lock:
                if k >= len(refs):
                    return
                pack_id, ids = refs[k]
                k += 1
                if owner._refs is refs:
                    owner._refs_yielded = k
            yield [(pack_id, i) for i in ids.tolist()] if pack_id != PADDING else [(PADDING, -1)]

    def __len__(self) -> int:
        return len(self.owner._refs)


class MapPackSource:
    """The packs of ``sampler``'s plans over ``dataset`` (see the module docstring).

    Args:
        dataset: map-style dataset of samples (see :mod:`~lightning_vlmbalance.packing.collate`).
        sampler: the :class:`~lightning_vlmbalance.PackingSampler` over its length table.
        collate_fn: default ``PackCollator(sampler.config.seq_len)``.
        dataloader_kwargs: the inner ``DataLoader``'s settings (``num_workers``, ...).

    Raises:
        ValueError: if the dataset and the sampler's length table disagree in size.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Any,
        collate_fn: PackCollator | None,
        dataloader_kwargs: dict[str, Any],
    ) -> None:
        _check_sizes(dataset, sampler)
        self._dataset = dataset
        self._sampler = sampler
        self._collate_fn = collate_fn or PackCollator(sampler.config.seq_len)
        self.dataloader_kwargs = dataloader_kwargs
        self._flying = 0  # passes reading packs (started, not ended or closed)
        self._training_pass = False  # whether the last pass opened is a training pass
        self._resume_epoch: int | None = None  # restored, not read yet
        self._resume_at = 0
        self._iter_epoch: int | None = None  # the epoch of the pass in progress (or ended)
        self._pending = False  # a pass begun, its epoch not read yet
        self._first = 0  # position of the pass's first pack (a resumed step's first)
        self._lead = 0  # of them, trained before the checkpoint the pass resumes from
        self._delivered = 0  # packs of the pass handed on (the lead included)
        self._refs: list[tuple[int, np.ndarray]] = []
        self._refs_lock = threading.Lock()
        self._refs_yielded = 0  # packs of ``_refs`` the inner DataLoader has asked for
        self._inner: DataLoader | None = None
        self._fit_collator()

    def _fit_collator(self) -> None:
        if self._sampler.config.overlong == "truncate":
            self._collate_fn.truncate_text = True
        if self._collate_fn.image_feature_shape is None:
            self._collate_fn.image_feature_shape = _image_feature_shape(
                self._dataset, self._sampler
            )

    # -- settings: one changed after a pass reaches the next pass ----------------------------

    @property
    def dataset(self) -> Dataset:
        return self._dataset

    @dataset.setter
    def dataset(self, dataset: Dataset) -> None:
        _check_sizes(dataset, self._sampler)
        self._dataset = dataset
        self.remake()

    @property
    def sampler(self) -> Any:
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        _check_sizes(self._dataset, sampler)
        self._sampler = sampler
        self._fit_collator()
        self.remake()

    @property
    def collate_fn(self) -> PackCollator:
        return self._collate_fn

    @collate_fn.setter
    def collate_fn(self, collate_fn: PackCollator) -> None:
        self._collate_fn = collate_fn
        self._fit_collator()
        self.remake()

    def remake(self) -> None:
        """The next pass makes a new inner ``DataLoader`` (a setting it was made with changed):
        the old one's persistent workers are shut down, unless a pass still reads from them
        (then they end with that pass's iterator)."""
        inner, self._inner = self._inner, None
        if inner is None or self._flying > 0:
            return
        iterator = getattr(inner, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        inner._iterator = None

    def training_in_flight(self) -> bool:
        """Whether a training pass is reading packs (its iterator started, not ended or closed:
        one Lightning stopped early stays so until it lets go of it)."""
        return self._flying > 0 and self._training_pass

    # -- a pass ------------------------------------------------------------------------------

    def begin(self) -> None:
        """A pass begins; its epoch and start are read at :meth:`open` (Lightning creates the
        iterator before it calls ``set_epoch``)."""
        self._pending = True

    def open(self, plan_epoch: int, micro_steps: int = 1, training: bool = False) -> int:
        """Starts the pass of the sampler's epoch, reading the plan of ``plan_epoch`` (epoch 0's
        when overfitting), from the restored position's optimizer step of ``micro_steps``
        packs (``training``: a training pass). Returns the pass's lead (packs of its first step
        trained before)."""
        self._pending = False
        self._training_pass = bool(training)
        epoch, start = self.sampler.epoch, 0
        if self._resume_epoch is not None:
            if self._resume_epoch == epoch:
                start = self._resume_at
            self._resume_epoch = None
        self._lead = start % int(micro_steps)
        self._iter_epoch, self._first, self._delivered = epoch, start - self._lead, 0
        refs = self.sampler.pack_refs(self._first, epoch=plan_epoch)
        with self._refs_lock:
            self._refs, self._refs_yielded = refs, 0
        _check_ranks_agree(self.sampler, plan_epoch)
        if self._inner is None:
            self._inner = DataLoader(
                _PackDataset(self.dataset, self.sampler, self.collate_fn),
                batch_sampler=_PackRefs(self),
                collate_fn=self.collate_fn,
                **self.dataloader_kwargs,
            )
        return self._lead

    def packs(self) -> Iterator[dict[str, Any]]:
        """The opened pass's packs, in order (the inner ``DataLoader``'s batches)."""
        assert self._inner is not None, "open() the pass first"
        iterator = iter(self._inner)
        self._flying += 1
        try:
            yield from iterator
        finally:
            self._flying -= 1

    def global_batches(
        self, micro_steps: int, stop: Callable[[], float] | None = None
    ) -> Iterator[tuple[list[dict[str, Any]], None, int]]:
        """The opened pass's optimizer steps of ``micro_steps`` packs, aligned to the epoch,
        ending where ``stop()`` (the epoch's training batches) does: per step, this rank's
        packs, ``None`` (the features are gathered by the former) and how many of its first
        packs were trained before (the lead, on the first step only)."""
        first, lead = self._first, self._lead
        steps = optimizer_steps(
            self.packs(), micro_steps=micro_steps, start=lambda: first, stop=stop
        )
        for step in steps:
            yield step, None, lead
            lead = 0

    def handed(self, pack: Any, trained: bool = True) -> None:
        """A pack of the pass was handed on (``trained``: or it is a lead's, trained before)."""
        self._delivered += 1

    # -- positions ---------------------------------------------------------------------------

    def passing(self) -> bool:
        """Whether a pass of the sampler's current epoch is in progress (or ended)."""
        return not self._pending and self._iter_epoch == self.sampler.epoch

    def in_progress(self) -> bool:
        """Whether the position is the pass's (not a restored one, not read yet)."""
        return self.passing() and self._resume_epoch is None

    @property
    def start(self) -> int:
        """Position in this rank's packs where the current pass resumed (0: from the start)."""
        return self._first + self._lead if self._iter_epoch == self.sampler.epoch else 0

    @property
    def consumed(self) -> int:
        """Packs of the current epoch handed on (or restored as trained)."""
        if self._resume_epoch is not None:  # restored, not iterated yet
            return self._resume_at if self._resume_epoch == self.sampler.epoch else 0
        if not self.passing():
            return 0  # a new pass or a new epoch: nothing of it is consumed yet
        return self._first + self._delivered

    def read_position(self) -> int | None:
        """How far into this rank's packs of the epoch the inner ``DataLoader`` has asked for
        packs (at least what was handed on: workers and read-ahead ask earlier); ``None``
        without a pass of the current epoch in progress."""
        if not self.passing():
            return None
        with self._refs_lock:
            return self._first + self._refs_yielded

    def replan(self, model: CostModel, plan_epoch: int, after: int | None) -> int | None:
        """Re-plans the rest of the pass with ``model`` from the first global batch past
        position ``after`` with one to spare (see ``PackedDataLoader.adopt_cost_model``);
        returns that global batch (``None``: later epochs only)."""
        if after is None or self.read_position() is None:
            self.sampler.adopt_cost_model(model, epoch=plan_epoch, from_batch=None)
            return None
        G = self.sampler.micro_steps
        first = -(-int(after) // G) + 1
        with self._refs_lock:
            mine = self._first + self._refs_yielded
            if mine > first * G:
                raise RuntimeError(
                    f"PackedDataLoader: this rank has read {mine} packs of epoch"
                    f" {self.sampler.epoch} but the cost model changes at global batch {first}"
                    f" (pack {first * G}): `after` must be the furthest position any rank has"
                    " read"
                )
            if not self.sampler.adopt_cost_model(model, epoch=plan_epoch, from_batch=first):
                return None
            self._refs[first * G - self._first :] = self.sampler.pack_refs(first * G, plan_epoch)
        return first

    # -- checkpoints -------------------------------------------------------------------------

    def state(self, consumed: int) -> dict[str, Any]:
        """The state that resumes the current epoch at ``consumed`` packs of this rank."""
        state = {
            "epoch": self.sampler.epoch,
            "consumed": int(consumed),
            "fingerprint": self.sampler.fingerprint(),
        }
        if self.sampler.balanced:  # the cost models the epoch is planned with (calibration)
            state["cost_schedule"] = self.sampler.schedule_state()
        return state

    def state_at(self, position: int) -> dict[str, Any]:
        """The state that resumes at ``position`` of the pass in progress (without one: where
        the epoch stands)."""
        return self.state(position if self.in_progress() else self.consumed)

    def restore(self, state: dict[str, Any], plan_epoch: Callable[[int], int]) -> None:
        """The next pass resumes from ``state``; ``plan_epoch(epoch)``: the plan read in it.

        Raises:
            ValueError: if the packing settings or the dataset changed since the state was
                saved, naming each difference.
        """
        saved, current = state["fingerprint"], self.sampler.fingerprint()
        diff = _differences(saved, current)
        if diff:
            shown = [f"{k}: saved {_short(a)}, now {_short(b)}" for k, a, b in diff[:8]]
            more = f", and {len(diff) - 8} more" if len(diff) > 8 else ""
            detail = ", ".join(shown) + more
            raise ValueError(
                "cannot resume the PackedDataLoader: the packing settings or the dataset changed"
                f" since the checkpoint ({detail})"
            )
        self._resume_epoch = int(state["epoch"])
        # a state an older RebalancingLoader saved inside an optimizer step: its
        # position is the step's start, and the step's first packs (its lead) were trained
        self._resume_at = int(state["consumed"]) + int(state.get(STEP_LEAD, 0))
        self.sampler.set_epoch(self._resume_epoch)
        if self.sampler.balanced and state.get("cost_schedule"):
            self.sampler.load_schedule_state(plan_epoch(self._resume_epoch), state["cost_schedule"])
        log.info(
            "PackedDataLoader resumes epoch %d at pack %d", self._resume_epoch, self._resume_at
        )


def _differences(saved: Any, current: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """The settings that differ, by dotted path into nested dicts (``balance.runtime.options``),
    each with its saved and current value."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in [*current, *(k for k in saved if k not in current)]:
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(saved.get(key), current.get(key), sub)
        return out
    return [] if saved == current else [(path, saved, current)]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PassSources:
    """A loader's pack sources: its own (``main``: training passes, and the positions and states
    a checkpoint saves), and a second one made for an evaluation pass begun while a training
    pass of ``main`` reads (the training loader reused for validation, which Lightning runs
    mid-epoch): its own inner ``DataLoader``, persistent workers and positions, so the training
    pass goes on with its own."""

    def __init__(self, main: MapPackSource) -> None:
        self.main = main
        self.second: MapPackSource | None = None

    def all(self) -> list[MapPackSource]:
        return [self.main] if self.second is None else [self.main, self.second]

    def of_pass(self, evaluating: bool) -> MapPackSource:
        """The source of a pass about to begin (``evaluating``: a pass the loader's trainer
        runs outside training; without a trainer a pass cannot be told apart: ``False``)."""
        main = self.main
        if not evaluating or not main.training_in_flight():
            return main
        if self.second is None:
            self.second = MapPackSource(
                main.dataset, main.sampler, main.collate_fn, main.dataloader_kwargs
            )
        return self.second

    def set(self, name: str, value: Any) -> None:
        """A setting (``dataset``, ``sampler``, ``collate_fn``) of every source."""
        for source in self.all():
            setattr(source, name, value)

    def made_loaders(self) -> list[DataLoader]:
        return [source._inner for source in self.all() if source._inner is not None]

    def remake(self) -> None:
        for source in self.all():
            source.remake()

    def iterated(self) -> DataLoader | None:
        """The first inner ``DataLoader`` with a live (persistent) iterator: the one a
        loader's ``_iterator`` answers (Lightning asks at the end of a fit or a validation run,
        once per loop that iterated the loader: each call shuts one down)."""
        live = [made for made in self.made_loaders() if made._iterator is not None]
        return live[0] if live else None
