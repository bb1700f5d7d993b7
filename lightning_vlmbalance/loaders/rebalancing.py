"""``RebalancingLoader``: yields each global batch's packs in the planned (rank, micro-step) order.

Wraps this rank's loader of packed batches (e.g. a ``PackedDataLoader``; every rank yields the
same number of batches). Per global batch of ``micro_steps`` batches it:

1. reads the batches' cost features from ``meta`` (a few integers per pack, no device sync) and
   all-gathers them on ``group`` (a dedicated process group);
2. plans with :func:`~lightning_vlmbalance.balance.planner.plan_rebalance` (every rank computes
   the same plan from the same integers);
3. exchanges only the packs that move
   (:func:`~lightning_vlmbalance.balance.exchange.exchange_packs`);
4. yields the batches rank ``r`` computes, micro-step by micro-step, each with
   ``global_loss_tokens`` (the loss tokens of the whole global batch, all ranks) and
   ``loss_weight`` set (:mod:`lightning_vlmbalance.loss`), so ``token_loss_sum * loss_weight``
   gives the gradient of the global batch's token-mean loss whatever the placement.

Modes: ``"sync"`` does 1-3 when the global batch is needed; ``"overlap"`` does them in a
background thread one global batch ahead, so the exchange hides behind compute; ``"auto"`` (the
default) does in that thread whichever option the cost model predicts fastest for the global
batch (as placed, packs moved, or with ``encoder=True`` images routed;
:mod:`~lightning_vlmbalance.balance.choice`); ``"off"`` yields
the batches unchanged but still sets ``loss_weight`` (same math as the other modes). The
thread is joined when the iteration ends, is closed, or fails; a failure in it is raised in the
consumer as :class:`~lightning_vlmbalance.balance.exchange.ExchangeError` (or the original error),
never a hang: the consumer waits at most ``exchange_timeout_s`` for a global batch, and the
collectives wait as long as ``group``'s own timeout. The strategies create their group with
``exchange_timeout_s`` as its timeout; a ``group`` you create yourself (or ``None``, the world
group) has the timeout it was created with (torch's default for gloo: 30 minutes).

The last global batch of an epoch may be shorter (where ``epoch_batches`` ends it, known to all
ranks without a collective): it is rebalanced over its own micro-steps, matching Lightning's
optimizer step at the end of an epoch, and its weight counts only its own tokens.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance._moved import DP_RANKS, renamed_keyword
from lightning_vlmbalance.balance.choice import StepScale
from lightning_vlmbalance.balance.config import MODES, RebalanceConfig
from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.encoder import ReturnChannel
from lightning_vlmbalance.balance.exchange import ExchangeError, wait_pack_ready
from lightning_vlmbalance.balance.model_schedule import ModelSchedule
from lightning_vlmbalance.loaders.global_batch import (
    GlobalBatchFormer,
    cut_steps,
    image_payload_fields,
    pack_features,
)
from lightning_vlmbalance.loss import optimizer_steps

__all__ = ["MODES", "RebalancingLoader", "ResumablePackSource", "image_payload_fields"]

_batch_features = pack_features  # its name before the global-batch former

log = logging.getLogger(__name__)

_END = object()
_STATS_KEPT = 1000
_THREADED = ("overlap", "auto")  # the modes that form global batches in a background thread
EXCHANGE_THREAD = "vlmbalance-exchange"


@runtime_checkable
class ResumablePackSource(Protocol):
    """What a :class:`RebalancingLoader` needs of the loader it wraps to be resumable itself
    (:class:`~lightning_vlmbalance.PackedDataLoader` and
    :class:`~lightning_vlmbalance.PackedStreamLoader` are).

    ``start`` is the position (in the pass's epoch or stream) where the pass resumed, read after
    its first batch was fetched; ``state_at(position)`` is the checkpoint state that resumes at
    ``position`` of the pass in progress (inside an optimizer step too: the loader's
    ``global_batches()`` then starts at the step's first batch and says how many of them were
    trained); ``state_dict`` / ``load_state_dict`` as for Lightning. A loader without them
    makes the wrapper not resumable (Lightning then warns on a mid-epoch resume): the wrapper
    reads ahead, so the inner loader's own position would skip packs.
    """

    @property
    def start(self) -> int: ...

    def state_at(self, position: int) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pass:
    """One overlapped pass: its producer thread, one-slot queue, permits and stop flag.

    The producer prepares global batch ``k + 1`` only once the consumer has taken batch ``k``
    (a permit per batch taken). So when training stops early (``max_steps``), every rank has
    taken the same number of global batches and its producer is in, or done with, the same next
    one: no rank is left in a collective its peers never enter.
    """

    def __init__(self, owner: RebalancingLoader, batches: Iterator[tuple[list, Any, int]]) -> None:
        self.num_threads = torch.get_num_threads()  # the training process's setting
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.permits = threading.Semaphore(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._produce, args=(owner, batches), name=EXCHANGE_THREAD, daemon=True
        )
        self.thread.start()

    def _produce(self, owner: RebalancingLoader, batches: Iterator[tuple[list, Any, int]]) -> None:
        # torch's thread count is each OS thread's own OpenMP setting: without this, this
        # thread's operators would run on as many threads as the machine has cores, whatever
        # the training process set
        torch.set_num_threads(self.num_threads)
        try:
            while self._permit():
                step = next(batches, None)
                if step is None:
                    self._put(_END)
                    return
                packs, features, lead = step
                if not self._put((*owner._rebalance(packs, features), lead)):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            self._put(_Failure(err))

    def _permit(self) -> bool:
        while True:
            if self.permits.acquire(blocking=False):  # a permit given before a stop counts
                return True
            if self.stop.is_set():
                return False
            if self.permits.acquire(timeout=0.1):
                return True

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def taken(
        self, timeout_s: float, rank: int
    ) -> Iterator[tuple[list[Any], dict[str, float], int]]:
        """The prepared global batches in order, each ``(packs, statistics, lead)`` with the
        time the consumer waited for it (``exposed_exchange_ms``); a failure of the producer is
        raised here, in the consumer's thread."""
        while True:
            start = time.perf_counter()
            try:
                item = self.ready.get(timeout=timeout_s)
            except queue.Empty:
                raise ExchangeError(
                    f"no rebalanced global batch within exchange_timeout_s={timeout_s:g}"
                    f" (rank {rank})"
                ) from None
            waited_ms = (time.perf_counter() - start) * 1e3
            self.permits.release()  # taken: the producer may prepare the next one
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            ready, stats, lead = item
            stats["exposed_exchange_ms"] = waited_ms
            yield ready, stats, lead

    def shutdown(self, timeout_s: float) -> None:
        self.stop.set()
        while True:  # unblock a producer waiting to put
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        if self.thread.is_alive():
            self.thread.join(timeout=timeout_s + 5.0)
        if self.thread.is_alive():  # pragma: no cover - only if a collective ignores its deadline
            log.warning("the vlmbalance exchange thread did not stop; it is a daemon thread")


class _LooksLikeItsLoader:
    """What Lightning reads of a training loader, forwarded to the wrapped ``loader``: its
    length; ``sampler`` / ``batch_sampler`` (``_set_sampler_epoch`` calls their
    ``set_epoch``); ``dataset`` (``has_iterable_dataset``); ``worker_init_fn``
    (``seed_everything(workers=True)`` sets it); ``_iterator`` (teardown shuts down its
    workers). Nothing else is forwarded."""

    loader: Any

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def _iterator(self) -> Any:
        return getattr(self.loader, "_iterator", None)

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        if hasattr(self.loader, "_iterator"):
            self.loader._iterator = value

    @property
    def worker_init_fn(self) -> Any:
        """The inner loader's (Lightning sets it for ``seed_everything(workers=True)``: the
        workers that run are the inner loader's)."""
        return self.loader.worker_init_fn  # type: ignore[attr-defined]

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Any) -> None:
        self.loader.worker_init_fn = fn  # type: ignore[attr-defined]


