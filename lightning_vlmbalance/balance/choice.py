"""Which balancing pays for one global batch: the decision of ``mode="auto"`` (numpy only).

Every option the runtime has keeps the math (each changes where a pack or an image is
computed, never what is computed), so the choice is only about time. Each is priced with the
cost model as the ranks will meet:

``placed``  every pack on the rank that holds it, its images encoded there;
``packs``   whole packs moved by the pack planner
            (:func:`~lightning_vlmbalance.balance.planner.plan_rebalance`), exchanged off the
            step path;
``images``  packs stay (each rank's own packs ordered over its micro-steps for even vision
            work, where that is cheaper), their images encoded where the image planner puts
            them (:func:`~lightning_vlmbalance.balance.image_routing.route_images`);
``both``    packs moved to balance each micro-step's language model (their LLM cost), then
            their images routed: the two levels agree (a micro-step that routes images is a
            meeting, which exposes its own language-model imbalance, so that is what the
            packs balance).

The price of an option is its step (:func:`met_step_ms`): the slowest rank's sum where the
ranks meet once per optimizer step (DDP with accumulation), the sum of each micro-step's
slowest where they meet at every micro-step (FSDP). A micro-step that moves an image is two
meetings (the embeddings' return after the encoder, their gradients' before its backward), so
it costs its slowest encoder plus its slowest language model, and the returns' transfer on the
step path. What runs off the step path (planning, the packs' and the pixels' transfers) costs
only what the step does not hide: all of it in line, the excess over the step in a background
thread. Every rank prices the same integers with the same model and takes the same option;
ties go to the option that moves less (the order of :data:`OPTIONS`).

The simulator (:mod:`lightning_vlmbalance.sim.simulate`) prices its modes with these functions,
so that its ``auto`` row is the same decision on its tables.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_vlmbalance.balance.cost import FEATURES, CostModel
from lightning_vlmbalance.balance.image_routing import ImageRouting, route_images
from lightning_vlmbalance.balance.planner import RebalancePlan, plan_rebalance

if TYPE_CHECKING:
    from lightning_vlmbalance.balance.images import PackImages

__all__ = [
    "OPTIONS",
    "StepChoice",
    "StepInputs",
    "StepScale",
    "Transfer",
    "choose_step",
    "met_step_ms",
]

OPTIONS: tuple[str, ...] = ("placed", "packs", "images", "both")
PACK_OPTIONS: tuple[str, ...] = ("placed", "packs")  # what a model without routes can use


@dataclass(frozen=True)
class Transfer:
    """What moving bytes between ranks costs.

    Args:
        bandwidth_gb_s: per-rank bandwidth, GB/s (25: 200 Gb/s InfiniBand).
        latency_ms: per message.
        text_token_bytes: bytes per token of ids, labels and positions.
        image_token_bytes: pixel bytes per image token (14 x 14 patches, 3 channels, bfloat16,
            2 x 2 merge: 4,704).
        embedding_token_bytes: bytes per image token of an embedding returned to its pack (and
            of its gradient): 4,096 dimensions in bfloat16 (8,192).
    """

    bandwidth_gb_s: float = 25.0
    latency_ms: float = 0.02
    text_token_bytes: int = 24
    image_token_bytes: int = 4704
    embedding_token_bytes: int = 8192

    def pack_bytes(self, total_tokens: Any, image_tokens: Any) -> np.ndarray:
        """Bytes of packs of these token counts."""
        total = np.asarray(total_tokens, dtype=np.float64)
        image = np.asarray(image_tokens, dtype=np.float64)
        return (total - image) * self.text_token_bytes + image * self.image_token_bytes

    def exchange_ms(self, moves: np.ndarray, pack_bytes: np.ndarray, world: int) -> float:
        """Milliseconds until every rank has sent and received its moved packs (``moves``:
        rows ``(pack, source, destination)``; one message per pack each way)."""
        if not len(moves):
            return 0.0
        sent = np.bincount(moves[:, 1], weights=pack_bytes[moves[:, 0]], minlength=world)
        recv = np.bincount(moves[:, 2], weights=pack_bytes[moves[:, 0]], minlength=world)
        msgs = np.bincount(moves[:, 1], minlength=world) + np.bincount(moves[:, 2], minlength=world)
        busiest = float(np.max(np.maximum(sent, recv)))
        return busiest / (self.bandwidth_gb_s * 1e6) + self.latency_ms * float(msgs.max())

    def transfer_ms(
        self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, world: int
    ) -> float:
        """Milliseconds of one all-to-all moving ``nbytes[i]`` from rank ``src[i]`` to
        ``dst[i]``: the busiest rank's bytes over the bandwidth, plus the latency of its
        messages (one per peer it exchanges with)."""
        if not len(src):
            return 0.0
        sent = np.bincount(src, weights=nbytes, minlength=world)
        recv = np.bincount(dst, weights=nbytes, minlength=world)
        pairs = np.unique(src * world + dst)
        msgs = np.bincount(pairs // world, minlength=world) + np.bincount(
            pairs % world, minlength=world
        )
        busiest = float(np.max(np.maximum(sent, recv)))
        return busiest / (self.bandwidth_gb_s * 1e6) + self.latency_ms * float(msgs.max())


@dataclass(frozen=True)
class StepInputs:
    """One global batch as the cost model sees it, ``N = num_replicas * G`` packs rank by rank.

    Attributes:
        pack_ms: each pack's forward and backward where it is computed with its images.
        llm_ms: each pack's language model alone (what it costs wherever its images go).
        image_ms, image_tokens: ``(N, K)`` each image's encoder cost and tokens, zero-padded.
        counts: images per pack.
        per_call_ms: the encoder's cost per call.
        pack_bytes: what moving each pack costs in bytes.
        num_replicas: the data-parallel ranks.
    """

    pack_ms: np.ndarray
    llm_ms: np.ndarray
    image_ms: np.ndarray
    image_tokens: np.ndarray
    counts: np.ndarray
    per_call_ms: float
    pack_bytes: np.ndarray
    num_replicas: int

    @property
    def micro_steps(self) -> int:
        return len(self.pack_ms) // self.num_replicas

    @classmethod
    def of_features(
        cls,
        features: np.ndarray,
        sizes: np.ndarray | None,
        cost_model: CostModel,
        num_replicas: int,
        transfer: Transfer,
    ) -> StepInputs:
        """From a former's feature table (columns :data:`FEATURES` first) and every pack's
        image sizes (``(N, K)`` zero-padded; ``None``: no image can be routed)."""
        named = {name: features[:, i] for i, name in enumerate(FEATURES)}
        counts = np.asarray(named["images"], dtype=np.int64)
        if sizes is None:
            sizes = np.zeros((len(features), 1), dtype=np.int64)
        image_ms, per_call = cost_model.image_cost_ms(sizes)
        present = np.arange(sizes.shape[1])[None, :] < counts[:, None]
        return cls(
            pack_ms=cost_model.pack_cost_ms(named),
            llm_ms=cost_model.llm_cost_ms(named),
            image_ms=np.where(present, image_ms, 0.0),
            image_tokens=np.where(present, sizes, 0),
            counts=counts,
            per_call_ms=per_call,
            pack_bytes=transfer.pack_bytes(named["total_tokens"], named["image_tokens"]),
            num_replicas=int(num_replicas),
        )

    @classmethod
    def of_pack_images(
        cls,
        images: PackImages,
        pack_ms: np.ndarray,
        pack_bytes: np.ndarray,
        draw: np.ndarray,
        num_replicas: int,
    ) -> StepInputs:
        """One global batch ``draw`` (indices of packs, rank by rank) of packs known from a
        length table: each image's cost and tokens from ``images``
        (:class:`~lightning_vlmbalance.balance.images.PackImages`: a sample's image tokens
        split evenly over its images), each pack's cost and bytes from ``pack_ms`` and
        ``pack_bytes``. How the simulator and the per-epoch decision
        (:mod:`~lightning_vlmbalance.balance.epoch_choice`) see a global batch."""
        first, last = images.offsets[draw], images.offsets[draw + 1]
        counts = (last - first).astype(np.int64)
        K = max(1, int(counts.max()) if len(counts) else 1)
        present = np.arange(K)[None, :] < counts[:, None]
        if len(images.cost_ms):
            index = np.where(present, first[:, None] + np.arange(K)[None, :], 0)
            image_ms = np.where(present, images.cost_ms[index], 0.0)
            tokens = np.where(present, images.tokens[index], 0)
        else:
            image_ms, tokens = np.zeros((len(draw), K)), np.zeros((len(draw), K), dtype=np.int64)
        return cls(
            pack_ms=pack_ms[draw],
            llm_ms=images.llm_ms[draw],
            image_ms=image_ms,
            image_tokens=tokens,
            counts=counts,
            per_call_ms=images.per_call_ms,
            pack_bytes=np.asarray(pack_bytes, dtype=np.float64)[draw],
            num_replicas=int(num_replicas),
        )

    def taken(self, packs: np.ndarray) -> StepInputs:
        """These inputs with the packs in the order ``packs`` (global indices, rank by rank)."""
        return StepInputs(
            pack_ms=self.pack_ms[packs],
            llm_ms=self.llm_ms[packs],
            image_ms=self.image_ms[packs],
            image_tokens=self.image_tokens[packs],
            counts=self.counts[packs],
            per_call_ms=self.per_call_ms,
            pack_bytes=self.pack_bytes[packs],
            num_replicas=self.num_replicas,
        )


@dataclass(frozen=True)
class StepChoice:
    """The option taken for one global batch, its predicted step, every priced option's, and
    the plan to carry it out (``pack_plan`` for ``packs`` and ``both``, ``routing`` for
    ``images`` and ``both``: over the packs as the pack plan placed them)."""

    option: str
    step_ms: float
    prices: dict[str, float] = field(default_factory=dict)
    pack_plan: RebalancePlan | None = None
    routing: ImageRouting | None = None
    exposed_ms: float = 0.0  # of the chosen option: its off-path work the step does not hide
    # every priced option's plans and exposed time (what :meth:`taking` switches to)
    plans: dict[str, tuple[RebalancePlan | None, ImageRouting | None, float]] = field(
        default_factory=dict, repr=False
    )

    def taking(self, option: str) -> StepChoice:
        """This choice with ``option`` taken instead (one of those priced): the choice every
        rank agreed on, when it is not this rank's own."""
        pack_plan, routing, exposed = self.plans[option]
        return StepChoice(
            option=option,
            step_ms=self.prices[option],
            prices=self.prices,
            pack_plan=pack_plan,
            routing=routing,
            exposed_ms=exposed,
            plans=self.plans,
        )


