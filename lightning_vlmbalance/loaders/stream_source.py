"""The stream pack source: this rank's packs of a streamed dataset, read, measured, packed and
decoded by its ``DataLoader`` workers, merged in a fixed order, and agreed on with the other
ranks one global batch at a time (equal steps, the tail lent, exact resume points). The
Lightning-facing loader over it is :class:`~lightning_vlmbalance.PackedStreamLoader`
(:mod:`lightning_vlmbalance.loaders.streaming`, whose module docstring describes the whole).
"""

from __future__ import annotations

import copy
import datetime
import gc
import hashlib
import itertools
import logging
import numbers
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_vlmbalance.balance.exchange import exchange_packs
from lightning_vlmbalance.loaders.global_batch import COLUMNS, pack_features
from lightning_vlmbalance.packing.collate import PackCollator, PackItem
from lightning_vlmbalance.packing.plan import PADDING
from lightning_vlmbalance.packing.stream import WindowState, pack_stream_windows
from lightning_vlmbalance.parallel import DataParallelWorld

__all__ = ["BAD_SAMPLE_POLICIES", "StreamPackSource", "hand_size", "tail_plan", "trained_counts"]

log = logging.getLogger(__name__)

BAD_SAMPLE_POLICIES = ("skip", "raise")
OVERLONG_POLICIES = ("error", "skip")  # PackingConfig.overlong's, less "truncate"
_END = "_stream_end"  # the key of a stream's last item: its end marker
_KEPT_GROUPS = 64  # global-batch starts kept for ``state_at`` (a wrapper reads ahead a few)
_CHECKED = 16  # records a resume reads at its anchor and compares with the saving run's


def _identity(item: Any) -> Any:
    return item


def _single_pass(source: Iterable[Any]) -> Iterator[Any]:
    """``source``'s records through one iterator: skipping and reading go on from where the
    other stopped even for a source whose ``__iter__`` returns itself and starts again
    (LitData's ``StreamingDataset``), which ``enumerate(source)`` after ``iter(source)``
    would restart."""
    records = iter(source)
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        yield record


def _digest(prints: Iterable[str]) -> str:
    return hashlib.sha1("\n".join(prints).encode()).hexdigest()[:16]


_GROUPS: dict[tuple[int, float], Any] = {}


def loader_group(timeout_s: float, role: str) -> Any:
    """The gloo group every ``PackedStreamLoader`` of this process uses with this world,
    timeout and role (``"train"``, ``"eval"``): one for the process, not one more per loader (a
    fit builds a new loader; its group would never be used again). Training and evaluation
    have groups of their own: a rebalancing strategy's thread runs the training loader's
    collectives while the validation loader runs its own in the training loop."""
    key = (id(dist.group.WORLD), float(timeout_s), role)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


def _stateful(source: Any) -> bool:
    """Whether ``source`` saves and restores its own position (``state_dict()`` with no
    argument, ``load_state_dict(state)``), as Hugging Face's ``IterableDataset`` does."""
    if not callable(getattr(source, "load_state_dict", None)):
        return False
    try:
        source.state_dict()
    except TypeError:  # a state_dict that needs arguments (LitData's): not this protocol
        return False
    return True


def _record_key(record: Any) -> str | None:
    """A record's own name, when it has one (WebDataset's ``__key__``, a ``key`` or ``id``)."""
    if isinstance(record, dict):
        for name in ("__key__", "key", "id", "uid"):
            value = record.get(name)
            if isinstance(value, str | numbers.Integral):
                return str(value)
    return None


