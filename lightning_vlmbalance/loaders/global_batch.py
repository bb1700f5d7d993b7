"""The global batch: one optimizer step's packs over the data-parallel ranks, formed in one place.

Every loader of this package hands its optimizer steps to a :class:`GlobalBatchFormer`: this
rank's packs of the step and every rank's pack features (one all-gather, or a table the loader
agreed on already), in; this rank's packs of the step in the order it computes them, weighed for
the loss contract (:mod:`lightning_vlmbalance.loss`), out. In between, by the
:class:`~lightning_vlmbalance.balance.config.RebalanceConfig`'s ``mode``:

* ``"off"`` (what the packed loaders do under any strategy): nothing moves; the loss weights;
* ``"sync"`` / ``"overlap"``: the pack planner
  (:func:`~lightning_vlmbalance.balance.planner.plan_rebalance`) places every pack, and only
  the packs that change rank are exchanged
  (:func:`~lightning_vlmbalance.balance.exchange.exchange_packs`);
* ``encoder=True``: every pack stays home, its images are planned over the ranks' vision
  encoders and their pixels sent where they are encoded
  (:mod:`~lightning_vlmbalance.balance.encoder`);
* ``"auto"``: each of the options above (and packs moved, then images routed) is priced with
  the cost model as the ranks will meet, and the cheapest is carried out
  (:func:`~lightning_vlmbalance.balance.choice.choose_step`); its statistics say which
  (``choice``) and the predicted step (``predicted_step_ms``).

Which cost model plans a global batch is read from the fit's
:class:`~lightning_vlmbalance.balance.model_schedule.ModelSchedule` at the optimizer step that
trains it: every rank reads the same model for the same batch, whichever thread forms it and how
far ahead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.balance.choice import (
    OPTIONS,
    PACK_OPTIONS,
    StepInputs,
    StepScale,
    Transfer,
    choice_stats,
    choose_step,
)
from lightning_vlmbalance.balance.config import RebalanceConfig
from lightning_vlmbalance.balance.cost import FEATURES, CostModel, features_from_meta
from lightning_vlmbalance.balance.encoder import ReturnChannel
from lightning_vlmbalance.balance.exchange import ExchangeError, exchange_packs
from lightning_vlmbalance.balance.model_schedule import ModelSchedule
from lightning_vlmbalance.balance.planner import RebalancePlan, plan_rebalance
from lightning_vlmbalance.loaders.image_routes import ImageRoutes, image_payload_fields, nbytes
from lightning_vlmbalance.loss import weigh_step

__all__ = [
    "COLUMNS",
    "GlobalBatchFormer",
    "cut_step",
    "cut_steps",
    "handed_packs",
    "image_payload_fields",
    "pack_features",
]

# a resume inside an optimizer step saved by a RebalancingLoader: the step's first packs on
# every rank that were trained before the checkpoint (the state's position is the step's start)
STEP_LEAD = "rebalanced_step_lead"
COLUMNS = (*FEATURES, "loss_tokens")  # the columns of a pack's row in a feature table
LOSS_TOKENS = len(FEATURES)  # the loss tokens' column


def pack_features(batch: Any) -> list[int]:
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


def cut_step(
    batches: list[Any], features: np.ndarray, num_replicas: int, keep: int
) -> tuple[list[Any], np.ndarray]:
    """The first ``keep`` micro-steps of a global batch on every rank (where the epoch's
    training batches end inside it: ``limit_train_batches``): this rank's packs and the feature
    table's rows of every rank's first ``keep``."""
    count = len(batches)
    table = features.reshape(num_replicas, count, -1)[:, :keep]
    return batches[:keep], table.reshape(num_replicas * keep, -1)


def cut_steps(
    steps: Iterable[tuple[list[Any], np.ndarray | None, int]],
    *,
    num_replicas: int,
    start: Callable[[], int] | None,
    stop: Callable[[], float] | None,
) -> Iterator[tuple[list[Any], np.ndarray | None, int]]:
    """A pass's optimizer steps ``(packs, features, lead)``, ending where the epoch's training
    batches do (``stop()``, read at every step: ``limit_train_batches``, a re-planned epoch):
    the step that crosses it keeps its first micro-steps on every rank (:func:`cut_step`).
    ``start()`` is the pass's position in the epoch (read at the first step; its first step
    starts ``lead`` packs before it); ``None``: the pass starts the epoch."""
    position: int | None = None
    for packs, features, lead in steps:
        if position is None:
            position = int(start()) - int(lead) if start is not None else 0
        end = stop() if stop is not None else float("inf")
        count = len(packs)
        if position + count > end:
            keep = int(max(0, end - position))
            if keep == 0:
                return
            if features is None:
                packs = packs[:keep]
            else:
                packs, features = cut_step(packs, features, num_replicas, keep)
        yield packs, features, lead
        position += count
        if position >= end:
            return


def handed_packs(
    former: GlobalBatchFormer,
    steps: Iterable[tuple[list[Any], np.ndarray | None, int]],
    handed: Callable[[Any, bool], None],
) -> Iterator[Any]:
    """The packs of each step ``former`` forms (:meth:`GlobalBatchFormer.formed`) in order, less
    each step's lead (trained before the checkpoint the pass resumes from): the front of a
    packed loader under a strategy that does not balance. ``handed(pack, trained)`` sees every
    pack first, the lead's with ``trained=False``."""
    for order, _, lead in former.formed(steps):
        for k, pack in enumerate(order):
            handed(pack, k >= lead)
            if k >= lead:
                yield pack


