"""What-if simulation of straggler waste and rebalancing gain, from a data mix and a cost model.

For each configuration (mode, data-parallel size ``dp``, micro-steps ``ga``) it runs the
real packing core on the mix, prices every pack with a :class:`CostModel`, draws global batches
(``dp x ga`` packs, rank ``r`` computing packs ``r*ga .. r*ga+ga-1``), and computes each global
batch's step time as the ranks' synchronisation makes it:

- ``sync_every="step"`` (one gradient sync per optimizer step, as under ``strategy="vlmbalance"``
  or any DDP without per-micro-batch barriers): ``max over ranks of the sum of its packs``;
- ``sync_every="microstep"`` (a barrier in every micro-batch, as Lightning's default DDP loop):
  ``sum over micro-steps of the max over ranks``.

Modes (the rebalancing modes, ``RebalanceConfig.mode``'s word): ``off`` (the packs where the
sampler put them); ``sync`` and ``overlap`` (the real planner moves whole packs; the exchange
costs ``bytes / bandwidth + latency x messages`` per rank, plus a planning time, exposed in full
when synchronous and only beyond the previous step's compute when overlapped); ``budget`` (packs
built with an image-token budget per pack: better balanced packs, worse packing efficiency, no
rebalancing); ``source`` (``PackingSampler(balance=...)``: global batches formed balanced at the
source).

Encoder balancing (``RebalanceConfig(encoder=True)``) adds ``encoder`` (the packs of ``off``),
``encoder_overlap`` (the rebalancing thread re-orders each rank's packs over the micro-steps so
every micro-step carries the same vision work, ``images.order_micro_steps``; no pack changes
rank) and ``encoder_source`` (the packs of ``source``): at every micro-step the images of the
ranks' packs are planned to ranks (:func:`~lightning_vlmbalance.balance.images.plan_images`)
and the embeddings return to their
packs in the forward, their gradients in the backward. Those returns synchronise the ranks twice
per micro-step, between the encoder and the language model, so a micro-step takes the slowest
rank's language model plus the slowest rank's encoder work (every rank pays the encoder's
per-call cost), plus both returns (``embedding_token_bytes`` per image token each way, exposed);
the pixels travel in the rebalancing thread, hidden behind the previous step's compute up to
its length, as the pack exchange is.

What each row is measured on (its ``samples`` field): ``off``, ``sync`` and ``overlap`` compute
the same drawn global batches; ``source`` re-forms exactly the samples of those batches (a pack
drawn twice gives its samples twice) into a whole source-balanced epoch, whose batch count may
differ by one or two (its last global batch is padded, as the sampler pads it). So these four
rows process the same tokens (``samples="off"``) and their gains are balance alone, not a luckier
draw. ``budget`` draws from its own packs (``samples="own"``; samples above the budget are left
out), so its gain also holds a different sample of the mix.

Global batches are either drawn uniformly from the pack pool of the whole mix (``replay=False``:
any ``dp``), or replayed exactly as the distributed sampler deals them
(``replay=True``: ``build_epoch_plan(num_replicas=dp)``, global batch ``k`` = packs ``k*ga..`` of
every rank), which is how the emulated benchmark runs and what validation compares against.
"""

from __future__ import annotations

import math
import numbers
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_vlmbalance._moved import renamed_keyword
from lightning_vlmbalance.balance.choice import (
    OPTIONS,
    StepInputs,
    Transfer,
    choose_step,
    price_packs,
    price_placed,
    price_routing,
    price_taken,
)
from lightning_vlmbalance.balance.config import RebalanceConfig
from lightning_vlmbalance.balance.cost import CostModel, features_from_packs
from lightning_vlmbalance.balance.image_routing import route_images
from lightning_vlmbalance.balance.images import PackImages
from lightning_vlmbalance.balance.planner import plan_rebalance
from lightning_vlmbalance.loaders.streaming import hand_size, tail_plan, trained_counts
from lightning_vlmbalance.packing import PackingConfig, Packs, build_epoch_plan
from lightning_vlmbalance.packing.plan import (
    as_length_column,
    check_image_counts,
    check_length_table,
)
from lightning_vlmbalance.packing.stream import pack_stream
from lightning_vlmbalance.synthetic import LengthTable

__all__ = [
    "ALL_MODES",
    "MODES",
    "SYNC_EVERY",
    "ExchangeModel",
    "StepOverhead",
    "closed_form_waste",
    "simulate",
]

MODES: tuple[str, ...] = ("off", "sync", "overlap", "budget")
# also accepted: "source" (PackingSampler(balance=...): global batches balanced at the source)
# and the encoder-balanced modes (RebalanceConfig(encoder=True); see the module docstring)
ENCODER_MODES: tuple[str, ...] = ("encoder", "encoder_overlap", "encoder_source")
ALL_MODES: tuple[str, ...] = (*MODES, "source", *ENCODER_MODES, "auto")
SYNC_EVERY: tuple[str, ...] = ("step", "microstep")