def expected_max(mean: np.ndarray, sd: np.ndarray, points: int = 97) -> float:
    """The expected maximum of independent normal times ``N(mean[r], sd[r]^2)``: the wait of a
    meeting whose ranks' times are predicted with an error. ``E[max] = lo + integral from lo
    of P(max > t)``, where ``lo`` is a time the maximum is below only with probability
    ``Phi(-8)``, on a grid of ``points`` (the trapezoid rule; vectorised over the ranks)."""
    mean = np.asarray(mean, dtype=np.float64)
    sd = np.asarray(sd, dtype=np.float64)
    if not (sd > 0).any():
        return float(mean.max())
    lo = float((mean - 8.0 * sd).max())
    hi = float((mean + 8.0 * sd).max())
    t = np.linspace(lo, hi, points)
    noisy = sd > 0
    z = (t[:, None] - mean[None, noisy]) / sd[None, noisy]
    log_cdf = np.log(np.maximum(_normal_cdf(z), 1e-300)).sum(axis=1)
    fixed = mean[~noisy]  # a rank without error: below its time the maximum cannot be
    below = (t[:, None] < fixed[None, :]).any(axis=1) if len(fixed) else np.zeros(len(t), bool)
    above = np.where(below, 1.0, 1.0 - np.exp(log_cdf))
    return lo + float(np.sum((above[1:] + above[:-1]) * np.diff(t)) / 2.0)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF (Abramowitz and Stegun 7.1.26 for erf: error below 1.5e-7)."""
    x = np.abs(z) / np.sqrt(2.0)
    k = 1.0 / (1.0 + 0.3275911 * x)
    poly = k * (
        0.254829592 + k * (-0.284496736 + k * (1.421413741 + k * (-1.453152027 + k * 1.061405429)))
    )
    erf = 1.0 - poly * np.exp(-x * x)
    return np.where(z >= 0, 0.5 * (1.0 + erf), 0.5 * (1.0 - erf))


def met_step_ms(
    work: np.ndarray,
    *,
    meets_every_micro_batch: bool,
    meetings: np.ndarray | None = None,
    encoder: np.ndarray | None = None,
    language: np.ndarray | None = None,
    jitter: float = 0.0,
) -> float:
    """The step of ``work[r, m]`` (rank ``r``'s time at micro-step ``m``) as the ranks meet:
    once at its end, or at every micro-step. Where ``meetings[m]``, micro-step ``m`` is split
    into ``encoder`` and ``language`` (``work = encoder + language`` there) with a meeting
    after each: it costs the slowest encoder plus the slowest language model, and everything
    each rank did since the last meeting waits for the slowest before it.

    ``jitter``: the relative error of each predicted time (its standard deviation over its
    value, independent between ranks and pieces of work): each meeting then costs the
    expected maximum of the ranks' times (:func:`expected_max`), so that every meeting
    exposes the error (0: the predicted times are the times)."""
    W, G = work.shape
    if jitter > 0:
        return _met_with_error(work, meets_every_micro_batch, meetings, encoder, language, jitter)
    if meetings is None or not meetings.any():
        if meets_every_micro_batch:
            return float(work.max(axis=0).sum())
        return float(work.sum(axis=1).max())
    assert encoder is not None and language is not None
    spent, since = 0.0, np.zeros(W)
    for m in range(G):
        if meetings[m]:
            spent += float((since + encoder[:, m]).max()) + float(language[:, m].max())
            since[:] = 0.0
        elif meets_every_micro_batch:
            spent += float(work[:, m].max())
        else:
            since += work[:, m]
    return spent + float(since.max())


def _met_with_error(
    work: np.ndarray,
    meets: bool,
    meetings: np.ndarray | None,
    encoder: np.ndarray | None,
    language: np.ndarray | None,
    jitter: float,
) -> float:
    """:func:`met_step_ms` where each piece of work is off by ``jitter`` of itself."""
    W, G = work.shape
    routed = meetings if meetings is not None else np.zeros(G, dtype=bool)
    spent, since, var = 0.0, np.zeros(W), np.zeros(W)

    def meet(mean: np.ndarray, variance: np.ndarray) -> float:
        return expected_max(mean, np.sqrt(variance))

    for m in range(G):
        if routed[m]:
            assert encoder is not None and language is not None
            spent += meet(since + encoder[:, m], var + (jitter * encoder[:, m]) ** 2)
            spent += meet(language[:, m], (jitter * language[:, m]) ** 2)
            since[:], var[:] = 0.0, 0.0
        elif meets:
            spent += meet(work[:, m], (jitter * work[:, m]) ** 2)
        else:
            since += work[:, m]
            var += (jitter * work[:, m]) ** 2
    return spent + meet(since, var)


def _thread(off_path_ms: float, busy_ms: float, threaded: bool) -> float:
    """What off-path work costs the step: all of it in line, the excess over the step (which
    hides it: the next global batch is prepared while this one trains) in a thread."""
    return max(0.0, off_path_ms - busy_ms) if threaded else off_path_ms


def price_placed(
    inputs: StepInputs, *, meets_every_micro_batch: bool, jitter: float = 0.0
) -> float:
    """The step with every pack where it is."""
    W = inputs.num_replicas
    return met_step_ms(
        inputs.pack_ms.reshape(W, -1),
        meets_every_micro_batch=meets_every_micro_batch,
        jitter=jitter,
    )


def price_packs(
    inputs: StepInputs,
    plan: RebalancePlan,
    transfer: Transfer,
    *,
    meets_every_micro_batch: bool,
    threaded: bool,
    plan_ms: float = 0.0,
    jitter: float = 0.0,
) -> tuple[float, float]:
    """The step with ``plan``'s packs moved, and what of its exchange is exposed."""
    W = inputs.num_replicas
    busy = met_step_ms(
        inputs.pack_ms[plan.assignment[:, :, 0]],
        meets_every_micro_batch=meets_every_micro_batch,
        jitter=jitter,
    )
    moves = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 3)
    exposed = _thread(plan_ms + transfer.exchange_ms(moves, inputs.pack_bytes, W), busy, threaded)
    return busy + exposed, exposed