class _Stream(IterableDataset):
    """One worker's stream: read, measure, pack, decode, collate (see the module docstring).

    Yields collated packs with ``meta["stream"]`` (the worker), ``meta["stream_pack"]`` (the
    pack's index in its stream), ``meta["anchor"]`` (where a resume re-reads from to rebuild
    this pack: a window state and the stream position of its first new record) and
    ``meta["bad_samples"]`` (records skipped since the last item), then an end marker.
    """

    def __init__(self, owner: StreamPackSource, epoch: int, resume: dict[int, Any]) -> None:
        self.source = owner.source
        self.lengths = owner.lengths
        self.transform = owner.transform
        self.collate_fn = owner.collate_fn
        self.seq_len = owner.seq_len
        self.buffer = owner.buffer
        self.min_fill = owner.min_fill
        self.on_bad_sample = owner.on_bad_sample
        self.overlong = owner.overlong
        self.key = owner.key
        self.epoch = epoch
        self.resume = resume  # stream -> {"anchor": [...], "taken": k, "ended": bool}
        self.rank = owner.rank

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        stream = 0 if info is None else int(info.id)
        resume = self.resume.get(stream)
        bad: list[dict[str, Any]] = []
        if resume is not None and resume["ended"]:
            yield {_END: stream, "bad_samples": bad}
            return
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        state, position, skip, seek, check = WindowState(), 0, 0, None, None
        if resume is not None:
            window, position, seek, *rest = resume["anchor"]
            state, skip = WindowState.from_list(window), int(resume["taken"])
            check = rest[0] if rest else None
        # packer position -> (stream position, record, tokens), while the record is buffered
        records: dict[int, tuple[int, Any, int]] = {}
        where: dict[int, int] = {}  # packer position -> stream position, for window anchors
        prints: dict[int, str] = {}  # stream position -> the record's print, for anchors' checks
        # a source with its own state (Hugging Face's IterableDataset: state_dict after n
        # records resumes at record n) is saved every `every` records and resumed from the
        # last save before the anchor; any other source is read again from its start
        stateful = _stateful(self.source)
        every = max(1, self.buffer // 4)
        saves: deque[tuple[int, Any]] = deque()
        source = self._positioned(stream, position, seek if stateful else None, check)
        if stateful:
            saves.append((position, self._source_state()))

        def measured() -> Iterator[int]:
            good = state.read  # the packer's positions count the records it was given
            for offset, record in enumerate(source):
                at = position + offset
                if stateful and (at + 1) % every == 0:
                    saves.append((at + 1, self._source_state()))
                tokens = self._measure(record, stream, at, bad)
                prints[at] = self._print(record, tokens)
                if tokens is None:
                    continue
                records[good] = (at, record, tokens)
                where[good] = at
                good += 1
                yield tokens

        def anchor_at(window: WindowState, at: int) -> list[Any]:
            while len(saves) > 1 and saves[1][0] <= at:
                saves.popleft()
            seek = list(saves[0]) if saves and saves[0][0] <= at else None
            for p in [p for p in prints if p < at]:
                del prints[p]
            # what a resume must read again at `at`: the records read since, up to _CHECKED
            run = list(itertools.takewhile(prints.__contains__, range(at, at + _CHECKED)))
            return [window.to_list(), at, seek, [len(run), _digest(prints[p] for p in run)]]

        windows = pack_stream_windows(
            measured(), self.seq_len, buffer=self.buffer, min_fill=self.min_fill, start=state
        )
        anchor: list[Any] | None = None
        for window, packs in windows:
            if anchor is None:  # the first window's packs resume from its start
                anchor = anchor_at(state, position)
            first = window.packs_before
            for k, pack in enumerate(packs, start=first):
                # (a skipped pack's records carried from before the anchor were never read)
                items = [records.pop(int(p), None) for p in pack]
                if k < skip:  # handed out before the checkpoint: not decoded
                    continue
                yield self._collate(stream, k, items, anchor, bad)
                bad = []
            # the next window's packs hold this window's carried records, read in this window:
            # they resume from this window's start
            anchor = anchor_at(window, where.get(window.read, position))
            for p in [p for p in where if p < window.read]:
                del where[p]
        yield {_END: stream, "bad_samples": bad}

    def _positioned(
        self, stream: int, position: int, seek: list[Any] | None, check: list[Any] | None
    ) -> Iterator[Any]:
        """The source's records from stream ``position`` on, checked against ``check`` (how many
        records the anchor read there, and their digest): a source that resumes from its own
        saved state (``seek``) is tried first and, where what it yields there differs (a
        shuffle buffer the state does not keep, a batched map that skips a batch) or it fails,
        read again from its start; a source whose records differ from the saving run's even
        then is refused, naming the stream and the position."""
        attempts = [seek, None] if seek is not None else [None]
        initial = self._source_state() if seek is not None else None  # the stream's start
        found: list[str] = []
        for attempt in attempts:
            read = 0
            try:
                if attempt is not None:
                    read = int(attempt[0])
                    self.source.load_state_dict(copy.deepcopy(attempt[1]))  # type: ignore[attr-defined]
                elif seek is not None:  # a failed seek: from the start of the stream again
                    self.source.load_state_dict(initial)  # type: ignore[attr-defined]
                records = _single_pass(self.source)
                for skipped in range(read, position):  # read again, not decoded
                    if next(records, _END) is _END:
                        raise RuntimeError(
                            f"it ended after {skipped} records while resuming at record {position}"
                        )
                peeked = list(itertools.islice(records, int(check[0]) if check else 0))
            except Exception as err:
                if attempt is None:
                    raise self._differs(stream, position, str(err)) from err
                log.info(
                    "PackedStreamLoader: rank %d, stream %d: resuming from the source's own"
                    " state failed (%s); reading the stream again from its start",
                    self.rank,
                    stream,
                    err,
                )
                continue
            found = [self._print(r, self._tokens(r)) for r in peeked]
            if check is None or [len(found), _digest(found)] == list(check):
                return itertools.chain(peeked, records)
            if attempt is not None:
                log.info(
                    "PackedStreamLoader: rank %d, stream %d: the source's own state resumes at"
                    " other records than the saving run read (a shuffle buffer or a batched"
                    " map); reading the stream again from its start",
                    self.rank,
                    stream,
                )
        raise self._differs(
            stream,
            position,
            f"the {len(found)} record(s) read there now ({', '.join(found[:4])}, ...) are not"
            " those the saving run read there",
        )

    def _differs(self, stream: int, position: int, detail: str) -> ValueError:
        return ValueError(
            f"PackedStreamLoader: cannot resume rank {self.rank}'s stream {stream} at record"
            f" {position}: {detail}. A streamed source must yield the same records in the same"
            " order when iterated again (a shuffle needs a seed, and the loader calls the"
            " source's `set_epoch(epoch)`; WebDataset's `.shuffle()` and an unseeded"
            " `datasets` shuffle are not reproducible): resume from an epoch's end, or make"
            " the source's order reproducible"
        )

    def _tokens(self, record: Any) -> int | None:
        """``lengths(record)``'s tokens, or ``None`` where it fails (no policy applied)."""
        try:
            tokens = self.lengths(record)
            return int(tokens[0] if isinstance(tokens, tuple | list) else tokens)
        except Exception:
            return None

    def _print(self, record: Any, tokens: int | None) -> str:
        """What identifies a record in a resume check: its tokens and its key, if any."""
        key = self.key(record) if self.key is not None else _record_key(record)
        return f"{tokens if tokens is not None else '?'}:{key}"

    def _source_state(self) -> Any:
        return copy.deepcopy(self.source.state_dict())  # type: ignore[attr-defined]

    def _measure(self, record: Any, stream: int, at: int, bad: list) -> int | None:
        try:
            tokens = self.lengths(record)
            if isinstance(tokens, tuple | list):
                tokens = tokens[0]
            tokens = int(tokens)
            if tokens < 1:
                raise ValueError(f"{tokens} tokens, not in [1, seq_len={self.seq_len}]")
        except Exception as err:  # a bad record: the policy decides
            self._bad(record, stream, at, f"lengths: {err}", bad, err)
            return None
        if tokens > self.seq_len:  # the map-style sampler's policy (PackingConfig.overlong)
            reason = f"overlong: {tokens} tokens, more than seq_len={self.seq_len}"
            if self.overlong == "error":
                raise ValueError(
                    f"PackedStreamLoader: {self._where(record, stream, at)}: {reason}. Pass"
                    " `overlong='skip'` to leave such records out (counted in `bad_samples`,"
                    " with a warning), or raise `seq_len`"
                )
            bad.append(self._entry(record, stream, at, reason))
            return None
        return tokens

    def _where(self, record: Any, stream: int, at: int) -> str:
        key = self.key(record) if self.key is not None else _record_key(record)
        return f"rank {self.rank}, stream {stream}, record {at}" + (
            f" ({key})" if key is not None else ""
        )

    def _entry(self, record: Any, stream: int, at: int, reason: str) -> dict[str, Any]:
        key = self.key(record) if self.key is not None else _record_key(record)
        return {"rank": self.rank, "stream": stream, "position": at, "key": key, "reason": reason}

    def _bad(
        self, record: Any, stream: int, at: int, reason: str, bad: list, err: Exception
    ) -> None:
        if self.on_bad_sample == "raise":
            raise ValueError(
                f"PackedStreamLoader: {self._where(record, stream, at)}: {reason}"
            ) from err
        bad.append(self._entry(record, stream, at, reason))

    def _collate(
        self, stream: int, k: int, items: list[tuple[int, Any, int]], anchor: list, bad: list
    ) -> dict[str, Any]:
        samples, positions, keys = [], [], []
        for at, record, said in items:
            try:
                sample = self.transform(record) if self.transform is not None else record
                tokens, _ = PackCollator.sample_lengths(sample, at)
            except Exception as err:
                self._bad(record, stream, at, f"transform: {err}", bad, err)
                continue
            if tokens != said:
                raise ValueError(
                    f"PackedStreamLoader: {self._where(record, stream, at)}: the"
                    f" decoded sample has {tokens} tokens but `lengths` said {said}; the lengths"
                    " function must count what the transform produces"
                )
            samples.append(sample)
            positions.append(at)
            keys.append(self.key(record) if self.key is not None else _record_key(record))
        if samples:
            batch = self.collate_fn([PackItem(k, p, s) for p, s in zip(positions, samples)])
        else:  # every record of the pack was bad
            batch = self.collate_fn([PackItem(PADDING, -1, None)])
        batch["meta"].update(
            stream=stream, stream_pack=k, anchor=anchor, keys=keys, bad_samples=bad
        )
        return batch


class StreamPackSource:
    """This rank's packs of a streamed dataset, one global batch at a time, the same number on
    every rank (see the module docstring of :mod:`~lightning_vlmbalance.loaders.streaming`):
    the pack source of a :class:`~lightning_vlmbalance.PackedStreamLoader`. It holds no trainer
    and weighs no loss: the loader tells it the epoch, the data-parallel world and the packs
    per rank of a global batch, and hands what it yields on (weighed by its former, or to a
    rebalancing strategy's loader).

    Args: as :class:`~lightning_vlmbalance.PackedStreamLoader`'s of the same names (checked
    there); ``dataloader_kwargs`` is the loader's dict (Lightning's settings of its workers
    reach the pass through it).
    """

    def __init__(
        self,
        source: Iterable[Any],
        *,
        seq_len: int,
        lengths: Callable[[Any], Any],
        transform: Callable[[Any], dict[str, Any]] | None,
        collate_fn: PackCollator,
        buffer: int,
        min_fill: float,
        on_bad_sample: str,
        overlong: str,
        key: Callable[[Any], str] | None,
        timeout_s: float,
        dataloader_kwargs: dict[str, Any],
    ) -> None:
        self.source = source
        self.seq_len = int(seq_len)
        self.lengths = lengths
        self.transform = transform
        self.collate_fn = collate_fn
        self.buffer = int(buffer)
        self.min_fill = float(min_fill)
        self.on_bad_sample = on_bad_sample
        self.overlong = overlong
        self.key = key
        self.timeout_s = float(timeout_s)
        self.dataloader_kwargs = dataloader_kwargs
        self._warned_overlong = False
        self._warned = False  # the LitData drop_last warning, once
        self._padding_features: list[int] | None = None
        self.rank = 0
        # progress of the current pass
        self._pending = False
        self._iter_epoch: int | None = None
        self._start = 0
        self._delivered = 0
        self._points = _ResumePoints()
        self._resume: dict[str, Any] | None = None
        # reports: records skipped (by the policy), padding packs this rank trained
        self.bad_samples: list[dict[str, Any]] = []
        self.padding_packs = 0
        self.packs = 0  # packs with samples handed out this epoch
        self.left_over = 0  # packs read but not trained when an empty rank ended an epoch
        self.lent_packs = 0  # packs this rank handed to peers whose streams had ended

    @property
    def num_workers(self) -> int:
        return int(self.dataloader_kwargs.get("num_workers", 0))

    @property
    def streams(self) -> int:
        """Streams this rank reads (its ``DataLoader`` workers, or one)."""
        return max(1, self.num_workers)

    def begin(self) -> None:
        """A pass was asked for (``iter``): it starts at its first ``next()``."""
        self._pending = True

    def start_of(self, epoch: int) -> int:
        """Position in this rank's packs of ``epoch`` where the current pass started."""
        return self._start if self._iter_epoch == epoch else 0

    def position(self) -> int:
        """Where the pass stands: its start and the packs delivered since."""
        return self._start + self._delivered

    def passing(self, epoch: int) -> bool:
        """Whether a pass of ``epoch`` is in progress (or ended)."""
        return self._iter_epoch == epoch

    def restore(self, state: dict[str, Any] | None) -> None:
        """The next pass resumes from ``state`` (every process's, as saved; ``None``: from its
        epoch's start)."""
        self._resume = state

    def global_batches(
        self,
        epoch: int,
        world: DataParallelWorld,
        micro_steps: int,
        make_group: Callable[[], Any],
    ) -> Iterator[tuple[list[dict[str, Any]], np.ndarray, int]]:
        """The pass's global batches of ``epoch``: this rank's packs of each (padding included),
        every data-parallel rank's pack features (rank by rank, one row per pack:
        :data:`~lightning_vlmbalance.loaders.global_batch.COLUMNS`), and how many of this
        rank's first packs a resume inside the first one trained before.

        Args:
            epoch: the epoch of the pass (read by the caller at the pass's first ``next()``:
                Lightning calls ``set_epoch`` after ``iter``).
            world: the data-parallel world (its ranks, this rank, the processes of each).
            micro_steps: packs per rank per global batch.
            make_group: makes (or returns) the process group of the ranks' agreement, called
                on every rank at the same point when there is more than one rank.
        """
        self._pending = False
        size, rank, copies = world.size, world.rank, world.copies
        self.rank = rank
        if not self._warned:
            self._warned = _drops_last(self.source, size)
        restored = self._restore_pass(epoch, world)
        if restored is None:
            return  # the checkpoint's epoch was trained to its end
        state, offset = restored
        G = int(micro_steps)
        group = make_group() if size > 1 else None
        resume = {int(s): v for s, v in state["streams"].items()}
        inner = DataLoader(
            _Stream(self, epoch, resume),
            batch_size=None,
            collate_fn=_identity,
            **self.dataloader_kwargs,
        )
        if self.num_workers > 0:
            # garbage is collected here, not in the workers forked next: with several fits in
            # one process, a worker segfaulted at its start while collecting garbage left by
            # the earlier fits (a finalizer run in a child without the parent's threads)
            gc.collect()
        merged = _RoundRobin(iter(inner), state, self.streams)
        agreement = _Agreement(merged, state, G, size, rank, copies, group)
        template: torch.Tensor | None = None  # an empty pixel_values shaped like this rank's
        first = state["position"] == 0
        current = agreement.take()
        while True:
            snapshot, table = agreement.wait(current)
            if not agreement.any_pack(table):  # no rank has a pack: the epoch ends everywhere
                self._report_bad(merged.leftover_bad)
                if first:
                    warnings.warn(
                        f"PackedStreamLoader: no rank's source yielded a record that could be"
                        f" packed in epoch {epoch} ({len(self.bad_samples)} skipped on this"
                        " rank: `bad_samples`); the epoch has no steps",
                        stacklevel=3,
                    )
                self._finish(epoch)
                return
            if first and int(table[:, 1].min()) == 0:
                self._empty_rank(epoch, table[:, 1], agreement.in_hand(), copies)
                return
            if first:
                _warn_unsplit(agreement.in_hand(), group, copies, rank)
            first = False
            step = agreement.settle(table)
            # the counters as they stood before this global batch (a resume into it repeats it)
            snapshot["lent"] = self.lent_packs
            snapshot["bad_samples"] = list(self.bad_samples)
            snapshot["padding"], snapshot["packs"] = self.padding_packs, self.packs
            received, lent = _lend(step.moves, step.lent, rank, step.own, G, group, self.timeout_s)
            self.lent_packs += lent
            packs = step.kept + [received[(src, k)] for src, k, dst in step.moves if dst == rank]
            for pack in packs:
                if pack["meta"]["sample_ids"]:
                    template = pack["pixel_values"][:0].clone()
            current = agreement.take()  # the next global batch's agreement runs meanwhile
            self._points.add(snapshot["position"], snapshot)
            # a rank short of packs pads to the longest share (the ranks step together; a
            # stream that ended on every rank ends with a shorter last step, as Lightning's)
            packs += [self._padding(template) for _ in range(step.length - len(packs))]
            features = _step_features(
                table, step.used, step.moves, copies, step.length, self._padding_row()
            )
            yield packs, features, offset
            offset = 0

    def handed(self, pack: dict[str, Any], trained: bool) -> None:
        """A pack handed on: its skipped records reported, the epoch's counters; ``trained``:
        not one a resume inside its global batch trained before (it counts as delivered)."""
        self._delivered += int(trained)
        meta = pack["meta"]
        self._report_bad(meta.pop("bad_samples", []))
        if meta["padding"]:
            self.padding_packs += 1
        else:
            self.packs += 1

    def _restore_pass(
        self, epoch: int, world: DataParallelWorld
    ) -> tuple[dict[str, Any], int] | None:
        """Where the pass starts: the restored state's global batch and the packs of it trained
        before the checkpoint, or the epoch's start (``None``: the restored epoch was trained to
        its end). Sets the epoch's counters as they stood there."""
        state, offset = self._fresh_state(), 0
        if self._resume is not None:
            saved = own_entry(self._resume, world.world_size, world.global_rank)
            self._resume = None
            if saved["epoch"] == epoch and saved.get("finished"):
                self._iter_epoch, self._start, self._delivered = epoch, saved["position"], 0
                return None
            if saved["epoch"] == epoch and "group" in saved:
                _check_same_shards(saved, world.size, self.streams)
                state, offset = copy.deepcopy(saved["group"]), int(saved["offset"])
        if state["position"] == 0:
            self.bad_samples, self.padding_packs, self.packs, self.left_over = [], 0, 0, 0
            self.lent_packs = 0
        else:
            self.bad_samples = list(state["bad_samples"])
            self.padding_packs, self.packs = int(state["padding"]), int(state["packs"])
            self.lent_packs = int(state.get("lent", 0))
        self._iter_epoch, self._start, self._delivered = epoch, state["position"] + offset, 0
        self._points.clear()
        return state, offset

    def _fresh_state(self) -> dict[str, Any]:
        return {"position": 0, "cursor": 0, "streams": {}, "any_read": False}

    def _report_bad(self, entries: list[dict[str, Any]]) -> None:
        """Adds skipped records to :attr:`bad_samples`, once each (a resumed stream reads the
        records since its anchor again, bad ones included)."""
        if not entries:
            return
        known = {(b["rank"], b["stream"], b["position"]) for b in self.bad_samples}
        for entry in entries:
            if (entry["rank"], entry["stream"], entry["position"]) not in known:
                self.bad_samples.append(entry)
                if entry["reason"].startswith("overlong") and not self._warned_overlong:
                    self._warned_overlong = True
                    warnings.warn(
                        f"PackedStreamLoader(overlong='skip'): rank {entry['rank']}, stream"
                        f" {entry['stream']}, record {entry['position']} ({entry['key']}) is"
                        f" left out: {entry['reason']}; every such record is counted in"
                        " `bad_samples` (warned once)",
                        stacklevel=3,
                    )

    def _padding_row(self) -> list[int]:
        """A padding pack's features (the same on every rank)."""
        if self._padding_features is None:
            self._padding_features = pack_features(self._padding(None))
        return self._padding_features

    def _padding(self, template: torch.Tensor | None) -> dict[str, Any]:
        """A pack without samples (no tokens to learn: weight 0); its empty ``pixel_values``
        shaped like this rank's packs' (``template``)."""
        pack = self.collate_fn([PackItem(PADDING, -1, None)])
        if template is not None:
            pack["pixel_values"] = template.clone()
        pack["meta"].update(stream=-1, stream_pack=-1, anchor=None, keys=[], bad_samples=[])
        return pack

    def _finish(self, epoch: int) -> None:
        self._points.finish(self._start + self._delivered)
        if self.padding_packs:
            log.info(
                "PackedStreamLoader: rank %d trained %d padding pack(s) in epoch %d while its"
                " stream had ended and a peer's had not",
                self.rank,
                self.padding_packs,
                epoch,
            )

    def _empty_rank(self, epoch: int, any_read: torch.Tensor, packs: list, copies: int) -> None:
        empty = [int(r) // copies for r in torch.nonzero(any_read == 0).flatten()]
        self.left_over = len(packs)
        self._points.finish(self._start + self._delivered)
        warnings.warn(
            f"PackedStreamLoader: the source of rank(s) {sorted(set(empty))} yielded no records"
            f" in epoch {epoch}, so the epoch ends on every rank (no steps). This rank read"
            f" {len(packs)} pack(s) it leaves untrained. Check the source's sharding (e.g."
            " fewer shards than ranks x workers)",
            stacklevel=3,
        )

    def rank_state(self, position: int, epoch: int, world: DataParallelWorld) -> dict[str, Any]:
        """This rank's own state at ``position`` of ``epoch`` (a
        :meth:`PackedStreamLoader.state_at` gathers every rank's)."""
        base = {"epoch": epoch, "ranks": world.size, "streams": self.streams}
        if self._resume is not None:  # restored, not iterated yet: keep what was restored
            return own_entry(self._resume, world.world_size, world.global_rank)
        if self._pending or self._iter_epoch != epoch or not self._points:
            return {**base, "finished": self._iter_epoch == epoch, "position": 0}
        return {**base, **self._points.state_at(position)}


def _drops_last(source: Any, size: int) -> bool:
    """Warns where LitData's ``StreamingDataset`` drops the epoch's last records (returns
    whether it warned)."""
    if size > 1 and type(source).__module__.startswith("litdata"):
        if getattr(source, "drop_last", False):
            warnings.warn(
                "PackedStreamLoader: LitData's `StreamingDataset` drops the last records"
                " of the epoch so every rank reads as many (`drop_last=True`, its default"
                " under several ranks): they are never trained. This loader ends the ranks"
                " together itself: pass `StreamingDataset(..., drop_last=False)`",
                stacklevel=4,
            )
            return True
    return False


def _warn_unsplit(packs: list[dict[str, Any]], group: Any, copies: int, rank: int) -> None:
    """Warns, naming a record, where the first packs of two streams (workers) or of two
    ranks hold the same record key: a source that does not split itself across
    ``DataLoader`` workers (or a Hugging Face stream without ``split_dataset_by_node``)
    trains every record once per worker (or rank). One gather of keys per epoch."""
    seen: dict[str, int] = {}
    twice = None
    for pack in packs:
        for key in pack["meta"]["keys"]:
            stream = int(pack["meta"]["stream"])
            if key is not None and seen.setdefault(key, stream) != stream and twice is None:
                twice = key
    if twice is not None:
        warnings.warn(
            f"PackedStreamLoader: record {twice!r} comes from two DataLoader workers of"
            f" rank {rank} (streams {sorted(set(seen.values()))}): the source does not"
            " split itself across workers (each would train every record); shard it by"
            " `torch.utils.data.get_worker_info()`",
            stacklevel=4,
        )
    if group is None:  # (every rank gathers, whatever it found: no unpaired collective)
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(seen), group=group)
    owner: dict[str, int] = {}
    for process, keys in enumerate(everyone):
        if process % copies:  # a tensor-parallel peer reads the same packs
            continue
        for key in keys:
            if owner.setdefault(key, process) != process:
                warnings.warn(
                    f"PackedStreamLoader: record {key!r} is read by processes {owner[key]}"
                    f" and {process}: the source does not split itself across ranks (each"
                    " would train every record); shard it by rank (Hugging Face:"
                    " `datasets.distributed.split_dataset_by_node`)",
                    stacklevel=4,
                )
                return


def _lend(
    moves: list[tuple[int, int, int]],
    lent: list[dict[str, Any]],
    rank: int,
    own: int,
    G: int,
    group: Any,
    timeout_s: float,
) -> tuple[dict[tuple[int, int], dict[str, Any]], int]:
    """Hands this rank's ``lent`` packs to the peers the tail plan names and receives its
    own (point to point on the loader's group); keys ``(source rank, index in its hand)``,
    and how many packs this rank lent."""
    if not moves:
        return {}, 0
    ids = {(src, k): src * 2 * G + k for src, k, _ in moves}
    outgoing = {ids[(src, k)]: lent[k - own] for src, k, _ in moves if src == rank}
    received = exchange_packs(
        outgoing,
        [(ids[(src, k)], src, dst) for src, k, dst in moves],
        rank=rank,
        group=group,
        timeout_s=timeout_s,
    )
    mine = {(src, k): received[ids[(src, k)]] for src, k, dst in moves if dst == rank}
    return mine, len(outgoing)


def _check_same_shards(saved: dict[str, Any], size: int, streams: int) -> None:
    if saved["ranks"] != size or saved["streams"] != streams:
        raise ValueError(
            f"cannot resume the PackedStreamLoader mid-epoch {saved['epoch']}: the"
            f" checkpoint was saved with {saved['ranks']} rank(s) x {saved['streams']}"
            f" stream(s) (workers) and this run has {size} x {streams}; a streamed"
            " source is sharded by rank and worker, so the remaining records of the epoch"
            " cannot be found on other shards. Resume with the same ranks and num_workers,"
            " or from a checkpoint saved at an epoch's end (any number)"
        )


class _ResumePoints:
    """Where this rank's pass can resume: the start of each of the last global batches formed
    (:data:`_KEPT_GROUPS` of them: a wrapper reads a few ahead), each with the state of the
    streams and the epoch's counters before it; and where the pass ended."""

    def __init__(self) -> None:
        self._starts: deque[tuple[int, dict[str, Any]]] = deque(maxlen=_KEPT_GROUPS)

    def __len__(self) -> int:
        return len(self._starts)

    def clear(self) -> None:
        self._starts.clear()

    def add(self, position: int, snapshot: dict[str, Any]) -> None:
        """A global batch starts at ``position`` of the epoch, from ``snapshot``."""
        self._starts.append((int(position), snapshot))

    def finish(self, position: int) -> None:
        """The pass ended at ``position``: the epoch was trained to its end there."""
        self._starts.append((int(position), {"finished": True}))

    def state_at(self, position: int) -> dict[str, Any]:
        """The state that resumes at ``position``: the last global batch starting at or before
        it, and how many packs of it were trained (``offset``); or the end of the epoch."""
        start, snapshot = None, None
        for at, snap in self._starts:
            if at <= position:
                start, snapshot = at, snap
        if snapshot is None:
            raise RuntimeError(
                f"PackedStreamLoader: position {position} is before the global batches this"
                " loader still remembers"
            )
        if snapshot.get("finished"):
            return {"finished": True, "position": start}
        return {"group": copy.deepcopy(snapshot), "offset": position - start}


def own_entry(saved: dict[str, Any], processes: int, process: int) -> dict[str, Any]:
    """Process ``process``'s entry of a state saved by ``state_at`` (every process's, of
    ``processes`` then; a mid-epoch state needs as many now).

    Raises:
        ValueError: for a mid-epoch state saved by another number of processes.
    """
    if "per_rank" not in saved:  # one rank's state (an older checkpoint)
        return dict(saved)
    states = saved["per_rank"]
    if len(states) != processes and any("group" in s for s in states):
        raise ValueError(
            f"cannot resume the PackedStreamLoader mid-epoch {saved['epoch']}: the"
            f" checkpoint was saved by {len(states)} process(es) and this run has"
            f" {processes}; a streamed source is sharded by rank and worker, so the"
            " remaining records of the epoch cannot be found on other shards. Resume with"
            " the same ranks and num_workers, or from a checkpoint saved at an epoch's end"
            " (any number)"
        )
    return dict(states[min(process, len(states) - 1)])


_MAX_SHARES = 8  # a rank reads ahead at most this many global batches' shares (memory)


@dataclass
class _Share:
    """This rank's part of one agreed global batch (:meth:`_Agreement.settle`)."""

    used: list[int]  # packs each data-parallel rank's hand gives (kept and lent)
    moves: list[tuple[int, int, int]]  # (source rank, index in its hand, destination rank)
    kept: list[dict[str, Any]]  # this rank's own packs it trains
    lent: list[dict[str, Any]]  # this rank's packs a peer trains
    own: int  # len(kept)
    length: int  # micro-steps of the global batch on every rank (padding included)


class _Agreement:
    """The ranks' agreement on each global batch of a stream: every rank reads packs ahead into
    its *hand* (each with the merge's state before it was read: a checkpoint resumes the streams
    there), and one all-gather per global batch (issued a global batch ahead, so it runs while
    the previous one trains) tells every rank each rank's packs in hand, whether it read any,
    whether its streams ended, and each pack's features.

    Until every rank's streams have ended, a global batch is ``G`` micro-steps on every rank
    (Lightning steps the optimizer every ``G``): packs lent by ranks with more (the tail plan),
    then padding. Tensor-parallel peers (``copies``) read the same packs: they pad, they never
    lend."""

    def __init__(
        self, merged: _RoundRobin, state: dict[str, Any], G: int, size: int, rank: int,
        copies: int, group: Any,
    ) -> None:  # fmt: skip
        self.merged, self.G, self.size, self.rank = merged, G, size, rank
        self.copies, self.group = copies, group
        self.lend = copies == 1
        self.hand: deque[tuple[dict[str, Any], dict[str, Any]]] = deque()
        self.position = int(state["position"])  # epoch position of the next global batch
        # packs a rank reads ahead for the next global batch: every rank computes it from the
        # same agreement (the width of the next one), a resume from its checkpoint
        self.ahead = int(state.get("hand", hand_size(G, size, 0, self.lend)))

    def take(self) -> tuple[dict[str, Any], Any, torch.Tensor]:
        """Reads the hand full and starts the next global batch's all-gather: ``(the state that
        resumes at that global batch, the pending work or None, the gathered tensor)``."""
        ended = False
        while len(self.hand) < self.ahead:
            before = self.merged.snapshot()
            pack = next(self.merged, None)
            if pack is None:
                ended = True
                break
            self.hand.append((pack, before))
        snapshot = self.hand[0][1] if self.hand else self.merged.snapshot()
        snapshot = {**snapshot, "position": self.position, "hand": self.ahead}
        self.position += self.G
        # gathered per rank: packs in hand, any read, streams ended, each pack's features
        # (the global batch's table: the loss tokens, and what a rebalancing plans from)
        width = 3 + self.ahead * len(COLUMNS)
        local = torch.zeros(width, dtype=torch.int64)
        local[0], local[1], local[2] = len(self.hand), int(self.merged.any_read), int(ended)
        if self.hand:
            rows = torch.tensor([pack_features(p) for p, _ in self.hand], dtype=torch.int64)
            local[3 : 3 + rows.numel()] = rows.flatten()
        if self.group is None:
            return snapshot, None, local
        gathered = torch.zeros(self.size * self.copies * width, dtype=torch.int64)
        work = dist.all_gather_into_tensor(gathered, local, group=self.group, async_op=True)
        return snapshot, work, gathered

    def wait(self, taken: tuple[dict[str, Any], Any, torch.Tensor]) -> tuple[dict, torch.Tensor]:
        """The state and the agreed table (one row per process) of a :meth:`take`."""
        snapshot, work, gathered = taken
        if work is not None:
            try:
                work.wait()
            except RuntimeError as err:
                raise RuntimeError(
                    f"PackedStreamLoader: rank {self.rank} could not agree on the next global"
                    f" batch with its peers (a peer stopped or failed?): {err}"
                ) from err
        return snapshot, gathered.view(self.size * self.copies, -1)

    @staticmethod
    def any_pack(table: torch.Tensor) -> bool:
        return int(table[:, 0].sum()) > 0

    def in_hand(self) -> list[dict[str, Any]]:
        return [pack for pack, _ in self.hand]

    def settle(self, table: torch.Tensor) -> _Share:
        """The global batch the table agrees on: which packs of each hand it trains and which
        change rank; this rank's packs leave its hand."""
        G, counts = self.G, table[:, 0].tolist()
        final = bool(table[:, 2].min())
        if self.lend:
            used, moves = tail_plan(counts, G, final=final)
        else:  # one count per data-parallel rank (its tensor-parallel peers read the same)
            used, moves = [min(c, G) for c in counts[:: self.copies]], []
        ended = int(table[:, 2].sum()) // self.copies
        self.ahead = hand_size(G, self.size, ended, self.lend)
        # this rank's packs of the global batch: its own first, then those its peers hand it
        mine = [self.hand.popleft()[0] for _ in range(used[self.rank])]
        own = used[self.rank] - sum(1 for src, _, _ in moves if src == self.rank)
        # a stream that ended on every rank ends with a shorter last step, as Lightning's
        length = max(trained_counts(used, moves)) if final else G
        return _Share(used, moves, mine[:own], mine[own:], own, length)


def hand_size(G: int, ranks: int, ended: int, lend: bool = True) -> int:
    """Packs a rank reads ahead for a global batch of ``G`` micro-steps when ``ended`` of the
    ``ranks`` ranks' streams have ended: its own share and one share to lend, or one share for
    each rank that ended (up to every rank's, and at most :data:`_MAX_SHARES` shares), so the
    last ranks with data fill every rank's micro-steps; ``G`` alone where packs are not lent."""
    if not lend or ranks < 2:
        return G
    return G * min(ranks, _MAX_SHARES, 1 + max(1, ended))


def tail_plan(
    counts: list[int], G: int, *, final: bool = True
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Which packs of each rank's hand a global batch trains, and which change rank.

    ``counts[r]``: the packs rank ``r`` holds (its next share of ``G``, and what it can lend:
    :func:`hand_size`). The global batch gives every rank ``m`` packs where it can: each rank
    trains its own first ``min(counts[r], m)``, and where a rank has fewer (its streams ended),
    ranks with more hand over their next packs, in rank order. ``m = G`` until the ``final``
    global batch (every rank's streams ended: the hands are all that is left), which is as short
    as the packs left allow, ``min(G, ceil(sum(counts) / ranks))``; a rank still short of ``m``
    pads (every global batch but the last is one whole optimizer step of ``G`` micro-steps).
    Returns ``used[r]`` (packs taken from the front of rank ``r``'s hand) and the moves
    ``(source rank, index in its hand, destination rank)``. Every rank computes the same plan
    from the same counts.
    """
    m = min(G, -(-sum(counts) // max(1, len(counts)))) if final else G
    keep = [min(c, m) for c in counts]
    used = list(keep)
    lenders = [(r, k) for r, c in enumerate(counts) for k in range(m, c)]
    moves: list[tuple[int, int, int]] = []
    for dst, k in enumerate(keep):
        for _ in range(m - k):
            if not lenders:
                return used, moves
            src, index = lenders.pop(0)
            moves.append((src, index, dst))
            used[src] += 1
    return used, moves


def _step_features(
    table: torch.Tensor,
    used: list[int],
    moves: list[tuple[int, int, int]],
    copies: int,
    length: int,
    padding: list[int],
) -> np.ndarray:
    """The global batch's feature table from the agreement's (``table``: per process, 3 counts
    then each pack in hand's :data:`~lightning_vlmbalance.loaders.global_batch.COLUMNS`): every
    data-parallel rank's trained packs in the order it trains them (its own, then those lent to
    it, in ``moves`` order, then padding to ``length``), rank by rank."""
    hands = table[:, 3:].reshape(table.shape[0], -1, len(COLUMNS))[::copies].numpy()
    rows: list[Any] = []
    for r in range(len(hands)):
        own = used[r] - sum(1 for src, _, _ in moves if src == r)
        mine = [hands[r, k] for k in range(own)]
        mine += [hands[src, k] for src, k, dst in moves if dst == r]
        rows += mine + [padding] * (length - len(mine))
    return np.asarray(rows, dtype=np.int64).reshape(len(hands) * length, len(COLUMNS))


def trained_counts(used: list[int], moves: list[tuple[int, int, int]]) -> list[int]:
    """Packs each rank trains in a global batch of :func:`tail_plan`'s ``(used, moves)``: the
    packs it used of its hand, less those it lent, plus those lent to it."""
    trained = list(used)
    for src, _, dst in moves:
        trained[src] -= 1
        trained[dst] += 1
    return trained


def sample_tokens(record: Any) -> int:
    """Default ``lengths``: a sample dict's tokens (its ``input_ids``)."""
    return PackCollator.sample_lengths(record, -1)[0]


class _RoundRobin:
    """The workers' packs in a fixed order: stream ``cursor``, then the next, round and round,
    skipping streams that ended. The ``DataLoader`` delivers its workers round-robin from
    worker 0 on every pass; a resumed pass starts elsewhere, so items are held until their turn
    (at most about one per stream)."""

    def __init__(self, items: Iterator[dict[str, Any]], state: dict[str, Any], streams: int):
        self.items = items
        self.streams = streams
        self.cursor = int(state["cursor"])
        self.any_read = bool(state.get("any_read"))
        self.per_stream: dict[int, dict[str, Any]] = {
            int(s): dict(v) for s, v in state["streams"].items()
        }
        for s in range(streams):
            self.per_stream.setdefault(s, {"anchor": None, "taken": 0, "ended": False})
        self.held: dict[int, deque[dict[str, Any]]] = {s: deque() for s in range(streams)}
        self.leftover_bad: list[dict[str, Any]] = []

    def snapshot(self) -> dict[str, Any]:
        """The merge's state (the caller adds the epoch position): the cursor, and the streams
        that have handed out a pack or ended."""
        streams = {
            s: dict(v) for s, v in self.per_stream.items() if v["anchor"] is not None or v["ended"]
        }
        return {"cursor": self.cursor, "any_read": self.any_read, "streams": streams}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        while not all(v["ended"] for v in self.per_stream.values()):
            s = self.cursor
            if self.per_stream[s]["ended"]:
                self.cursor = (s + 1) % self.streams
                continue
            while not self.held[s]:
                item = next(self.items, None)
                if item is None:  # the DataLoader ended: every worker sent its end marker
                    raise RuntimeError(
                        f"PackedStreamLoader: stream {s} ended without its end marker"
                    )
                owner = int(item[_END]) if _END in item else int(item["meta"]["stream"])
                self.held[owner].append(item)
            item = self.held[s].popleft()
            self.cursor = (s + 1) % self.streams
            if _END in item:
                self.per_stream[s]["ended"] = True
                self.leftover_bad.extend(item["bad_samples"])
                continue
            meta = item["meta"]
            self.any_read = True
            if self.leftover_bad:  # reported with the next pack handed out
                meta["bad_samples"] = self.leftover_bad + meta["bad_samples"]
                self.leftover_bad = []
            self.per_stream[s].update(anchor=meta.pop("anchor"), taken=meta["stream_pack"] + 1)
            return item
        raise StopIteration
