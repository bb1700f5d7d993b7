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
background thread one global batch ahead, so the exchange hides behind compute; ``"off"`` yields
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.balance.config import MODES, RebalanceConfig
from lightning_vlmbalance.balance.cost import FEATURES, CostModel, features_from_meta
from lightning_vlmbalance.balance.encoder import probe_fields, register_group, route_for
from lightning_vlmbalance.balance.exchange import (
    ExchangeError,
    exchange_packs,
    on_stream,
    wait_pack_ready,
)
from lightning_vlmbalance.balance.planner import plan_rebalance
from lightning_vlmbalance.loss import optimizer_steps, weigh_step
from lightning_vlmbalance.packing.collate import cat_padded

__all__ = ["MODES", "RebalancingLoader", "ResumablePackSource"]

log = logging.getLogger(__name__)

_END = object()
_STATS_KEPT = 1000
EXCHANGE_THREAD = "vlmbalance-exchange"


@runtime_checkable
class ResumablePackSource(Protocol):
    """What a :class:`RebalancingLoader` needs of the loader it wraps to be resumable itself
    (:class:`~lightning_vlmbalance.PackedDataLoader` is one; a streamed source can be).

    ``start`` is the position (in the pass's epoch or stream) of the pass's first batch, read
    after that batch was fetched; ``state_at(position)`` is the checkpoint state that resumes at
    ``position`` of the pass in progress; ``state_dict`` / ``load_state_dict`` as for Lightning.
    A loader without them makes the wrapper not resumable (Lightning then warns on a mid-epoch
    resume): the wrapper reads ahead, so the inner loader's own position would skip packs.
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

    def __init__(self, owner: RebalancingLoader, batches: Iterator[list[Any]]) -> None:
        self.num_threads = torch.get_num_threads()  # the training process's setting
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.permits = threading.Semaphore(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._produce, args=(owner, batches), name=EXCHANGE_THREAD, daemon=True
        )
        self.thread.start()

    def _produce(self, owner: RebalancingLoader, batches: Iterator[list[Any]]) -> None:
        # torch's thread count is each OS thread's own OpenMP setting: without this, this
        # thread's operators would run on as many threads as the machine has cores, whatever
        # the training process set
        torch.set_num_threads(self.num_threads)
        try:
            while self._permit():
                group = next(batches, None)
                if group is None:
                    self._put(_END)
                    return
                if not self._put(owner._rebalance(group)):
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


def _batch_features(batch: Any) -> list[int]:
    """The integers the planner needs from one packed batch: the cost features (in
    :data:`~lightning_vlmbalance.balance.cost.FEATURES` order), then the loss tokens.

    Raises:
        ValueError: if the batch is not a ``PackedBatch``-like dict with ``meta`` and
            ``loss_tokens``, or ``meta`` lacks a feature's key; names what is missing.
    """
    if not isinstance(batch, dict) or "meta" not in batch or "loss_tokens" not in batch:
        have = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(
            "rebalancing needs packed batches (a dict with 'meta' and 'loss_tokens', as"
            f" PackCollator builds them); got {have}"
        )
    features = features_from_meta(batch["meta"])
    return [features[name] for name in FEATURES] + [int(batch["loss_tokens"])]


class RebalancingLoader:
    """Yields the packs of each global batch in planned order (see the module docstring).

    Args:
        loader: this rank's iterable of packed batches, with ``len``.
        micro_steps: micro-batches per rank per global batch (the fit's ``StepSpec.micro_steps``).
        world_size: ranks in ``group``; ``rank``: this rank in it.
        group: process group for the feature gather and the exchange (``None``: the world).
        cost_model: pack cost model (default :class:`CostModel`).
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

    The loader is resumable (``state_dict`` / ``load_state_dict``, which Lightning checkpoints)
    exactly when the inner loader is a :class:`ResumablePackSource` (it must say where its pass
    started and what state resumes at a position, since this loader reads ahead); otherwise
    Lightning warns on a mid-epoch resume.

    Raises:
        ValueError: for a bad setting (naming it).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        micro_steps: int,
        world_size: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        cost_model: CostModel | None = None,
        config: RebalanceConfig | None = None,
        payload_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        epoch_batches: Callable[[], float] | None = None,
        group_ranks: Sequence[int] | None = None,
        epoch_position: Callable[[], int] | None = None,
        encoder_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        if micro_steps < 1:
            raise ValueError(f"`RebalancingLoader(micro_steps={micro_steps!r})` must be >= 1")
        if config is not None and options:
            raise ValueError(f"`RebalancingLoader(config=..., {', '.join(options)}=...)`: not both")
        config = config if config is not None else RebalanceConfig(**options)
        self.config = config.resolved(sync_every_micro_batch=True)
        self.loader = loader
        weighed_by = getattr(loader, "weighed_by", None)
        if callable(weighed_by):  # a loader of this package that weighs steps itself otherwise
            weighed_by(self)  # this loader weighs every step: the inner one must not
        self.micro_steps = micro_steps
        self.world_size = world_size
        self.rank = rank
        self.group = group
        # the global rank of each rank of ``group`` (a data-parallel group smaller than the world)
        self.group_ranks = list(group_ranks) if group_ranks is not None else None
        if self.group_ranks is not None and len(self.group_ranks) != world_size:
            raise ValueError(
                f"`RebalancingLoader(group_ranks={self.group_ranks})` must name {world_size} ranks"
            )
        self.cost_model = cost_model or CostModel()
        self.payload_group = payload_group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.epoch_batches = epoch_batches
        self.epoch_position = epoch_position
        self._stream: Any = None  # the side CUDA stream of the exchange (created on first use)
        self._ready_events: dict[int, Any] = {}  # id(batch) -> CUDA event, until it is used
        # the last global batches' statistics (bounded: a long run must not grow), and counters
        self.stats: deque[dict[str, float]] = deque(maxlen=_STATS_KEPT)
        self.global_batches = 0
        self.moved_packs_total = 0
        self.received_bytes_total = 0  # tensor bytes of the packs this rank received
        self.moved_images_total = 0  # images encoded on another rank than their pack's
        self.encoder_bytes_total = 0  # image bytes this rank received to encode
        # online calibration: the model to plan with from an agreed global batch on
        self._model_lock = threading.Lock()
        self._next_model: tuple[CostModel, int] | None = None
        self._planned = 0  # global batches planned so far, every pass
        self._encoder_group_name = f"rebalancing-loader-{id(self)}"
        if self.config.encoder:
            if self.config.mode == "overlap" and world_size > 1 and encoder_group is None:
                raise ValueError(
                    "`RebalancingLoader(encoder=True, mode='overlap')` needs an `encoder_group`"
                    " of its own when world_size > 1: the embeddings return in the training"
                    " step while this loader's thread runs collectives on `group`"
                )
            register_group(self._encoder_group_name, encoder_group)
        self._pass: _Pass | None = None  # the overlapped pass in progress
        self._pass_start: int | None = None  # inner position where this pass started
        self._yielded = 0
        # a resume inside an optimizer step: the inner loader starts at the step's first batch,
        # the step is formed whole again, and this rank's first `_lead` batches of it (trained
        # before the checkpoint) are not handed on
        self._lead = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def mode(self) -> str:
        return self.config.mode

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

    # -- what Lightning reads of a training loader: the inner loader's -----------------------
    # (``_set_sampler_epoch`` calls ``sampler`` / ``batch_sampler``'s ``set_epoch``;
    # ``has_iterable_dataset`` reads ``dataset``; ``seed_everything(workers=True)`` sets
    # ``worker_init_fn``; teardown shuts down the workers of ``_iterator``.) Nothing else is
    # forwarded.

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

    def __iter__(self) -> Iterator[Any]:
        overlapped = self.mode == "overlap" and self.world_size > 1
        return self._count(self._iter_overlapped() if overlapped else self._iter_inline())

    def close(self) -> None:
        """Stops an overlapped pass in progress and joins its thread (the global batch being
        prepared is finished first: every rank is preparing the same one)."""
        current, self._pass = self._pass, None
        if current is not None:
            current.shutdown(self.exchange_timeout_s)
        self._ready_events.clear()

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        self._pass_start, self._yielded = None, 0
        for batch in batches:
            if self._pass_start is None:  # the inner loader resolves its start at first next()
                self._pass_start = self._inner_start()
            if self._lead:  # trained before the checkpoint this pass resumes from
                self._lead -= 1
                self._pass_start += 1
                continue
            self._yielded += 1
            event = self._ready_events.pop(id(batch), None)
            if event is not None:  # received on the GPU: the consumer's stream waits for it
                wait_pack_ready(batch, event)
            yield batch

    # -- iteration --------------------------------------------------------------------------

    def _global_batches(self) -> Iterator[list[Any]]:
        """The inner batches, one optimizer step at a time, aligned to the epoch: after a resume
        at position ``p`` the first group is ``G - p % G`` batches; the last one is cut where the
        epoch's training batches end (``epoch_batches``)."""
        return optimizer_steps(
            _own_dicts(self.loader),
            micro_steps=self.micro_steps,
            start=self._step_start if self.epoch_position is not None else self._inner_start,
            stop=self.epoch_batches,
        )

    def _step_start(self) -> int:
        """The training loop's position, less the batches of a resumed step trained before."""
        return int(self.epoch_position()) - self._lead  # type: ignore[misc]

    def _inner_start(self) -> int:
        """Where the inner loader's pass started: a resumable source says, any other loader
        starts every pass at its first batch."""
        return int(self.loader.start) if isinstance(self.loader, ResumablePackSource) else 0

    def _iter_inline(self) -> Iterator[Any]:
        for batches in self._global_batches():
            start = time.perf_counter()
            ready, stats = self._rebalance(batches)
            stats["exposed_exchange_ms"] = (time.perf_counter() - start) * 1e3
            self._record(stats)
            yield from ready

    def _iter_overlapped(self) -> Iterator[Any]:
        if self.group is None:
            raise ValueError(
                "`RebalancingLoader(mode='overlap')` needs its own process `group` when"
                " world_size > 1: its thread's collectives must not share the world group with"
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
            while True:
                start = time.perf_counter()
                try:
                    item = current.ready.get(timeout=self.exchange_timeout_s)
                except queue.Empty:
                    raise ExchangeError(
                        f"no rebalanced global batch within exchange_timeout_s="
                        f"{self.exchange_timeout_s:g} (rank {self.rank})"
                    ) from None
                waited_ms = (time.perf_counter() - start) * 1e3
                current.permits.release()  # taken: the producer may prepare the next one
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                ready, stats = item
                stats["exposed_exchange_ms"] = waited_ms
                self._record(stats)
                yield from ready
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

    # -- one global batch -------------------------------------------------------------------

    def adopt_cost_model(self, model: CostModel, from_batch: int) -> None:
        """Plans with ``model`` from the ``from_batch``-th global batch this loader plans on
        (counted from 0, across passes). Every rank plans the same sequence of global batches,
        so ranks given the same ``from_batch`` switch at the same one, whichever thread plans
        it and however far ahead."""
        with self._model_lock:
            self._next_model = (model, int(from_batch))

    def _model_for_next_batch(self) -> CostModel:
        with self._model_lock:
            index, self._planned = self._planned, self._planned + 1
            if self._next_model is not None and index >= self._next_model[1]:
                self.cost_model, self._next_model = self._next_model[0], None
            return self.cost_model

    @property
    def planned_batches(self) -> int:
        """Global batches planned so far (the index the next one gets)."""
        return self._planned

    def _rebalance(self, batches: list[Any]) -> tuple[list[Any], dict[str, float]]:
        G, W, r = len(batches), self.world_size, self.rank
        cost_model = self._model_for_next_batch()
        local = torch.tensor([_batch_features(b) for b in batches], dtype=torch.int64)  # (G, F)
        if W > 1:
            gathered = [torch.empty_like(local) for _ in range(W)]
            try:
                dist.all_gather(gathered, local, group=self.group)
            except RuntimeError as err:  # a dead or stuck peer (the group has the deadline)
                raise ExchangeError(
                    f"rank {r}: gathering the pack features of a global batch failed (a peer"
                    f" died or stopped?): {err}"
                ) from err
            features = torch.stack(gathered).reshape(W * G, -1).numpy()
        else:
            features = local.numpy()
        global_tokens = int(features[:, -1].sum())
        stats: dict[str, float] = {"moved_packs": 0.0, "exchange_ms": 0.0}
        if self.config.encoder and W > 1:
            order, more = self._balance_encoder(batches, features, cost_model)
            stats.update(more)
            weigh_step(
                order, global_loss_tokens=global_tokens, ranks=W, micro_steps=self.micro_steps
            )
            return order, stats
        if self.mode == "off" or W == 1:
            order = list(batches)
            plan = None
        else:
            cost = cost_model.pack_cost_us(
                {name: features[:, i] for i, name in enumerate(FEATURES)}
            )
            origin = np.repeat(np.arange(W, dtype=np.int64), G)
            plan = plan_rebalance(
                cost,
                origin,
                W,
                G,
                objective=self.config.objective,
                tolerance=self.config.tolerance,
            )
            mine = {r * G + m: b for m, b in enumerate(batches)}
            events: dict[int, Any] = {}
            self._side_stream()
            start = time.perf_counter()
            moves = [tuple(int(x) for x in mv) for mv in plan.moves]
            received = self._exchange(mine, moves, ready_events=events)
            for p, event in events.items():  # keyed by the batch object the loop will get
                self._ready_events[id(received[p])] = event
            stats["exchange_ms"] = (time.perf_counter() - start) * 1e3
            stats["received_bytes"] = float(sum(_nbytes(pack) for pack in received.values()))
            stats["moved_packs"] = float(plan.moved_packs)
            stats["planned_waste_frac"] = plan.waste_after
            stats["baseline_waste_frac"] = plan.waste_before
            stats["planned_value"] = float(plan.value)  # predicted step cost (cost units)
            stats["baseline_value"] = float(plan.baseline_value)
            order = [
                mine[p] if p in mine else received[p] for p in plan.assignment[r, :, 0].tolist()
            ]
        weigh_step(order, global_loss_tokens=global_tokens, ranks=W, micro_steps=self.micro_steps)
        return order, stats

    def _balance_encoder(
        self, batches: list[Any], features: np.ndarray, cost_model: CostModel
    ) -> tuple[list[Any], dict[str, float]]:
        """Encoder balancing of one global batch (``RebalanceConfig(encoder=True)``): every
        pack stays on its rank; in ``"overlap"`` / ``"sync"`` mode each rank's packs are
        re-ordered over the micro-steps so that every micro-step carries about the same vision
        work (:func:`~lightning_vlmbalance.balance.images.order_micro_steps`); then, micro-step
        by micro-step, the images are planned to ranks, the pixels are sent where they are
        encoded, and each batch is given its ``encoder_route`` and ``encoder_fields`` (see
        :mod:`~lightning_vlmbalance.balance.encoder`). Returns this rank's batches in order and
        the statistics."""
        # numba's import (about 0.1 s) only in the processes that balance images
        from lightning_vlmbalance.balance.images import order_micro_steps, plan_images

        W, G, r = self.world_size, len(batches), self.rank
        start = time.perf_counter()
        sizes = self._gather_image_sizes(batches, features)  # (W * G, K), rows per image
        counts = features[:, FEATURES.index("images")]
        present = np.arange(sizes.shape[1])[None, :] < counts[:, None]
        image_ms, per_call = cost_model.image_cost_ms(sizes)
        image_ms = np.where(present, image_ms, 0.0)
        llm_ms = cost_model.llm_cost_ms({n: features[:, i] for i, n in enumerate(FEATURES)})
        placed = np.arange(W * G, dtype=np.int64).reshape(W, G)  # global pack: rank * G + m
        if self.mode != "off":
            steps = order_micro_steps(image_ms.sum(axis=1)[placed])
            placed = np.take_along_axis(placed, steps, axis=1)
        order = [batches[int(p) - r * G] for p in placed[r]]
        K = sizes.shape[1]
        mine: dict[int, Any] = {}
        moves: list[tuple[int, int, int]] = []
        foreign: list[list[int]] = []  # per micro-step: the keys of the images received
        moved = 0
        spent = ideal = spent_home = 0.0  # the plan's predicted step, as the ranks meet
        for m in range(G):
            packs = placed[:, m]
            home = np.repeat(np.arange(W), counts[packs])
            index = np.concatenate([np.arange(counts[p]) for p in packs]).astype(np.int64)
            rows = np.concatenate([sizes[p, : counts[p]] for p in packs]).astype(np.int64)
            plan = plan_images(np.full(W, per_call), image_ms[packs][present[packs]], home)
            moved += plan.moved_images
            language = llm_ms[packs]
            spent += float(language.max() + plan.load.max())
            spent_home += float(language.max() + plan.load_home.max())
            ideal += float(language.mean() + plan.load.mean())
            own = home == r
            batch = order[m]
            fields = image_payload_fields(batch)
            batch["encoder_route"] = route_for(
                group=self._encoder_group_name,
                rank=r,
                world=W,
                own_sizes=rows[own].tolist(),
                own_encoder=plan.encoder[own].tolist(),
                foreign=[
                    (int(h), int(n))
                    for h, n, e in zip(home, rows, plan.encoder)
                    if e == r and h != r
                ],
                moved_any=bool((plan.encoder != home).any()),
            )
            # what the encoder must still see: preprocessing of the batch is refused there
            batch["encoder_route"].probe = probe_fields(fields)
            keys = []
            for h, i, e in zip(home, index, plan.encoder):
                if e == h:
                    continue
                key = (m * W + int(h)) * K + int(i)
                moves.append((key, int(h), int(e)))
                if h == r:
                    mine[key] = {name: t[a[i] : a[i + 1]] for name, (t, a) in fields.items()}
                elif e == r:
                    keys.append(key)
            foreign.append(keys)
        planned_ms = (time.perf_counter() - start) * 1e3
        events: dict[int, Any] = {}
        stream = self._side_stream()
        received = self._exchange(mine, moves, ready_events=events)
        received_bytes = 0
        for m, keys in enumerate(foreign):
            got = [received[k] for k in keys]
            received_bytes += sum(_nbytes(g) for g in got)
            with on_stream(self.device, stream):
                # on CUDA: the images are joined on the exchange's side stream, after their own
                # transfers, and the micro-step's batch waits for that (its own event)
                if stream is not None:
                    for k in keys:
                        stream.wait_event(events[k])
                fields = _received_fields(got, image_payload_fields(order[m]))
                if stream is not None and keys:
                    self._ready_events[id(order[m])] = stream.record_event()
            order[m]["encoder_fields"], order[m]["encoder_field_rows"] = fields
        return order, {
            "encoder_moved_images": float(moved),
            "encoder_bytes": float(received_bytes),  # this rank's; no collective
            "encoder_received_images": float(sum(len(keys) for keys in foreign)),  # this rank's
            "encoder_plan_ms": planned_ms,
            "exchange_ms": (time.perf_counter() - start) * 1e3 - planned_ms,
            "planned_waste_frac": 1.0 - ideal / spent if spent > 0 else 0.0,
            "baseline_waste_frac": 1.0 - ideal / spent_home if spent_home > 0 else 0.0,
        }

    def _side_stream(self) -> Any:
        """The exchange's side CUDA stream (created on first use), or ``None`` on the CPU."""
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _exchange(
        self,
        payloads: dict[int, Any],
        moves: list[tuple[int, int, int]],
        ready_events: dict[int, Any] | None = None,
    ) -> dict[int, Any]:
        """:func:`exchange_packs` of ``moves`` (ranks of ``group``) on this loader's groups,
        device and stream."""
        g = self.group_ranks
        if g is not None:  # point-to-point messages name global ranks
            moves = [(p, g[src], g[dst]) for p, src, dst in moves]
        return exchange_packs(
            payloads,
            moves,
            rank=self.rank if g is None else g[self.rank],
            group=self.group,
            timeout_s=self.exchange_timeout_s,
            payload_group=self.payload_group,
            device=self.device,
            stream=self._stream,
            ready_events=ready_events,
        )

    def _gather_image_sizes(self, batches: list[Any], features: np.ndarray) -> np.ndarray:
        """Every pack's image sizes (rows per image), ``(W * G, K)`` zero-padded, ``K`` the most
        images in a pack of the global batch (known from the gathered features)."""
        K = max(1, int(features[:, FEATURES.index("images")].max()))
        local = torch.zeros((len(batches), K), dtype=torch.int64)
        for k, b in enumerate(batches):
            sizes = [int(x) for x in b["meta"]["image_sizes"]]
            local[k, : len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, local, group=self.group)
        except RuntimeError as err:
            raise ExchangeError(
                f"rank {self.rank}: gathering the image sizes of a global batch failed (a peer"
                f" died or stopped?): {err}"
            ) from err
        return torch.cat(gathered).numpy()


class _ResumableRebalancingLoader(RebalancingLoader):
    """A :class:`RebalancingLoader` over a :class:`ResumablePackSource`: Lightning checkpoints
    the inner loader's state at the position *yielded* so far (the inner loader runs ahead by up
    to two global batches in ``"overlap"`` mode, one optimizer step in the others). Checkpoints
    taken at optimizer-step boundaries resume on a global-batch boundary, with the same packs."""

    def state_dict(self) -> dict[str, Any]:
        source: ResumablePackSource = self.loader  # type: ignore[assignment]
        if self._pass_start is None:
            return source.state_dict()
        if self.epoch_position is not None:
            # the training loop's own count: it fetches one batch ahead of a loader without a
            # length (a streamed one), which this loader has yielded but nobody trained. Inside
            # an optimizer step (a mid-epoch validation, an exception) the inner loader resumes
            # at the step's start: the global batch is planned and weighed whole again
            position = int(self.epoch_position())
            lead = position % self.micro_steps
            state = source.state_at(position - lead)
            return {**state, _LEAD: lead} if lead else state
        return source.state_at(self._pass_start + self._yielded)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self._lead = int(state.pop(_LEAD, 0))
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]


_LEAD = "rebalanced_step_lead"  # batches of the resumed optimizer step trained before


def _own_dicts(batches: Iterable[Any]) -> Iterator[Any]:
    """The inner loader's batches, each dict a shallow copy: the routes, received images and
    loss weights written into it stay with this training step (a loader that yields the same
    dicts again, for another epoch or for validation, gets them back as it made them)."""
    for batch in batches:
        yield dict(batch) if isinstance(batch, dict) else batch


def image_payload_fields(batch: dict[str, Any]) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """The per-image tensors of a pack that travel with an image encoded on another rank, as
    ``{name: (tensor, starts)}``: image ``i`` is ``tensor[starts[i] : starts[i + 1]]``.

    A pack of pixel rows (``pixel_values`` with ``image_cu_seqlens``) moves those rows. A pack
    whose images are in ``image_fields`` (the Hugging Face families) moves every field, split by
    ``image_field_rows`` (``{name: rows of each image}``, set by the collator that knows the
    layout).

    Raises:
        ValueError: for an image field without its rows per image, named (it would stay with
            the pack while its image is encoded elsewhere), or rows that do not add up.
    """
    fields = batch.get("image_fields") or {}
    if not fields:
        if "pixel_values" not in batch:  # a text-only pack of a layout without pixel rows
            return {}
        pixels = batch["pixel_values"]
        return {"pixel_values": (pixels, np.asarray(batch["image_cu_seqlens"].tolist()))}
    rows = batch.get("image_field_rows") or {}
    unknown = sorted(set(fields) - set(rows))
    if unknown:
        raise ValueError(
            f"encoder balancing moves each image with its per-image fields; the batch has"
            f" image fields {unknown} without their rows per image in `image_field_rows`"
            f" (known: {sorted(rows)}), so it cannot tell which rows belong to which image"
        )
    out = {}
    for name, tensor in fields.items():
        starts = np.concatenate([[0], np.cumsum(np.asarray(rows[name], dtype=np.int64))])
        if starts[-1] != tensor.shape[0]:
            raise ValueError(
                f"image field {name!r} has {tensor.shape[0]} rows but `image_field_rows` gives"
                f" {int(starts[-1])}"
            )
        out[name] = (tensor, starts)
    return out


def _received_fields(
    got: list[dict[str, torch.Tensor]], own: dict[str, tuple[torch.Tensor, np.ndarray]]
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The images received for one micro-step, field by field (``cat_padded``: whole images of
    different tile counts are zero-padded to the largest), with the rows of each."""
    names = list(got[0]) if got else list(own)
    fields = {}
    for name in names:
        if got:
            fields[name] = cat_padded([g[name] for g in got], name)
        else:  # nothing received: an empty field like this rank's own (if it has one)
            t = own[name][0]
            fields[name] = t.new_empty((0, *t.shape[1:]))
    return fields, {name: [int(g[name].shape[0]) for g in got] for name in names}


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a pack (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0