def price_routing(
    routing: ImageRouting,
    transfer: Transfer,
    *,
    meets_every_micro_batch: bool,
    threaded: bool,
    plan_ms: float = 0.0,
    moved_packs_ms: float = 0.0,
    jitter: float = 0.0,
) -> tuple[float, float]:
    """The step with ``routing``'s images (and, before it, packs moved in ``moved_packs_ms``),
    and what of the off-path work is exposed: the micro-steps that move an image are
    meetings; their returns (embeddings and their gradients) are on the step path, the
    pixels' transfer off it."""
    W = routing.placed.shape[0]
    meetings = routing.moved
    # where nothing moves the encoder runs as at home: the route's per-call cost on every
    # rank is what the runtime pays (every rank calls the encoder at every routed micro-step)
    work = routing.llm_ms + routing.load_ms
    returns = 0.0
    src, dst, pixels = [], [], []
    for step in routing.steps:
        away = step.encoder != step.home
        if not away.any():
            continue
        back = step.rows[away] * float(transfer.embedding_token_bytes)
        returns += 2.0 * transfer.transfer_ms(step.encoder[away], step.home[away], back, W)
        src.append(step.home[away])
        dst.append(step.encoder[away])
        pixels.append(step.rows[away] * float(transfer.image_token_bytes))
    busy = returns + met_step_ms(
        work,
        meets_every_micro_batch=meets_every_micro_batch,
        meetings=meetings,
        encoder=routing.load_ms,
        language=routing.llm_ms,
        jitter=jitter,
    )
    sent = (
        transfer.transfer_ms(np.concatenate(src), np.concatenate(dst), np.concatenate(pixels), W)
        if src
        else 0.0
    )
    exposed = _thread(plan_ms + moved_packs_ms + sent, busy, threaded)
    return busy + exposed, exposed