class RebalancingLoader(_LooksLikeItsLoader):
    """Yields the packs of each global batch in planned order (see the module docstring).

    Args:
        loader: this rank's iterable of packed batches, with ``len``.
        micro_steps: micro-batches per rank per global batch (the fit's ``StepSpec.micro_steps``).
        num_replicas: the data-parallel ranks (in ``group``); ``rank``: this rank among them.
            (``world_size=``: deprecated, still works.)
        group: process group for the feature gather and the exchange (``None``: the world).
        cost_model: pack cost model (default :class:`CostModel`), when no ``models`` are given.
        models: the fit's :class:`~lightning_vlmbalance.balance.model_schedule.ModelSchedule`
            (the strategy's: which cost model plans the global batch of each optimizer step).
        first_step: the optimizer step that trains this loader's first global batch.
        config: mode, objective, tolerance, exchange timeout
            (:class:`~lightning_vlmbalance.balance.config.RebalanceConfig`; ``objective="auto"``
            means ``"microstep"`` here: the loader cannot know how often the ranks meet).
        **options: the same as keyword arguments instead of ``config`` (``mode="sync"``, ...).
        payload_group: group for the pack payloads (default ``group``); on GPUs an NCCL group.
        device: where received payloads land (default the CPU); with a CUDA device the exchange
            runs on a side stream, and when a received pack is handed out the consumer's
            current stream waits for that pack's event only.
        epoch_batches: returns how many batches the training loop takes this epoch (Lightning's
            ``trainer.num_training_batches``: ``len`` cut by ``limit_train_batches`` and
            ``fast_dev_run``); the last optimizer step ends there. Default: every batch.
        group_ranks: the global rank of each rank of ``group`` when it is not the world (the
            data-parallel peers of one tensor-parallel rank); default: ranks are global.
        epoch_position: returns the position in the epoch of the first batch of a pass (the
            training loop's batch index when it fetches it: ``> 0`` after a mid-epoch resume,
            also when the inner loader cannot resume and starts again from its first batch);
            the optimizer steps are grouped from there. Default: the inner loader's ``start``
            (0 if it has none).
        encoder_group: with ``encoder=True``, the process group the image embeddings return on
            in the training step (:func:`~lightning_vlmbalance.balance.encoder.encode_images`);
            a group of its own in ``"overlap"`` mode, where this loader's thread runs
            collectives on ``group`` meanwhile. Default: the world group.
        returns: the :class:`~lightning_vlmbalance.balance.encoder.ReturnChannel` the routes
            carry (the strategy's: its group, its step timers, its micro-batch's returns);
            default one on ``encoder_group``.
        meets_every_micro_batch, scale: ``mode="auto"``'s pricing (see
            :class:`~lightning_vlmbalance.loaders.global_batch.GlobalBatchFormer`).

    The loader is resumable (``state_dict`` / ``load_state_dict``, which Lightning checkpoints)
    exactly when the inner loader is a :class:`ResumablePackSource` (it must say where its pass
    started and what state resumes at a position, since this loader reads ahead); otherwise
    Lightning warns on a mid-epoch resume.

    Raises:
        ValueError: for a bad setting (naming it).
    """

    @renamed_keyword(*DP_RANKS)
    def __init__(
        self,
        loader: Iterable[Any],
        *,
        micro_steps: int,
        num_replicas: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        cost_model: CostModel | None = None,
        config: RebalanceConfig | None = None,
        models: ModelSchedule | None = None,
        first_step: int = 0,
        payload_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        epoch_batches: Callable[[], float] | None = None,
        group_ranks: Sequence[int] | None = None,
        epoch_position: Callable[[], int] | None = None,
        encoder_group: dist.ProcessGroup | None = None,
        returns: ReturnChannel | None = None,
        meets_every_micro_batch: bool | None = None,
        scale: StepScale | None = None,
        **options: Any,
    ) -> None:
        if micro_steps < 1:
            raise ValueError(f"`RebalancingLoader(micro_steps={micro_steps!r})` must be >= 1")
        if config is not None and options:
            raise ValueError(f"`RebalancingLoader(config=..., {', '.join(options)}=...)`: not both")
        config = config if config is not None else RebalanceConfig(**options)
        self.config = config.resolved(sync_every_micro_batch=True)
        self.loader = loader
        self.micro_steps = micro_steps
        self.num_replicas = num_replicas
        self.rank = rank
        self.group = group
        if group_ranks is not None and len(group_ranks) != num_replicas:
            raise ValueError(
                f"`RebalancingLoader(group_ranks={list(group_ranks)})` must name"
                f" {num_replicas} ranks"
            )
        if models is not None and cost_model is not None:
            raise ValueError("`RebalancingLoader(cost_model=..., models=...)`: not both")
        if self.config.encoder and self.config.mode in _THREADED and num_replicas > 1:
            if encoder_group is None and (returns is None or returns.group is None):
                raise ValueError(
                    f"`RebalancingLoader(encoder=True, mode={self.config.mode!r})` needs an"
                    " `encoder_group`"
                    " of its own when num_replicas > 1: the embeddings return in the training"
                    " step while this loader's thread runs collectives on `group`"
                )
        # forms every global batch: gathers, plans, exchanges, routes images, weighs; reads the
        # cost model planning each one from the fit's schedule
        self.former = GlobalBatchFormer(
            micro_steps=micro_steps,
            num_replicas=num_replicas,
            rank=rank,
            group=group,
            config=self.config,
            models=models if models is not None else ModelSchedule(cost_model),
            first_step=first_step,
            payload_group=payload_group,
            device=device,
            group_ranks=group_ranks,
            encoder_group=encoder_group,
            returns=returns,
            meets_every_micro_batch=meets_every_micro_batch,
            scale=scale,
        )
        self.epoch_batches = epoch_batches
        self.epoch_position = epoch_position
        # the last global batches' statistics (bounded: a long run must not grow), and counters
        self.stats: deque[dict[str, float]] = deque(maxlen=_STATS_KEPT)
        self.global_batches = 0
        self.moved_packs_total = 0
        self.received_bytes_total = 0  # tensor bytes of the packs this rank received
        self.moved_images_total = 0  # images encoded on another rank than their pack's
        self.encoder_bytes_total = 0  # image bytes this rank received to encode
        self._pass: _Pass | None = None  # the overlapped pass in progress
        self._pass_start: int | None = None  # position of the pass's first step in the epoch
        self._yielded = 0  # batches of the pass passed (handed on, or a resumed step's lead)

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def world_size(self) -> int:
        """Deprecated: :attr:`num_replicas` (``world_size`` is every process of the job)."""
        warnings.warn(
            "`RebalancingLoader.world_size` is now `num_replicas` (the data-parallel ranks:"
            " docs/glossary.md)",
            FutureWarning,
            stacklevel=2,
        )
        return self.num_replicas

    @property
    def exchange_timeout_s(self) -> float:
        return self.config.exchange_timeout_s

    def __new__(cls, loader: Iterable[Any], **kwargs: Any) -> RebalancingLoader:
        # resumable exactly when the inner loader is: Lightning decides by the methods' presence
        if cls is RebalancingLoader and isinstance(loader, ResumablePackSource):
            cls = _ResumableRebalancingLoader
        return super().__new__(cls)

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.loader,), {}  # a copy picks its class as the original did

    def __iter__(self) -> Iterator[Any]:
        overlapped = self.mode in _THREADED and self.num_replicas > 1
        return self._count(self._iter_overlapped() if overlapped else self._iter_inline())

    def close(self) -> None:
        """Stops an overlapped pass in progress and joins its thread (the global batch being
        prepared is finished first: every rank is preparing the same one)."""
        current, self._pass = self._pass, None
        if current is not None:
            current.shutdown(self.exchange_timeout_s)
        self.former.ready_events.clear()

    def _count(self, steps: Iterator[tuple[list[Any], int]]) -> Iterator[Any]:
        """The batches of each formed step, less its lead: a resume inside an optimizer step
        forms the step whole again, and this rank's first ``lead`` batches of it were trained
        before the checkpoint."""
        self._pass_start, self._yielded = None, 0
        for ready, lead in steps:
            if self._pass_start is None:  # the inner loader resolves its start at first next()
                self._pass_start = self._inner_start() - lead
            for k, batch in enumerate(ready):
                self._yielded += 1
                event = self.former.ready_events.pop(id(batch), None)
                if k < lead:  # (its event goes too: an id is reused once the batch is freed)
                    continue
                if event is not None:  # received on the GPU: the consumer's stream waits for it
                    wait_pack_ready(batch, event)
                yield batch

    # -- iteration --------------------------------------------------------------------------

    def _global_batches(self) -> Iterator[tuple[list[Any], np.ndarray | None, int]]:
        """The inner loader's optimizer steps, each ``(batches, features, lead)``: the features
        its ranks agreed on (``None``: this loader gathers them) and how many of this rank's
        first batches a resume inside the step trained before; the last one is cut where the
        epoch's training batches end (``epoch_batches``,
        :func:`~lightning_vlmbalance.loaders.global_batch.cut_steps`).

        A packed loader (:class:`~lightning_vlmbalance.PackedDataLoader`,
        :class:`~lightning_vlmbalance.PackedStreamLoader`) hands its steps over
        (``global_batches()``, unweighed; a stream's with the features its ranks agreed on:
        one collective per global batch). Any other loader is grouped here, from the epoch's
        position of its first batch (``epoch_position``)."""
        formed = getattr(self.loader, "global_batches", None)
        if callable(formed):
            steps = (
                ([dict(b) for b in batches], features, lead)
                for batches, features, lead in formed(self.micro_steps)
            )
            start = self.epoch_position if self.epoch_position is not None else self._inner_start
            return cut_steps(
                steps, num_replicas=self.num_replicas, start=start, stop=self.epoch_batches
            )
        groups = optimizer_steps(
            _own_dicts(self.loader),
            micro_steps=self.micro_steps,
            start=self.epoch_position if self.epoch_position is not None else lambda: 0,
            stop=self.epoch_batches,
        )
        return ((group, None, 0) for group in groups)

    def _inner_start(self) -> int:
        """Where the inner loader's pass resumed: a resumable source says, any other loader
        starts every pass at its first batch."""
        return int(self.loader.start) if isinstance(self.loader, ResumablePackSource) else 0

    def _iter_inline(self) -> Iterator[tuple[list[Any], int]]:
        for packs, features, lead in self._global_batches():
            start = time.perf_counter()
            ready, stats = self._rebalance(packs, features)
            stats["exposed_exchange_ms"] = (time.perf_counter() - start) * 1e3
            self._record(stats)
            yield ready, lead

    def _iter_overlapped(self) -> Iterator[tuple[list[Any], int]]:
        if self.group is None:
            raise ValueError(
                "`RebalancingLoader(mode='overlap')` needs its own process `group` when"
                " num_replicas > 1: its thread's collectives must not share the world group with"
                " the training loop"
            )
        # an abandoned earlier pass is stopped (its thread joined) before anything of this one
        # runs: two threads must never run collectives on the group, nor read the inner loader
        self.close()
        batches_iter = self._global_batches()
        # the first global batch is read here, in the caller's thread: the inner loader's own
        # first-pass collectives (e.g. PackedDataLoader's plan check) stay on this thread
        first = next(batches_iter, None)
        if first is None:
            return
        current = _Pass(self, itertools.chain([first], batches_iter))
        self._pass = current
        try:
            for ready, stats, lead in current.taken(self.exchange_timeout_s, self.rank):
                self._record(stats)
                yield ready, lead
        finally:
            current.shutdown(self.exchange_timeout_s)
            if self._pass is current:
                self._pass = None

    def _record(self, stats: dict[str, float]) -> None:
        self.stats.append(stats)
        self.global_batches += 1
        self.moved_packs_total += int(stats.get("moved_packs", 0))
        self.received_bytes_total += int(stats.get("received_bytes", 0))
        self.moved_images_total += int(stats.get("encoder_moved_images", 0))
        self.encoder_bytes_total += int(stats.get("encoder_bytes", 0))

    # -- one global batch: the former's ------------------------------------------------------

    @property
    def cost_model(self) -> CostModel:
        """The newest cost model of the schedule (the one planning the batches formed next)."""
        return self.former.models.latest

    def adopt_cost_model(self, model: CostModel, from_batch: int) -> None:
        """Plans with ``model`` from the ``from_batch``-th global batch this loader forms
        (counted from 0 across passes; its optimizer step in the schedule)."""
        self.former.models.adopt(model, self.former.first_step + int(from_batch))

    @property
    def planned_batches(self) -> int:
        """Global batches formed so far (the index the next one gets)."""
        return self.former.planned_batches

    def _rebalance(
        self, batches: list[Any], features: np.ndarray | None = None
    ) -> tuple[list[Any], dict[str, float]]:
        """One global batch formed: ``features`` as its source agreed on them, or gathered."""
        if features is None:
            features = self.former.gather(batches)
        return self.former.form(batches, features)