# the simulator's old names of the modes, still importable with a FutureWarning
_DEPRECATED_NAMES = {
    "STRATEGIES": "MODES",
    "ENCODER_STRATEGIES": "ENCODER_MODES",
    "ALL_STRATEGIES": "ALL_MODES",
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED_NAMES:
        new = _DEPRECATED_NAMES[name]
        warnings.warn(
            f"`{__name__}.{name}` is deprecated: use `{new}` (the simulator's strategies are"
            " now called modes, as `RebalanceConfig.mode` calls them)",
            FutureWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ExchangeModel:
    """Cost of moving packs between ranks.

    Args:
        bandwidth_gb_s: per-rank network bandwidth, GB/s (25: 200 Gb/s InfiniBand).
        latency_ms: per message (a pack is one message each way).
        text_token_bytes: bytes per token of ids, labels and positions.
        image_token_bytes: pixel bytes per image token (14 x 14 patches, 3 channels, bfloat16,
            2 x 2 merge: 4,704).
        plan_ms: planning time per global batch (the planner's measured 5-30 ms at 16k packs).
        embedding_token_bytes: bytes per image token of an image embedding returned to its
            pack (and of its gradient): 4,096 dimensions in bfloat16 (8,192).

    Raises:
        ValueError: for a bandwidth that is not a finite number > 0, or a latency, byte count
            or planning time that is not a finite number >= 0 (naming the setting).
    """

    bandwidth_gb_s: float = 25.0
    latency_ms: float = 0.02
    text_token_bytes: int = 24
    image_token_bytes: int = 4704
    plan_ms: float = 5.0
    embedding_token_bytes: int = 8192

    def __post_init__(self) -> None:
        bw = self.bandwidth_gb_s
        if not (isinstance(bw, numbers.Real) and math.isfinite(bw) and bw > 0):
            raise ValueError(f"`ExchangeModel(bandwidth_gb_s={bw!r})` must be a finite number > 0")
        for name in (
            "latency_ms",
            "text_token_bytes",
            "image_token_bytes",
            "plan_ms",
            "embedding_token_bytes",
        ):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
                raise ValueError(f"`ExchangeModel({name}={v!r})` must be a finite number >= 0")

    @property
    def transfer(self) -> Transfer:
        """The transfer costs, as ``mode="auto"`` prices them (:class:`Transfer`)."""
        return Transfer(
            bandwidth_gb_s=self.bandwidth_gb_s,
            latency_ms=self.latency_ms,
            text_token_bytes=self.text_token_bytes,
            image_token_bytes=self.image_token_bytes,
            embedding_token_bytes=self.embedding_token_bytes,
        )

    def exchange_ms(self, moves: np.ndarray, pack_bytes: np.ndarray, world: int) -> float:
        """Milliseconds until every rank has sent and received its moved packs, planning
        included."""
        return self.plan_ms + self.transfer.exchange_ms(moves, pack_bytes, world)

    def transfer_ms(
        self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, world: int
    ) -> float:
        """Milliseconds of one all-to-all moving ``nbytes[i]`` from rank ``src[i]`` to
        ``dst[i]`` (no planning time): :meth:`Transfer.transfer_ms`."""
        return self.transfer.transfer_ms(src, dst, nbytes, world)


@dataclass(frozen=True)
class StepOverhead:
    """Time per optimizer step beyond the slowest rank's compute: the gradient all-reduce's
    latency and the ranks' launch and wake-up jitter (whose maximum grows with the rank count),
    ``base_ms + per_log2_rank_ms * log2(dp)``. Zero by default; :meth:`fit` measures it."""

    base_ms: float = 0.0
    per_log2_rank_ms: float = 0.0

    def __call__(self, dp: int) -> float:
        return max(0.0, self.base_ms + self.per_log2_rank_ms * math.log2(max(dp, 1)))

    @classmethod
    def fit(cls, steps: Sequence[Mapping[str, Any]]) -> StepOverhead:
        """Least squares on StragglerMonitor step records of several runs: for each (run,
        global step), ``step_ms`` minus the largest per-rank sum of the micro-batches' measured
        ``vision_fwd_ms + llm_fwd_ms + backward_ms``. Each record needs ``world_size``,
        ``global_step``, ``step_ms``, ``micro`` and a ``run`` key telling runs apart.

        Raises:
            ValueError: with fewer than two distinct world sizes (naming what it got), or for a
                record without those keys or whose ``micro`` is not a list of objects with the
                three times (naming the record's index).
        """
        groups: dict[tuple[Any, int], list[Mapping[str, Any]]] = {}
        for i, rec in enumerate(steps):
            _check_step_record(rec, i)
            groups.setdefault((rec["run"], int(rec["global_step"])), []).append(rec)
        xs, ys = [], []
        for recs in groups.values():
            busy = max(
                sum(m["vision_fwd_ms"] + m["llm_fwd_ms"] + m["backward_ms"] for m in r["micro"])
                for r in recs
            )
            xs.append(math.log2(int(recs[0]["world_size"])))
            ys.append(float(np.mean([r["step_ms"] for r in recs])) - busy)
        if len(set(xs)) < 2:
            raise ValueError(
                f"StepOverhead.fit needs step records of at least two world sizes; got"
                f" {sorted({2**x for x in xs})}"
            )
        slope, base = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
        return cls(float(base), float(slope))


_STEP_KEYS = ("run", "world_size", "global_step", "step_ms", "micro")
_MICRO_TIMES = ("vision_fwd_ms", "llm_fwd_ms", "backward_ms")


def _check_step_record(rec: Any, i: int) -> None:
    """A StragglerMonitor step record as :meth:`StepOverhead.fit` reads it, or a ValueError
    naming record ``i``."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"StepOverhead.fit: record {i} is not a mapping: {rec!r}"[:200])
    missing = [k for k in _STEP_KEYS if k not in rec]
    if missing:
        raise ValueError(f"StepOverhead.fit: record {i} has no {missing[0]!r} (needs {_STEP_KEYS})")
    micro = rec["micro"]
    if not isinstance(micro, list) or not all(isinstance(m, Mapping) for m in micro):
        raise ValueError(
            f'StepOverhead.fit: record {i}: "micro" must be a list of micro-batch objects,'
            f" got {micro!r}"[:200]
        )
    for j, m in enumerate(micro):
        for key in _MICRO_TIMES:
            if not isinstance(m.get(key), numbers.Real) or isinstance(m.get(key), bool):
                got = f"{key} = {m[key]!r}" if key in m else f"no {key!r}"
                raise ValueError(f"StepOverhead.fit: record {i}: micro[{j}] has {got}")


def _expected_max_std_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def closed_form_waste(mean_ms: float, std_ms: float, dp: int, ga: int, sync_every: str) -> float:
    """Waste of ``off`` if pack costs were i.i.d. (mean, std): a rank's load is the sum of
    ``ga`` packs, ~ N(ga*mean, ga*std^2); the step waits for the largest of ``dp`` such loads,
    ``ga*mean + sqrt(ga)*std*z(dp)`` (grows with dp, shrinks relative to the mean as 1/sqrt(ga));
    with a barrier every micro-step it is ``ga*(mean + std*z(dp))`` (no averaging)."""
    z = _expected_max_std_normal(dp)
    spread = std_ms * z * (math.sqrt(ga) if sync_every == "step" else ga)
    expected = ga * mean_ms + spread
    return 1.0 - ga * mean_ms / expected if expected > 0 else 0.0


class _Pool:
    """The packs of one packer over the mix: sample ids, features, costs, bytes."""

    def __init__(
        self,
        table: LengthTable,
        seq_len: int,
        cost_model: CostModel,
        exchange: ExchangeModel,
        num_replicas: int,
        seed: int,
        packer: str = "greedy",
        image_budget: int | None = None,
        window: int = 4096,
        stream_buffer: int | None = None,
    ) -> None:
        total = np.asarray(table.total_tokens, dtype=np.int64)
        image = np.asarray(table.image_tokens, dtype=np.int64)
        images = np.asarray(table.images, dtype=np.int64)
        config = PackingConfig(
            seq_len=seq_len,
            seed=seed,
            window=window,
            overlong="skip",
            packer=packer,
            image_budget=image_budget,
        )
        rows = np.arange(len(total))
        if packer == "budget":  # a sample above the budget cannot be packed at all: leave it out
            rows = np.flatnonzero(image <= (image_budget or 0))
            total, image, images = total[rows], image[rows], images[rows]
        self.stream_counts: list[int] | None = None
        if stream_buffer is not None:  # each rank packs its own shard of the stream
            plan = _stream_plan(total, seq_len, num_replicas, seed, stream_buffer)
            self.stream_counts = plan.counts
        else:
            plan = build_epoch_plan(total, image, config, num_replicas=num_replicas, epoch=0)
        self.plan = plan
        flat = [ids for rank in plan.rank_packs for ids in rank]
        self.packs = Packs.from_lists(flat)
        self.rows = rows  # table row of each sample index of the packs
        feats = features_from_packs(self.packs, total, image, images)
        self.cost_ms = cost_model.pack_cost_ms(feats)
        self.images = PackImages.of(self.packs, feats, image, images, cost_model)
        self.tokens = feats["total_tokens"]
        self.image_tokens = feats["image_tokens"]
        text = feats["total_tokens"] - feats["image_tokens"]
        self.bytes = text * exchange.text_token_bytes + feats["image_tokens"] * (
            exchange.image_token_bytes
        )
        real = self.tokens > 0
        self.efficiency = (
            float(self.tokens[real].sum() / (real.sum() * seq_len)) if real.any() else 0.0
        )
        self.per_rank = plan.packs_per_rank

    def table_rows(self, draws: Sequence[np.ndarray]) -> np.ndarray:
        """The table rows of every sample in the drawn packs (a pack drawn twice counts twice)."""
        drawn = np.concatenate(list(draws)) if len(draws) else np.zeros(0, dtype=np.int64)
        sizes = self.packs.sizes()[drawn]
        starts = self.packs.offsets[drawn]
        # position j of drawn pack i: starts[i] + j, for j < sizes[i]
        first = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        return self.rows[self.packs.positions[first + np.arange(int(sizes.sum()))]]

    def replay_batches(self, world: int, ga: int, skip: int, count: int) -> list[np.ndarray]:
        """Global batches as the sampler deals them: (world*ga,) pack indices, rank-major."""
        n = self.per_rank
        out = []
        for k in range(skip, skip + count):
            if (k + 1) * ga > n:
                raise ValueError(
                    f"replay: the mix gives {n} packs per rank at dp={world}; global batch {k}"
                    f" needs {(k + 1) * ga}: use fewer batches or more data"
                )
            out.append(
                np.concatenate([r * n + np.arange(k * ga, (k + 1) * ga) for r in range(world)])
            )
        return out


@dataclass(frozen=True)
class _StreamPlan:
    rank_packs: list[list[np.ndarray]]
    packs_per_rank: int
    counts: list[int]  # each rank's packs in the epoch, before the cut to the fewest


def _stream_plan(
    total: np.ndarray, seq_len: int, num_replicas: int, seed: int, buffer: int
) -> _StreamPlan:
    """Packs as :class:`~lightning_vlmbalance.PackedStreamLoader` forms them: the mix shuffled
    once (``seed``) and dealt to the ranks (rank ``r``'s stream: every ``num_replicas``-th
    sample), each stream packed by :func:`~lightning_vlmbalance.packing.stream.pack_stream`
    with ``buffer``. Every rank keeps as many packs as the rank with the fewest (the replayed
    global batches); :func:`stream_padding_share` prices the epoch's tail."""
    order = np.random.default_rng(seed).permutation(len(total))
    ranks = []
    for r in range(num_replicas):
        shard = order[r::num_replicas]
        ranks.append([shard[p] for p in pack_stream(total[shard], seq_len, buffer=buffer)])
    n = min(len(p) for p in ranks)
    return _StreamPlan([p[:n] for p in ranks], n, [len(p) for p in ranks])


def stream_padding_share(counts: Sequence[int], G: int) -> float:
    """The share of an epoch's micro-batches that are padding packs when rank ``r``'s streams
    give ``counts[r]`` packs: global batch by global batch as ``PackedStreamLoader`` runs it
    (:func:`~lightning_vlmbalance.loaders.streaming.tail_plan`: ranks whose streams ended
    take packs from the others, up to ``G`` each, read ahead by :func:`~lightning_vlmbalance.
    loaders.streaming.hand_size`; until every rank's streams ended a rank still short pads to
    ``G``, in the last global batch to the longest)."""
    left = list(counts)
    slots = padding = 0
    ahead = hand_size(G, len(left), 0)
    while sum(left):
        hand = [min(c, ahead) for c in left]
        ended = [c < ahead for c in left]  # a rank knows its streams ended once it reads past
        final = all(ended)
        used, moves = tail_plan(hand, G, final=final)
        trained = trained_counts(used, moves)
        longest = max(trained) if final else G
        slots += longest * len(left)
        padding += longest * len(left) - sum(trained)
        left = [c - u for c, u in zip(left, used)]
        ahead = hand_size(G, len(left), sum(ended))
    return padding / slots if slots else 0.0


class _SourcePool:
    """The packs of a source-balanced sampler (:mod:`lightning_vlmbalance.balance.source`) for
    one ``(dp, ga)`` over the given table rows (the samples of ``off``'s global batches), and
    all of its global batches, as formed and placed: a whole epoch of exactly those samples
    (the last global batch padded with empty packs, as the sampler does)."""

    def __init__(
        self,
        table: LengthTable,
        rows: np.ndarray,
        seq_len: int,
        cost_model: CostModel,
        exchange: ExchangeModel,
        R: int,
        G: int,
        seed: int,
        objective: str,
        llm_only: bool = False,
    ) -> None:
        from lightning_vlmbalance.balance.source import SourceBalance, build_balanced_epoch_plan

        total = np.asarray(table.total_tokens, dtype=np.int64)[rows]
        image = np.asarray(table.image_tokens, dtype=np.int64)[rows]
        images = np.asarray(table.images, dtype=np.int64)[rows]
        plan = build_balanced_epoch_plan(
            total,
            image,
            images,
            PackingConfig(seq_len=seq_len, seed=seed, overlong="skip"),
            num_replicas=R,
            epoch=0,
            balance=SourceBalance(
                micro_steps=G,
                objective="step" if objective == "step" else "microstep",
                llm_only=llm_only,
            ),
            cost_model=cost_model,
        )
        flat, self.draws = [], []
        for k in range(plan.packs_per_rank // G):
            idx = []
            for r in range(R):
                for m in range(G):
                    idx.append(len(flat))
                    flat.append(plan.rank_packs[r][k * G + m])
            self.draws.append(np.asarray(idx, dtype=np.int64))
        packs = Packs.from_lists(flat)
        feats = features_from_packs(packs, total, image, images)
        self.cost_ms = cost_model.pack_cost_ms(feats)
        self.cost_ms[feats["total_tokens"] == 0] = 0.0
        self.images = PackImages.of(packs, feats, image, images, cost_model)
        # a lower bound's term: the heaviest sample of each pack, as a pack of its own
        alone = Packs(np.arange(len(total)), np.arange(len(total) + 1))
        sample_ms = cost_model.pack_cost_ms(features_from_packs(alone, total, image, images))
        self.heaviest_ms = np.zeros(len(packs))
        full = packs.sizes() > 0
        self.heaviest_ms[full] = np.maximum.reduceat(
            sample_ms[packs.positions], packs.offsets[:-1][full]
        )
        self.tokens = feats["total_tokens"]
        self.bytes = (feats["total_tokens"] - feats["image_tokens"]) * exchange.text_token_bytes
        self.bytes += feats["image_tokens"] * exchange.image_token_bytes
        real = self.tokens > 0
        self.efficiency = float(self.tokens[real].sum() / (real.sum() * seq_len))


@renamed_keyword("strategies", "modes", " (the rebalancing modes, as `RebalanceConfig.mode`)")
def simulate(
    table: LengthTable,
    *,
    seq_len: int,
    cost_model: CostModel | None = None,
    dp: Sequence[int] = (8, 64, 512),
    ga: Sequence[int] = (1, 8),
    modes: Sequence[str] | None = None,
    exchange: ExchangeModel | None = None,
    batches: int = 32,
    seed: int = 0,
    sync_every: str = "step",
    image_budget: int | None = None,
    replay: bool = False,
    replay_skip: int = 0,
    step_overhead: StepOverhead | None = None,
    progress: Callable[[int], Any] | None = None,
    rebalance: RebalanceConfig | None = None,
    stream_buffer: int | None = None,
    jitter: float = 0.0,
) -> list[dict[str, Any]]:
    """Simulates every (mode, dp, ga); see the module docstring.

    Args:
        table: the data mix (e.g. :func:`~lightning_vlmbalance.read_length_csv` after
            :func:`~lightning_vlmbalance.synthetic.resample_text_share`).
        seq_len: tokens per pack.
        cost_model: per-pack cost (default :class:`CostModel`; calibrate with ``CostModel.fit``).
        dp, ga: data-parallel sizes and micro-steps per optimizer step.
        modes: the rebalancing modes to compare, any of :data:`ALL_MODES`; default
            :data:`MODES` (``off``, ``sync``, ``overlap``, ``budget``). (``strategies=``: the
            deprecated name, still works with a FutureWarning.)
        exchange: the exchange cost model.
        batches: global batches per configuration (``source`` runs the global batches that
            the samples of these form).
        seed: seed of the packing shuffle and of the batch draws (same seed, same rows).
        sync_every: ``"step"`` or ``"microstep"`` (see the module docstring).
        image_budget: image tokens per pack of ``budget`` (default: the mean image tokens of a
            greedy pack, rounded up).
        replay: deal batches as the distributed sampler does instead of drawing them.
        replay_skip: global batches to skip first (warm-up) in replay mode.
        step_overhead: fixed time per optimizer step beyond the slowest rank (default none).
        progress: called with 1 after each global batch (e.g. a progress bar's ``update``).
        rebalance: the planner's objective and tolerance, as the strategy would use them
            (:class:`~lightning_vlmbalance.balance.config.RebalanceConfig`; ``"auto"`` follows
            ``sync_every``). Its ``mode`` is not used: ``modes`` lists the modes to compare.
        stream_buffer: pack as a streamed dataset is packed (each rank its own shard of the
            shuffled mix, in windows of this many samples: ``PackedStreamLoader``) instead of
            the map-style sampler's global plan, for every mode but ``budget`` and
            ``source``; rows then have ``stream_tail_frac``, the padding packs' share of the
            epoch's micro-batches (:func:`stream_padding_share`).
        jitter: the relative error of the cost model's time of each piece of work (standard
            deviation over the value, independent between ranks): the plans and ``auto``'s
            choices are made on the predicted times, and each step is the expected step of
            times off by that much (every meeting the ranks' expected maximum:
            :func:`~lightning_vlmbalance.balance.choice.met_step_ms`). 0: the predicted times
            are the times. The main job's is about its cost model's held-out error.

    Returns:
        One dict per configuration: ``mode``, ``dp``, ``ga``, ``step_ms`` (mean),
        ``step_p95_ms``, ``ideal_step_ms`` (every rank at the mean load), ``waste_frac``
        (1 - ideal / step), ``batches`` (global batches run), ``tokens`` (tokens in them),
        ``samples`` (``"off"``: the samples of ``off``'s global batches; ``"own"``: ``budget``'s
        own draws; see the module docstring), ``tokens_per_s_per_rank`` (the whole run's tokens
        over its time), ``packing_efficiency``, ``moved_packs`` (mean per global batch),
        ``exposed_exchange_ms``, ``gain`` (tokens/s over ``off``'s, minus 1: on the same tokens
        where ``samples="off"``; for ``budget`` its fuller-but-fewer packs count; ``None``
        without ``off``), ``closed_form_waste`` (``off`` only), and for ``source``
        ``bound_step_ms`` and ``waste_vs_bound``.

    Raises:
        ValueError: for an unknown mode or ``sync_every``, or a mix too small to replay.
    """
    modes = MODES if modes is None else modes
    _check_arguments(table, dp, ga, modes, batches, sync_every)
    overhead = step_overhead or StepOverhead()
    plan = (rebalance or RebalanceConfig()).resolved(
        sync_every_micro_batch=sync_every == "microstep"
    )
    pools = _PoolCache(
        table,
        seq_len,
        cost_model or CostModel(),
        exchange or ExchangeModel(),
        seed,
        replay,
        image_budget,
        stream_buffer,
    )
    rows: list[dict[str, Any]] = []
    for R in dp:
        for G in ga:
            rows.extend(
                _configuration_rows(
                    pools,
                    R,
                    G,
                    modes,
                    batches=batches,
                    replay_skip=replay_skip,
                    sync_every=sync_every,
                    plan=plan,
                    overhead_ms=overhead(R),
                    progress=progress,
                    jitter=jitter,
                )
            )
    return rows


def _check_arguments(
    table: LengthTable,
    dp: Sequence[int],
    ga: Sequence[int],
    modes: Sequence[str],
    batches: int,
    sync_every: str,
) -> None:
    """:func:`simulate`'s arguments as it needs them, or the ValueError it documents."""
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise ValueError(f"simulate(modes={list(modes)}): expected some of {ALL_MODES}")
    if sync_every not in SYNC_EVERY:
        raise ValueError(f"simulate(sync_every={sync_every!r}): expected one of {SYNC_EVERY}")
    if batches < 1 or min(dp) < 1 or min(ga) < 1:
        raise ValueError("simulate: batches, dp and ga must be >= 1")
    _check_table(table)


class _PoolCache:
    """The pack pools of one :func:`simulate` call, each built once, when first asked for:
    one per packer, and per data-parallel size only in replay mode (drawn batches use one
    pool of the whole mix for every ``dp``)."""

    def __init__(
        self,
        table: LengthTable,
        seq_len: int,
        cost_model: CostModel,
        exchange: ExchangeModel,
        seed: int,
        replay: bool,
        image_budget: int | None,
        stream_buffer: int | None,
    ) -> None:
        self.table = table
        self.seq_len = seq_len
        self.cost_model = cost_model
        self.exchange = exchange
        self.seed = seed
        self.replay = replay
        self.image_budget = image_budget
        self.stream_buffer = stream_buffer
        self._pools: dict[tuple[str, int], _Pool] = {}

    def get(self, packer: str, world: int) -> _Pool:
        """The pool of ``packer`` (``"greedy"`` or ``"budget"``) for ``world`` ranks."""
        key = (packer, world if self.replay else 1)
        if key not in self._pools:
            budget = None
            if packer == "budget":
                budget = self.image_budget or _default_budget(self.get("greedy", world))
            self._pools[key] = _Pool(
                self.table,
                self.seq_len,
                self.cost_model,
                self.exchange,
                key[1],
                self.seed,
                packer,
                budget,
                stream_buffer=self.stream_buffer if packer == "greedy" else None,
            )
        return self._pools[key]


def _configuration_rows(
    pools: _PoolCache,
    R: int,
    G: int,
    modes: Sequence[str],
    *,
    batches: int,
    replay_skip: int,
    sync_every: str,
    plan: RebalanceConfig,
    overhead_ms: float,
    progress: Callable[[int], Any] | None,
    jitter: float = 0.0,
) -> list[dict[str, Any]]:
    """The rows of every mode at one ``(dp, ga) = (R, G)``, with their gains over ``off``.
    ``source`` and ``encoder_source`` share one source pool, formed from ``off``'s samples."""
    sync_objective = "step" if sync_every == "step" else "microstep"  # how step time adds up
    group = []
    sources: dict[bool, _SourcePool] = {}  # by llm_only (built once each)

    def source_pool(llm_only: bool = False) -> _SourcePool:  # off's samples, re-formed
        if llm_only not in sources:
            greedy = pools.get("greedy", R)
            rows_of_off = greedy.table_rows(
                _draws(greedy, R, G, batches, pools.seed, pools.replay, replay_skip)
            )
            sources[llm_only] = _SourcePool(
                pools.table,
                rows_of_off,
                pools.seq_len,
                pools.cost_model,
                pools.exchange,
                R,
                G,
                pools.seed,
                plan.objective,
                llm_only=llm_only,
            )
        return sources[llm_only]

    def run(mode: str, p: _Pool | _SourcePool, draws: list[np.ndarray], **kw: Any) -> dict:
        return _run(
            mode,
            p,
            draws,
            R,
            G,
            sync_objective,
            plan,
            pools.exchange,
            overhead_ms,
            progress,
            jitter=jitter,
            **kw,
        )

    for mode in modes:
        if mode in ("source", "encoder_source"):
            # by every phase's cost (as the runtime forms them outside "auto", which prices
            # the language model's alone too)
            p = source_pool()
            row = run(mode, p, p.draws)
        elif mode == "auto":
            row = _auto_row(pools, source_pool, R, G, batches, replay_skip, run)
            p = pools.get("greedy", R)
        else:
            p = pools.get("budget" if mode == "budget" else "greedy", R)
            row = run(mode, p, _draws(p, R, G, batches, pools.seed, pools.replay, replay_skip))
        row["samples"] = "own" if mode == "budget" else "off"
        if pools.stream_buffer is not None and mode not in (
            "budget",
            "source",
            "encoder_source",
        ):
            row["stream_tail_frac"] = stream_padding_share(p.stream_counts, G)
        group.append(row)
    _add_gains(group, pools.get("greedy", R).cost_ms, R, G, sync_every)
    return group


def _auto_row(
    pools: _PoolCache,
    source: Callable[[bool], _SourcePool],
    R: int,
    G: int,
    batches: int,
    replay_skip: int,
    run: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """``auto``: every global batch takes the cheapest option (``choose_step``), and the epoch
    is packed as the samples come, formed at the source by every phase's cost, or formed by
    the language model's alone (the images then routed), whichever the simulator predicts
    fastest on the same samples (what the runtime decides per epoch from its plans:
    :mod:`~lightning_vlmbalance.balance.epoch_choice`). Every option is open on each."""
    greedy = pools.get("greedy", R)
    rows = {
        "plain": run(
            "auto", greedy, _draws(greedy, R, G, batches, pools.seed, pools.replay, replay_skip)
        )
    }
    for name, llm_only in (("formed", False), ("formed_llm", True)):
        p = source(llm_only)
        rows[name] = run("auto", p, p.draws)
    # the fastest; ties to the one that changes the order least (plain, then formed)
    name = max(rows, key=lambda k: (rows[k]["tokens_per_s_per_rank"], -list(rows).index(k)))
    row = rows[name]
    row["formed_at_source"] = name != "plain"
    row["formed_by"] = {"plain": None, "formed": "all", "formed_llm": "llm"}[name]
    if name == "plain":
        row.pop("bound_step_ms", None)
        row.pop("waste_vs_bound", None)
    return row


def _check_table(table: LengthTable) -> None:
    """The length table's columns agree, or a ValueError naming the first bad sample."""
    total = as_length_column(table.total_tokens, "total_tokens")
    image = as_length_column(table.image_tokens, "image_tokens")
    check_length_table(total, image)
    check_image_counts(as_length_column(table.images, "images"), image)


def _draws(
    p: _Pool, R: int, G: int, batches: int, seed: int, replay: bool, replay_skip: int
) -> list[np.ndarray]:
    """The global batches (pack indices into the pool) of one (dp, ga) configuration."""
    if replay:
        return p.replay_batches(R, G, replay_skip, batches)
    rng = np.random.default_rng([seed, R, G])
    real = np.flatnonzero(p.tokens > 0)
    return [rng.choice(real, size=R * G) for _ in range(batches)]


def _add_gains(
    group: list[dict[str, Any]], cost_ms: np.ndarray, R: int, G: int, sync_every: str
) -> None:
    """Each row's tokens/s gain over ``off`` (same dp, ga), and the closed form on ``off``."""
    off = next((r for r in group if r["mode"] == "off"), None)
    for row in group:
        row["gain"] = (
            row["tokens_per_s_per_rank"] / off["tokens_per_s_per_rank"] - 1.0
            if off and off["tokens_per_s_per_rank"]
            else None
        )
        if row["mode"] == "off":
            c = cost_ms[cost_ms > 0]
            row["closed_form_waste"] = closed_form_waste(
                float(c.mean()), float(c.std()), R, G, sync_every
            )


def _default_budget(greedy: _Pool) -> int:
    """Mean image tokens of a greedy pack, rounded up: the budget that keeps the same images."""
    real = greedy.tokens > 0
    return max(1, math.ceil(float(greedy.image_tokens[real].mean()))) if real.any() else 1


def _inputs(p: _Pool | _SourcePool, draw: np.ndarray, R: int) -> StepInputs:
    """One drawn global batch of a pool as :func:`~lightning_vlmbalance.balance.choice.
    choose_step` prices it (each image's cost and tokens from the pool's ``PackImages``)."""
    return StepInputs.of_pack_images(p.images, p.cost_ms, p.bytes, draw, R)


_REORDER = {"encoder": False, "encoder_overlap": True, "encoder_source": False}


def _priced(
    mode: str,
    p: _Pool | _SourcePool,
    draw: np.ndarray,
    R: int,
    meets: bool,
    plan_config: RebalanceConfig,
    exchange: ExchangeModel,
    options: Sequence[str],
    jitter: float = 0.0,
) -> tuple[float, float, float, float, str]:
    """One global batch of ``mode``: its step (compute as the ranks meet, and the exposed
    part of the off-path work), the exposed part alone, packs moved, images moved, and the
    option ``auto`` took (the mode's own otherwise). Every mode is priced by the functions
    ``mode="auto"`` decides with (:mod:`~lightning_vlmbalance.balance.choice`); plans and
    choices on the predicted times, the step off by ``jitter`` (``simulate``)."""
    transfer = exchange.transfer
    inputs = _inputs(p, draw, R)
    if R == 1 or mode in ("off", "budget", "source"):
        placed = price_placed(inputs, meets_every_micro_batch=meets, jitter=jitter)
        return placed, 0.0, 0.0, 0.0, "placed"
    if mode == "auto":
        choice = choose_step(
            inputs,
            options=options,
            objective=plan_config.objective,
            meets_every_micro_batch=meets,
            threaded=True,
            transfer=transfer,
            tolerance=plan_config.tolerance,
            plan_ms=exchange.plan_ms,
        )
        packs = len(choice.pack_plan.moves) if choice.pack_plan is not None else 0
        images = choice.routing.moved_images if choice.routing is not None else 0
        step, exposed = choice.step_ms, choice.exposed_ms
        if jitter > 0:  # chosen on the predicted times, run on times off by the jitter
            step, exposed = price_taken(
                choice,
                inputs,
                transfer,
                meets_every_micro_batch=meets,
                threaded=True,
                plan_ms=exchange.plan_ms,
                jitter=jitter,
            )
        return step, exposed, float(packs), float(images), choice.option
    if mode in ("sync", "overlap"):
        plan = plan_rebalance(
            np.rint(inputs.pack_ms * 1000.0).astype(np.int64),
            np.repeat(np.arange(R, dtype=np.int64), inputs.micro_steps),
            R,
            inputs.micro_steps,
            objective=plan_config.objective,
            tolerance=plan_config.tolerance,
        )
        step, exposed = price_packs(
            inputs,
            plan,
            transfer,
            meets_every_micro_batch=meets,
            threaded=mode == "overlap",
            plan_ms=exchange.plan_ms,
            jitter=jitter,
        )
        return step, exposed, float(len(plan.moves)), 0.0, "packs"
    routing = route_images(
        inputs.llm_ms,
        inputs.image_ms,
        inputs.image_tokens,
        inputs.counts,
        inputs.per_call_ms,
        R,
        reorder=_REORDER[mode] and inputs.micro_steps > 1,
    )
    step, exposed = price_routing(
        routing,
        transfer,
        meets_every_micro_batch=meets,
        threaded=True,
        plan_ms=exchange.plan_ms,
        jitter=jitter,
    )
    return step, exposed, 0.0, float(routing.moved_images), "images"


def _run(
    mode: str,
    p: _Pool | _SourcePool,
    draws: list[np.ndarray],
    R: int,
    G: int,
    objective: str,
    plan_config: RebalanceConfig,
    exchange: ExchangeModel,
    overhead_ms: float,
    progress: Callable[[int], Any] | None,
    options: Sequence[str] = OPTIONS,
    jitter: float = 0.0,
) -> dict[str, Any]:
    steps, ideals, moved, exposed, tokens, bounds = [], [], [], [], [], []
    images_moved: list[float] = []
    chosen: dict[str, int] = {}
    meets = objective != "step"
    for draw in draws:
        step, exposed_ms, packs, n_images, option = _priced(
            mode, p, draw, R, meets, plan_config, exchange, options, jitter
        )
        chosen[option] = chosen.get(option, 0) + 1
        steps.append(step + overhead_ms)
        exposed.append(exposed_ms)
        moved.append(packs)
        images_moved.append(n_images)
        cost = p.cost_ms[draw]
        ideals.append(float(cost.sum()) / R)
        if mode in ("source", "auto") and isinstance(p, _SourcePool):
            # no step is shorter than its heaviest sample
            bounds.append(max(ideals[-1], float(p.heaviest_ms[draw].max())))
        tokens.append(float(p.tokens[draw].sum()))
        if progress is not None:
            progress(1)
    # whole-run figures: tokens/s is the total tokens over the total time (source may run a
    # different number of global batches over the same samples)
    step_ms = float(np.mean(steps))
    ideal = float(np.mean(ideals))
    extra: dict[str, Any] = {}
    if bounds:
        bound = float(np.mean(bounds))
        extra = {"bound_step_ms": bound, "waste_vs_bound": 1.0 - bound / step_ms}
    if mode == "auto":
        extra["choices"] = chosen
    return {
        "mode": mode,
        "dp": R,
        "ga": G,
        "step_ms": step_ms,
        "step_p95_ms": float(np.percentile(steps, 95)),
        "ideal_step_ms": ideal,
        "waste_frac": 1.0 - ideal / step_ms if step_ms > 0 else 0.0,
        "batches": len(steps),
        "tokens": int(np.sum(tokens)),
        "tokens_per_s_per_rank": float(np.mean(tokens)) / R / (step_ms / 1e3) if step_ms else 0.0,
        "packing_efficiency": p.efficiency,
        "moved_packs": float(np.mean(moved)) if moved else 0.0,
        "moved_images": float(np.mean(images_moved)) if images_moved else 0.0,
        "exposed_exchange_ms": float(np.mean(exposed)),
        **extra,
    }