def _routed(inputs: StepInputs, *, reorder: bool) -> ImageRouting:
    return route_images(
        inputs.llm_ms,
        inputs.image_ms,
        inputs.image_tokens,
        inputs.counts,
        inputs.per_call_ms,
        inputs.num_replicas,
        reorder=reorder,
    )


def _priced_images(
    inputs: StepInputs,
    transfer: Transfer,
    meets: bool,
    threaded: bool,
    plan_ms: float,
    jitter: float = 0.0,
) -> tuple[tuple[float, float], ImageRouting]:
    """``images``: the cheaper of routing as the packs come and with each rank's own packs
    ordered over its micro-steps for even vision work (with more than one micro-step)."""
    best = None
    for reorder in (False, True) if inputs.micro_steps > 1 else (False,):
        routing = _routed(inputs, reorder=reorder)
        price = price_routing(
            routing,
            transfer,
            meets_every_micro_batch=meets,
            threaded=threaded,
            plan_ms=plan_ms,
            jitter=jitter,
        )
        if best is None or price[0] < best[0][0]:
            best = (price, routing)
    assert best is not None
    return best


def _priced_both(
    inputs: StepInputs,
    transfer: Transfer,
    meets: bool,
    threaded: bool,
    plan_ms: float,
    tolerance: float,
    jitter: float = 0.0,
) -> tuple[tuple[float, float], ImageRouting, RebalancePlan]:
    """``both``: packs moved to balance every micro-step's language model, then their images
    routed (the routing over the packs as moved)."""
    W, G = inputs.num_replicas, inputs.micro_steps
    plan = plan_rebalance(
        np.rint(inputs.llm_ms * 1000.0).astype(np.int64),
        np.repeat(np.arange(W, dtype=np.int64), G),
        W,
        G,
        objective="microstep",
        tolerance=tolerance,
    )
    routing = _routed(inputs.taken(plan.assignment[:, :, 0].reshape(-1)), reorder=False)
    moves = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 3)
    price = price_routing(
        routing,
        transfer,
        meets_every_micro_batch=meets,
        threaded=threaded,
        plan_ms=plan_ms,
        moved_packs_ms=transfer.exchange_ms(moves, inputs.pack_bytes, W),
        jitter=jitter,
    )
    return price, routing, plan