class GlobalBatchFormer(ImageRoutes):
    """Forms each global batch of one loader's pass (see the module docstring).

    Args:
        micro_steps: micro-batches per rank per optimizer step (Lightning's divisor of the loss:
            a step cut short at the epoch's end is weighed with it all the same).
        num_replicas: data-parallel ranks; ``rank``: this rank among them.
        group: the process group of the gather and the exchange (``None``: the world group).
        copies: processes of ``group`` per data-parallel rank (its tensor-parallel peers, which
            compute the same packs; consecutive in the group): the gather keeps one row each.
        gradient_ranks: ranks the strategy averages gradients over (default ``num_replicas``).
        gather_device: where the gathered features travel (the device of ``group``'s backend;
            default the CPU).
        config: mode, objective, tolerance, exchange timeout, encoder balancing (default
            ``RebalanceConfig(mode="off")``: only the weights).
        models: the fit's cost models by optimizer step (default: one :class:`CostModel`).
        first_step: the optimizer step that trains the first global batch formed (Lightning's
            ``trainer.global_step`` when the loader was made).
        payload_group, device, group_ranks, encoder_group, returns: see
            :class:`~lightning_vlmbalance.RebalancingLoader`.
        meets_every_micro_batch: whether the ranks meet at every micro-step anyway (how
            ``"auto"`` prices a step; default: the config's objective is ``"microstep"``).
        transfer: what moving bytes costs, for ``"auto"``'s prices (default
            :class:`~lightning_vlmbalance.balance.choice.Transfer`).
        scale: how the measured step relates to ``"auto"``'s price, learned from the measured
            steps (:class:`~lightning_vlmbalance.balance.choice.StepScale`; the strategy's):
            the predicted step is the price times its factor; told each global batch's price.
    """

    def __init__(
        self,
        *,
        micro_steps: int,
        num_replicas: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        copies: int = 1,
        gradient_ranks: int | None = None,
        gather_device: torch.device | str | None = None,
        config: RebalanceConfig | None = None,
        models: ModelSchedule | None = None,
        first_step: int = 0,
        payload_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        group_ranks: Sequence[int] | None = None,
        encoder_group: dist.ProcessGroup | None = None,
        returns: ReturnChannel | None = None,
        meets_every_micro_batch: bool | None = None,
        transfer: Transfer | None = None,
        scale: StepScale | None = None,
    ) -> None:
        self.micro_steps = int(micro_steps)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.group = group
        self.copies = int(copies)
        self.gradient_ranks = self.num_replicas if gradient_ranks is None else int(gradient_ranks)
        self.gather_device = torch.device("cpu" if gather_device is None else gather_device)
        self.config = config if config is not None else RebalanceConfig(mode="off")
        self.group_ranks = list(group_ranks) if group_ranks is not None else None
        self.payload_group = payload_group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._stream: Any = None  # the side CUDA stream of the exchange (created on first use)
        self.ready_events: dict[int, Any] = {}  # id(batch) -> CUDA event, until it is used
        # which model plans a global batch: the schedule's at the optimizer step training it
        self.models = models if models is not None else ModelSchedule()
        self.first_step = int(first_step)  # the optimizer step of the first global batch
        self._model_lock = threading.Lock()
        self._planned = 0  # global batches formed so far, every pass
        # the routes' return: the strategy's channel (its timers, its returns), or one here
        self.channel = returns if returns is not None else ReturnChannel(encoder_group)
        if meets_every_micro_batch is None:
            meets_every_micro_batch = self.config.objective == "microstep"
        self.meets_every_micro_batch = bool(meets_every_micro_batch)
        self.transfer = transfer if transfer is not None else Transfer()
        self.scale = scale

    # -- which cost model plans a global batch ----------------------------------------------

    def model_for_next_batch(self) -> CostModel:
        """The model of the next global batch formed: the schedule's at its optimizer step
        (``first_step`` plus the global batches formed before it, across passes: every rank
        forms the same sequence of global batches)."""
        with self._model_lock:
            index, self._planned = self._planned, self._planned + 1
        return self.models.at(self.first_step + index)

    @property
    def planned_batches(self) -> int:
        """Global batches formed so far (the index the next one gets)."""
        return self._planned

    # -- a pass's global batches ------------------------------------------------------------

    def formed(
        self, steps: Iterable[tuple[list[Any], np.ndarray | None, int]]
    ) -> Iterator[tuple[list[Any], dict[str, float], int]]:
        """Each optimizer step ``(packs, features, lead)`` of a pass formed: this rank's packs
        in the order it computes them, the step's statistics, and the lead (this rank's first
        packs of the step, in that order, trained before the checkpoint the pass resumes
        from). ``features=None``: gathered here (:meth:`gather`)."""
        for packs, features, lead in steps:
            if features is None:
                features = self.gather(packs)
            order, stats = self.form(packs, features)
            yield order, stats, lead

    # -- one global batch -------------------------------------------------------------------

    def gather(self, batches: list[Any]) -> np.ndarray:
        """Every rank's pack features of one global batch: one all-gather on ``group`` of this
        rank's rows (:func:`pack_features`); ``(num_replicas * len(batches), len(COLUMNS))``,
        rank by rank. Every rank must hold as many packs."""
        local = torch.tensor([pack_features(b) for b in batches], dtype=torch.int64)
        processes = self.num_replicas * self.copies
        if processes == 1:
            return local.numpy()
        local = local.to(self.gather_device)
        gathered = [torch.empty_like(local) for _ in range(processes)]
        try:
            dist.all_gather(gathered, local, group=self.group)
        except RuntimeError as err:  # a dead or stuck peer (the group has the deadline)
            raise ExchangeError(
                f"rank {self.rank}: gathering the pack features of a global batch failed (a peer"
                f" died or stopped?): {err}"
            ) from err
        # a tensor-parallel rank's peers hold the same packs: one row each
        rows = torch.stack(gathered[:: self.copies]).cpu()
        return rows.reshape(self.num_replicas * len(batches), -1).numpy()

    def form(self, batches: list[Any], features: np.ndarray) -> tuple[list[Any], dict[str, float]]:
        """This rank's packs of one global batch in the order it computes them, weighed, and the
        statistics of the forming (``balance/*``). ``features``: :meth:`gather`'s table (or one
        the loader agreed on: the same rows in the same order)."""
        cost_model = self.model_for_next_batch()
        global_tokens = int(features[:, LOSS_TOKENS].sum())
        stats: dict[str, float] = {"moved_packs": 0.0, "exchange_ms": 0.0}
        if self.config.mode == "auto" and self.num_replicas > 1:
            step = self.first_step + self._planned - 1  # the optimizer step training it
            order = self._auto(batches, features, cost_model, stats, step)
        elif self.config.encoder and self.num_replicas > 1:
            order, more = self._balance_encoder(batches, features, cost_model)
            stats.update(more)
        elif self.config.mode == "off" or self.num_replicas == 1:
            order = list(batches)
        else:
            order = self._place(batches, features, cost_model, stats)
        weigh_step(
            order,
            global_loss_tokens=global_tokens,
            ranks=self.gradient_ranks,
            micro_steps=self.micro_steps,
        )
        return order, stats

    def _place(
        self, batches: list[Any], features: np.ndarray, cost_model: CostModel, stats: dict
    ) -> list[Any]:
        """The pack exchange: plans where every pack of the global batch is computed, sends and
        receives the packs that move, and returns this rank's in micro-step order."""
        G, W = len(batches), self.num_replicas
        cost = cost_model.pack_cost_us({name: features[:, i] for i, name in enumerate(FEATURES)})
        origin = np.repeat(np.arange(W, dtype=np.int64), G)
        plan = plan_rebalance(
            cost, origin, W, G, objective=self.config.objective, tolerance=self.config.tolerance
        )
        return self._move(batches, plan, stats)

    def _move(self, batches: list[Any], plan: RebalancePlan, stats: dict) -> list[Any]:
        """Sends and receives the packs ``plan`` moves; this rank's packs in micro-step order."""
        G, r = len(batches), self.rank
        mine = {r * G + m: b for m, b in enumerate(batches)}
        events: dict[int, Any] = {}
        self._side_stream()
        start = time.perf_counter()
        moves = [tuple(int(x) for x in mv) for mv in plan.moves]
        received = self._exchange(mine, moves, ready_events=events)
        for p, event in events.items():  # keyed by the batch object the loop will get
            self.ready_events[id(received[p])] = event
        stats["exchange_ms"] = (time.perf_counter() - start) * 1e3
        stats["received_bytes"] = float(sum(nbytes(pack) for pack in received.values()))
        stats["moved_packs"] = float(plan.moved_packs)
        stats["planned_waste_frac"] = plan.waste_after
        stats["baseline_waste_frac"] = plan.waste_before
        stats["planned_value"] = float(plan.value)  # predicted step cost (cost units)
        stats["baseline_value"] = float(plan.baseline_value)
        return [mine[p] if p in mine else received[p] for p in plan.assignment[r, :, 0].tolist()]

    def _auto(
        self,
        batches: list[Any],
        features: np.ndarray,
        cost_model: CostModel,
        stats: dict,
        step: int,
    ) -> list[Any]:
        """``mode="auto"``: prices every option for this global batch and carries out the
        cheapest. Every rank prices the same gathered integers with the same model (no
        rank-local number enters a price: the planning time is left out, as it differs by
        rank), and rank 0's option is the one taken everywhere (one small broadcast in the
        thread): a rank that priced differently would otherwise wait in another option's
        exchange until ``exchange_timeout_s``."""
        start = time.perf_counter()
        options = self.config.auto_options
        routed = any(o in options for o in ("images", "both"))
        has_images = bool(features[:, FEATURES.index("images")].any())
        sizes = self._gather_image_sizes(batches, features) if routed and has_images else None
        if sizes is None:
            options = tuple(o for o in options if o in PACK_OPTIONS) or ("placed",)
        choice = choose_step(
            StepInputs.of_features(features, sizes, cost_model, self.num_replicas, self.transfer),
            options=options,
            objective=self.config.objective,
            meets_every_micro_batch=self.meets_every_micro_batch,
            threaded=True,  # "auto" forms every global batch in the loader's thread
            transfer=self.transfer,
            tolerance=self.config.tolerance,
        )
        agreed = self._agree(OPTIONS.index(choice.option))
        if agreed != choice.option:  # rank 0's, whose plans every rank made alike
            stats["choice_overruled"] = 1.0
            choice = choice.taking(agreed)
        if self.scale is not None:  # what the measured step will be compared with
            self.scale.priced(step, choice.step_ms)
        stats.update(choice_stats(choice, self.scale.factor if self.scale is not None else 1.0))
        stats["choice_plan_ms"] = (time.perf_counter() - start) * 1e3
        order = list(batches)
        if choice.pack_plan is not None:
            order = self._move(batches, choice.pack_plan, stats)
        if choice.routing is not None:
            assert sizes is not None
            if choice.pack_plan is not None:  # the routing is over the packs as moved
                sizes = sizes[choice.pack_plan.assignment[:, :, 0].reshape(-1)]
            order, more = self._route(order, choice.routing, sizes)
            more["exchange_ms"] += stats.get("exchange_ms", 0.0)
            stats.update(more)
        return order

    def _agree(self, option: int) -> str:
        """Rank 0's option (an index into :data:`OPTIONS`), broadcast on ``group``."""
        index = torch.tensor([option], dtype=torch.int64, device=self.gather_device)
        try:
            dist.broadcast(index, group=self.group, group_src=0)
        except RuntimeError as err:  # a dead or stuck peer (the group has the deadline)
            raise ExchangeError(
                f"rank {self.rank}: agreeing on the option of a global batch failed (a peer"
                f" died or stopped?): {err}"
            ) from err
        return OPTIONS[int(index.item())]

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
            timeout_s=self.config.exchange_timeout_s,
            payload_group=self.payload_group,
            device=self.device,
            stream=self._stream,
            ready_events=ready_events,
        )