class _ResumableRebalancingLoader(RebalancingLoader):
    """A :class:`RebalancingLoader` over a :class:`ResumablePackSource`: Lightning checkpoints
    the inner loader's state at the position *yielded* so far (the inner loader runs ahead by up
    to two global batches in ``"overlap"`` mode, one optimizer step in the others). Checkpoints
    taken at optimizer-step boundaries resume on a global-batch boundary, with the same packs."""

    def state_dict(self) -> dict[str, Any]:
        """The source's state where the training loop stands, and the fit's cost models by
        optimizer step (a resume plans every global batch with the model the uninterrupted
        run would have planned it with)."""
        return {**self._source_state(), _MODELS: self.former.models.state_dict()}

    def _source_state(self) -> dict[str, Any]:
        """The source's state at the training loop's position (its own count: it fetches one
        batch ahead of a loader without a length, a streamed one, which this loader has
        yielded but nobody trained). Inside an optimizer step (a mid-epoch validation, an
        exception) the source resumes at the step's start, the step is formed and weighed whole
        again, and the batches trained before are not handed on (the lead)."""
        source: ResumablePackSource = self.loader  # type: ignore[assignment]
        if self._pass_start is None:
            return source.state_dict()
        if self.epoch_position is not None:
            return source.state_at(int(self.epoch_position()))
        return source.state_at(self._pass_start + self._yielded)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        models = state.pop(_MODELS, None)
        if models is not None:
            self.former.models.load_state_dict(models)
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]


_MODELS = "rebalanced_cost_models"  # the fit's ModelSchedule (a state saved under vlmbalance)


def _own_dicts(batches: Iterable[Any]) -> Iterator[Any]:
    """The inner loader's batches, each dict a shallow copy: the routes, received images and
    loss weights written into it stay with this training step (a loader that yields the same
    dicts again, for another epoch or for validation, gets them back as it made them)."""
    for batch in batches:
        yield dict(batch) if isinstance(batch, dict) else batch