def choose_step(
    inputs: StepInputs,
    *,
    options: Sequence[str] = OPTIONS,
    objective: str,
    meets_every_micro_batch: bool,
    threaded: bool,
    transfer: Transfer | None = None,
    tolerance: float = 0.0,
    plan_ms: float = 0.0,
    overhead_ms: float = 0.0,
    jitter: float = 0.0,
) -> StepChoice:
    """Prices each of ``options`` for one global batch and takes the cheapest (see the module
    docstring).

    Args:
        inputs: the global batch (:class:`StepInputs`).
        options: the options to price, some of :data:`OPTIONS` (``images`` and ``both`` need
            a model that encodes through routes).
        objective: the pack planner's objective for ``packs`` (``both`` balances every
            micro-step's language model: ``"microstep"``).
        meets_every_micro_batch: whether the ranks meet at every micro-step anyway.
        threaded: whether the plan and transfers run in a background thread.
        transfer: what moving bytes costs (default :class:`Transfer`).
        tolerance: the pack planner's tolerance.
        plan_ms: planning time off the step path, per option (every rank must give the same
            number: the choice depends on it; the runtime gives 0, the simulator a constant).
        overhead_ms: time every step takes beyond the ranks' compute (the optimizer step,
            the gradient reduction): added to every price alike.
        jitter: the relative error of each predicted time (:func:`met_step_ms`): every
            meeting then costs the ranks' expected maximum, which prices the meetings that
            routing adds (0, the runtime's: the predicted times are the times).

    Raises:
        ValueError: for an unknown or empty set of options.
    """
    bad = [o for o in options if o not in OPTIONS]
    if bad or not options:
        raise ValueError(f"choose_step(options={list(options)}): expected some of {OPTIONS}")
    transfer = transfer or Transfer()
    W, G = inputs.num_replicas, inputs.micro_steps
    meets = meets_every_micro_batch
    prices: dict[str, float] = {}
    exposed: dict[str, float] = {}
    pack_plan: RebalancePlan | None = None
    both_plan: RebalancePlan | None = None
    routings: dict[str, ImageRouting] = {}
    origin = np.repeat(np.arange(W, dtype=np.int64), G)
    if "placed" in options or W == 1:
        prices["placed"] = price_placed(inputs, meets_every_micro_batch=meets, jitter=jitter)
        exposed["placed"] = 0.0
    if W > 1 and "packs" in options:
        pack_plan = plan_rebalance(
            np.rint(inputs.pack_ms * 1000.0).astype(np.int64),
            origin,
            W,
            G,
            objective=objective,  # type: ignore[arg-type]
            tolerance=tolerance,
        )
        prices["packs"], exposed["packs"] = price_packs(
            inputs,
            pack_plan,
            transfer,
            meets_every_micro_batch=meets,
            threaded=threaded,
            plan_ms=plan_ms,
            jitter=jitter,
        )
    if W > 1 and "images" in options:
        (prices["images"], exposed["images"]), routings["images"] = _priced_images(
            inputs, transfer, meets, threaded, plan_ms, jitter
        )
    if W > 1 and "both" in options:
        (prices["both"], exposed["both"]), routings["both"], both_plan = _priced_both(
            inputs, transfer, meets, threaded, plan_ms, tolerance, jitter
        )
    # the choice is made on the prices alone (the overhead, this rank's own estimate, only
    # shifts every price alike for the report)
    option = min(prices, key=lambda o: (prices[o], OPTIONS.index(o)))
    plans = {
        o: (
            both_plan if o == "both" else pack_plan if o == "packs" else None,
            routings.get(o),
            float(exposed[o]),
        )
        for o in prices
    }
    return StepChoice(
        option=option,
        step_ms=prices[option] + overhead_ms,
        prices={o: p + overhead_ms for o, p in prices.items()},
        plans=plans,
    ).taking(option)


def price_taken(
    choice: StepChoice,
    inputs: StepInputs,
    transfer: Transfer,
    *,
    meets_every_micro_batch: bool,
    threaded: bool,
    plan_ms: float = 0.0,
    jitter: float = 0.0,
) -> tuple[float, float]:
    """The step of the option ``choice`` took and its exposed part, priced again with its own
    plans: with a ``jitter`` the choice was not made with, what its step is when the times
    are off by that much (the simulator's realised step of a decision made on predictions)."""
    meets = meets_every_micro_batch
    if choice.option == "placed" or inputs.num_replicas == 1:
        return price_placed(inputs, meets_every_micro_batch=meets, jitter=jitter), 0.0
    if choice.option == "packs":
        assert choice.pack_plan is not None
        return price_packs(
            inputs,
            choice.pack_plan,
            transfer,
            meets_every_micro_batch=meets,
            threaded=threaded,
            plan_ms=plan_ms,
            jitter=jitter,
        )
    assert choice.routing is not None
    moved = 0.0
    if choice.pack_plan is not None:  # both: the packs moved before the routing
        moves = np.asarray(choice.pack_plan.moves, dtype=np.int64).reshape(-1, 3)
        moved = transfer.exchange_ms(moves, inputs.pack_bytes, inputs.num_replicas)
    return price_routing(
        choice.routing,
        transfer,
        meets_every_micro_batch=meets,
        threaded=threaded,
        plan_ms=plan_ms,
        moved_packs_ms=moved,
        jitter=jitter,
    )


def choice_stats(choice: StepChoice, scale: float = 1.0) -> Mapping[str, float]:
    """The ``balance/*`` statistics of a choice: ``choice`` (its index in :data:`OPTIONS`),
    ``predicted_step_ms``, and each priced option's ``predicted_<option>_ms``, every price
    times ``scale`` (:class:`StepScale`'s factor)."""
    stats = {
        "choice": float(OPTIONS.index(choice.option)),
        "predicted_step_ms": float(choice.step_ms) * scale,
    }
    stats.update({f"predicted_{o}_ms": float(p) * scale for o, p in choice.prices.items()})
    return stats


class StepScale:
    """How the measured step relates to the price of the option taken, learned from the
    measured steps: the median over the last ``window`` timed steps of measured over priced
    (both this rank's). The price is the ranks' compute as they meet; the step also holds the
    optimizer step, the gradient reduction, FSDP's gathers, and whatever the cost model gets
    wrong in scale (its defaults describe a large GPU model). ``balance/predicted_step_ms`` is
    the price times this factor; the choice is made on the prices alone, so the factor (a
    positive number, the same for every option) never changes it.

    A ``TimedStepsListener`` of the :class:`~lightning_vlmbalance.StragglerMonitor` (the
    strategy subscribes it in ``mode="auto"``); without a monitor the factor stays 1. When
    online calibration adopts a new cost model the strategy calls :meth:`reset`: the ratios
    measured against the old model's prices are forgotten.
    """

    state_key = "step_scale"

    def __init__(self, window: int = 16) -> None:
        self._ratios: deque[float] = deque(maxlen=int(window))
        self._prices: dict[int, float] = {}  # optimizer step -> its price, until timed
        self._lock = threading.Lock()
        self._from = 0  # the first optimizer step priced with the cost model in use
        self.factor = 1.0

    def priced(self, step: int, price_ms: float) -> None:
        """The former priced the global batch that optimizer step ``step`` trains (from its
        thread: one global batch ahead)."""
        with self._lock:
            self._prices[int(step)] = float(price_ms)
            if len(self._prices) > 64:  # never timed (no monitor): forget the oldest
                del self._prices[min(self._prices)]

    def reset(self, from_step: int) -> None:
        """A new cost model prices the global batches from optimizer step ``from_step`` on:
        the ratios measured against the old one's prices are forgotten (the factor so far is
        kept until a step priced with the new one is timed)."""
        with self._lock:
            self._from = int(from_step)
            self._prices = {k: v for k, v in self._prices.items() if k >= self._from}
            self._ratios.clear()

    # -- the listener ------------------------------------------------------------------------
    def start(self, world: Any, global_step: int, state: Any = None) -> None:
        with self._lock:
            if state is not None:
                self._ratios.extend(float(x) for x in state.get("ratios", []))
            self._update()

    def on_timed_steps(self, steps: list[Any], global_step: int) -> dict[str, float]:
        with self._lock:
            for step in steps:
                # a timed step carries the global step after its optimizer step: the batch
                # priced for optimizer step N is timed as N + 1
                n = int(step.global_step) - 1
                price = self._prices.pop(n, None)
                if price is not None and price > 0 and n >= self._from:
                    self._ratios.append(float(step.step_ms) / price)
            self._update()
        return {}

    def end(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"ratios": list(self._ratios)}

    @property
    def timed(self) -> int:
        """How many measured steps the factor is over (at most ``window``)."""
        return len(self._ratios)

    def _update(self) -> None:
        if self._ratios:
            self.factor = float(np.median(self._ratios))
