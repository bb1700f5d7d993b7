"""The field's published balancing algorithms as baselines in our simulator, beside our modes.

Every algorithm is run on the same data, the same packs where it keeps packs, the same cost
model and the same exchange model as :func:`lightning_vlmbalance.sim.simulate` uses for our
modes, and (where it re-forms samples) on exactly the samples of the global batches that
``off`` draws. Our implementations of the peers are written from our reading of their code or
paper (sources below); the peer plans with its own cost notion, and its step is priced with
ours.

Peers (``algorithm``):

- ``veomni``: ByteDance-Seed/VeOmni ``veomni/utils/data_balance/balance_sorting_algo.py``,
  ``post_mbs_balancing_greedy_without_pad`` (used by ``data_balance.py``,
  ``Qwen3VLEncoderDataBalance``). An image routing of ``off``'s packs: at every micro-step the
  images of the ranks' packs go, longest first, to the rank with the least sum of squared
  lengths (the first ``dp`` images one per rank), wherever their home is. The packs stay; a
  micro-step lasts the slowest language model plus the slowest encoder load (every rank pays
  the encoder's per-call cost), as in our ``encoder`` mode; VeOmni moves the pixels, the
  embeddings and their gradients with all-to-alls inside the forward and backward, so all
  three transfers and its two length all-gathers are on the step path.
- ``omnibal`` and ``omnibal@mixcaps``: ModelTC/OmniBal ``dataset.py``, ``BalancedDataset``
  (``_random_groups``, ``iter_random_groups``): iterative sampling and filtering. Shuffle,
  group by next fit under a vision cap and a text cap, keep a group whose vision load equals
  its threshold or whose tokens reach the text threshold, re-shuffle and re-group the rest,
  ``iter_time`` rounds. ``omnibal`` scales the repository's defaults (4,096 tokens, threshold
  4,050, 9 tiles, 10 rounds) to the pack length; ``omnibal@mixcaps`` takes the vision cap from
  the mix as OmniBal's ``test_balanced_dynamic_batch.py`` (``get_init_llm_vit_len``) starts its
  search, with the text threshold 128 below the cap as its search uses. Vision load is counted
  in tiles of 256 image tokens (InternVL's ``vit_num``). Groups are the packs, dealt to ranks
  in random order (OmniBal's sampler is random over groups).
- ``megatron``: NVIDIA/Megatron-LM ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``,
  ``BalancedCPScheduler`` (called from ``megatron/core/datasets/data_schedule.py``,
  ``HybridCPDataLoaderWrapper``): every rank all-gathers the global batch's sample lengths;
  samples, longest first, go to the least loaded rank by ``L^2 / cp`` (``cp = 1`` here: every
  sample fits one rank), then each rank packs its samples into micro-batches (first fit
  decreasing into packs of the pack length; the micro-step count is the largest rank's). The
  samples are moved by an all-to-all (text and pixels) before the step: on the step path.
- ``nemo_automodel``: NVIDIA-NeMo/Automodel
  ``nemo_automodel/components/datasets/vlm/neat_packing_vlm.py``,
  ``greedy_knapsack_vt_balanced`` (its FFD is ``greedy_knapsack`` in
  ``components/datasets/llm/neat_packing.py``: longest first, each sample to the least filled
  bin if it fits, else a new bin, i.e. worst fit decreasing), then bins sorted by visual tokens,
  dealt by a ``DistributedSampler`` without shuffling (``shuffle=False``: the setting in which
  the sort reaches the ranks) so that the ranks of a micro-step hold consecutive bins.
  ``nemo_automodel@shuffle``: the same bins with the loader's default ``shuffle=True``
  (``VlmDataloaderConfig.shuffle``), which deals them in random order.
- ``wlb_llm`` and ``wlb_llm+vision``: WLB-LLM (Wang et al., OSDI 2025, arXiv 2503.17924),
  Algorithm 1, workload-aware variable-length packing (no public code): per global batch,
  documents longer than an outlier threshold wait in a multi-level queue until a level holds
  one per micro-batch; the batch's documents (those deferred before first, then the new ones,
  each longest first) go to the micro-batch of least workload if they fit under ``S_max`` (the
  pack length here), else to the shortest micro-batch if they fit, else to the next batch.
  ``wlb_llm`` estimates workload as the paper does for a language model, attention ``a L^2``
  plus linear ``b L`` (``a``, ``b``: our cost model's language-model coefficients);
  ``wlb_llm+vision`` gives it our whole per-sample cost (vision included), to separate the
  algorithm from its cost notion. Micro-batch ``j`` runs on rank ``j // ga``.

Our rows (``ours:<mode>``) come from :func:`~lightning_vlmbalance.sim.simulate` itself for
``off, overlap, source, encoder, encoder_overlap, encoder_source`` and ``auto`` when the
simulator has it.

Same samples: ``off`` draws ``batches`` global batches of packs (with replacement from the
mix's packs, as the simulator does); ``veomni`` routes the images of exactly those packs;
``megatron`` re-balances the samples of each of those global batches; ``omnibal``,
``nemo_automodel`` and ``wlb_llm`` re-form all of their samples (a pack drawn twice gives its
samples twice) into their own packs and global batches (the last one padded with empty packs,
as our ``source`` does; ``wlb_llm`` may need extra batches for what it defers). Every row
trains every sample occurrence of ``off``'s batches exactly once; each peer row's
``trained_once`` is that check, made on the packs that were priced.

Pricing (as the simulator prices our modes): a pack costs ``CostModel.pack_cost_ms`` (an empty
padding pack 0); one synchronisation per optimizer step (``vlmbalance``): step = max over ranks
of the sum; per micro-step (``fsdp_vlmbalance``): the sum over micro-steps of the max; transfers
by :meth:`ExchangeModel.transfer_ms`. ``waste_frac = 1 - mean ideal / mean step`` (ideal: the
mean rank's load), ``tokens_per_s_per_rank``: the run's mean tokens per global batch over
``dp`` and the mean step. ``moved_bytes`` (mean per global batch, all ranks together) =
``payload_bytes`` (samples, packs, pixels, embeddings and their gradients that cross ranks)
+ ``gather_bytes`` (metadata all-gathers: what every rank receives, summed over ranks). For our
modes the payload is estimated from the simulator's ``moved_packs`` and ``moved_images`` times
the drawn packs' mean bytes and the drawn images' mean tokens (``moved_bytes_estimated``).
``planning_ms``: measured wall time per global batch on this machine, single thread, of the
peer's planning (not its pricing) as implemented here in Python; for our modes, the
simulator's time for the mode per global batch (planning and pricing; ``source`` includes
forming its epoch).

Commands (from the repository root)::

    python benchmarks/peers.py --json                       # the whole default grid
    python benchmarks/peers.py --mixes all5 --dp 1024 --ga 8 --text-shares 0.3
    python benchmarks/peers.py --quick --json               # a tiny configuration (tests)

With ``--json`` the last line of stdout is one JSON object: ``rows``, ``summary`` (per
configuration: the best peer, our best fixed mode and ``auto``, and their ratios), ``checks``
and the run's metadata.
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import add_json_flag, print_json, stamp
from packing import DEFAULT_FILES, SHARED_DATA

from lightning_vlmbalance.balance.cost import CostModel, sample_features
from lightning_vlmbalance.packing import Packs
from lightning_vlmbalance.sim.cli import comma_list
from lightning_vlmbalance.synthetic import (
    LengthTable,
    read_length_csv,
    resample_text_share,
    synthetic_length_table,
)

# the module (the package's ``sim`` namespace exports the function under the same name)
SIM = importlib.import_module("lightning_vlmbalance.sim.simulate")

TEXT_FILE = "multipack/openchat_text.csv"
ALL5 = "all5"
MIXES = ("ai2d", "chartqa", "docvqa", "synthdog", ALL5)
STRATEGIES = {"vlmbalance": "step", "fsdp_vlmbalance": "microstep"}
OUR_MODES = ("off", "overlap", "source", "encoder", "encoder_overlap", "encoder_source")
PEERS = (
    "veomni",
    "omnibal",
    "omnibal@mixcaps",
    "megatron",
    "nemo_automodel",
    "nemo_automodel@shuffle",
    "wlb_llm",
    "wlb_llm+vision",
)
TILE_TOKENS = 256  # InternVL: image tokens per tile (OmniBal's vit_num counts tiles)
FEATURE_ROW_BYTES = 48  # our runtime all-gathers 6 int64 per pack (cost features, loss tokens)


class BenchmarkError(Exception):
    """A configuration the benchmark cannot run (reported, exit status 2)."""


# -- data ----------------------------------------------------------------------------------


def mix_files() -> dict[str, list[Path]]:
    """The five shared mixes: each omnibal set with the chat text, and all five files."""
    files = [SHARED_DATA / name for name in DEFAULT_FILES]
    if not all(f.is_file() for f in files):
        return {}
    text = SHARED_DATA / TEXT_FILE
    mixes = {f.stem.split("_")[0]: [f, text] for f in files if f != text}
    mixes[ALL5] = files
    return mixes


@dataclass
class Mix:
    """One mix at one text share: its length table, per-sample features and costs, and the
    simulator's pool of plain packs (the pool ``simulate`` builds for drawn batches)."""

    name: str
    share: float
    table: LengthTable
    pool: Any
    feats: dict[str, np.ndarray]
    sample_ms: np.ndarray  # each sample's additive cost (no per-pack terms), our cost model
    llm_workload: np.ndarray  # WLB-LLM's a L^2 + b L with our model's language-model terms
    sample_bytes: np.ndarray  # bytes of a sample on the wire (text ids + pixels)

    @property
    def total(self) -> np.ndarray:
        return self.feats["total_tokens"]

    @property
    def image(self) -> np.ndarray:
        return self.feats["image_tokens"]


def load_mix(
    name: str,
    files: list[Path] | None,
    share: float,
    args: argparse.Namespace,
    cost_model: CostModel,
    exchange: Any,
) -> Mix:
    if files is None:  # no shared data: a synthetic mix of the same shape
        table = synthetic_length_table(args.synthetic_samples, text_share=share, seed=args.seed)
    else:
        table = resample_text_share(read_length_csv(*files), share, args.seed)
    total = np.asarray(table.total_tokens, dtype=np.int64)
    if (total > args.seq_len).any():
        raise BenchmarkError(f"{name}: samples longer than --seq-len {args.seq_len}")
    pool = SIM._Pool(table, args.seq_len, cost_model, exchange, 1, args.seed)
    feats = sample_features(total, table.image_tokens, table.images)
    additive, _, _ = cost_model.additive_cost_ms(feats)
    c = cost_model.coefficients
    a = sum(c[p]["doc_sq_tokens"] for p in ("llm_fwd", "llm_bwd"))
    b = sum(c[p]["total_tokens"] for p in ("llm_fwd", "llm_bwd"))
    length = total.astype(np.float64)
    text = total - feats["image_tokens"]
    nbytes = text * exchange.text_token_bytes + feats["image_tokens"] * exchange.image_token_bytes
    return Mix(
        name=name,
        share=share,
        table=table,
        pool=pool,
        feats=feats,
        sample_ms=additive,
        llm_workload=a * length * length + b * length,
        sample_bytes=nbytes.astype(np.float64),
    )


@dataclass
class Batches:
    """The samples of ``off``'s global batches, one entry per occurrence (a sample in a pack
    drawn twice occurs twice), in draw order: its table row, origin rank, and ``off``'s pack
    (slot ``r * ga + m`` of its global batch); batch ``k`` is ``starts[k]:starts[k + 1]``."""

    draws: list[np.ndarray]
    rows: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, pool: Any, draws: list[np.ndarray], G: int) -> Batches:
        sizes = [pool.packs.sizes()[d] for d in draws]
        rows = pool.table_rows(draws)
        slot = np.concatenate([np.repeat(np.arange(len(s)), s) for s in sizes])
        starts = np.concatenate([[0], np.cumsum([s.sum() for s in sizes])])
        return cls(draws, rows, slot // G, slot, starts.astype(np.int64))

    def __len__(self) -> int:
        return len(self.rows)


# -- pricing (the simulator's rules) ---------------------------------------------------------


def step_time(compute: np.ndarray, objective: str) -> float:
    """``(R, M)`` pack costs: max over ranks of the sum (one meeting per optimizer step), or
    the sum over micro-steps of the max (a meeting in every micro-step)."""
    if objective == "step":
        return float(compute.sum(axis=1).max())
    return float(compute.max(axis=0).sum())


def allgather_ms(exchange: Any, world: int, nbytes_per_rank: float, calls: int) -> float:
    """An all-gather's time: every rank receives the others' bytes over its bandwidth, and
    each call pays ``log2(world)`` latencies (a tree or recursive-doubling algorithm)."""
    if world <= 1:
        return 0.0
    latency = exchange.latency_ms * math.ceil(math.log2(world)) * calls
    return latency + (world - 1) * nbytes_per_rank / (exchange.bandwidth_gb_s * 1e6)


@dataclass
class Tally:
    """One algorithm's run over its global batches."""

    steps: list[float] = field(default_factory=list)
    ideals: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    payload: list[float] = field(default_factory=list)
    gather: list[float] = field(default_factory=list)
    path_ms: list[float] = field(default_factory=list)
    plan_s: float = 0.0
    pack_tokens: list[np.ndarray] = field(default_factory=list)  # every nonempty pack's tokens
    trained: list[np.ndarray] = field(default_factory=list)  # occurrence ids of priced packs

    def add(
        self,
        step: float,
        ideal: float,
        tokens: float,
        payload: float = 0.0,
        gather: float = 0.0,
        path: float = 0.0,
    ) -> None:
        self.steps.append(step + path)
        self.ideals.append(ideal)
        self.tokens.append(tokens)
        self.payload.append(payload)
        self.gather.append(gather)
        self.path_ms.append(path)

    def row(self, R: int, seq_len: int, n_occurrences: int, efficiency: float | None) -> dict:
        step = float(np.mean(self.steps))
        ideal = float(np.mean(self.ideals))
        sizes = np.concatenate(self.pack_tokens) if self.pack_tokens else np.zeros(0)
        counts = np.bincount(np.concatenate(self.trained), minlength=n_occurrences)
        return {
            "batches": len(self.steps),
            "tokens": round(sum(self.tokens)),
            "step_ms": step,
            "ideal_step_ms": ideal,
            "waste_frac": 1.0 - ideal / step if step > 0 else 0.0,
            "tokens_per_s_per_rank": float(np.mean(self.tokens)) / R / (step / 1e3),
            "packing_efficiency": (
                efficiency
                if efficiency is not None
                else float(sizes.sum() / (len(sizes) * seq_len))
            ),
            "payload_bytes": float(np.mean(self.payload)),
            "gather_bytes": float(np.mean(self.gather)),
            "moved_bytes": float(np.mean(self.payload) + np.mean(self.gather)),
            "step_path_transfer_ms": float(np.mean(self.path_ms)),
            "planning_ms": self.plan_s * 1e3 / len(self.steps),
            "trained_once": bool(len(counts) == n_occurrences and (counts == 1).all()),
            "max_pack_tokens": int(sizes.max()) if len(sizes) else 0,
            "moved_bytes_estimated": False,
        }


class Pricer:
    """Prices packs of sample occurrences with the mix's per-sample features."""

    def __init__(self, mix: Mix, occ: Batches, cost_model: CostModel) -> None:
        self.feats = {k: v[occ.rows] for k, v in mix.feats.items()}
        self.cost_model = cost_model

    def packs(self, packs: Packs, R: int, M: int, objective: str) -> tuple[float, float, float]:
        """``R * M`` packs of occurrence ids, rank-major: the step's compute, the ideal (mean
        rank load) and the tokens."""
        feats = {k: packs.tokens(v) for k, v in self.feats.items()}
        cost = self.cost_model.pack_cost_ms(feats)
        tokens = feats["total_tokens"]
        cost[tokens == 0] = 0.0  # an empty (padding) pack computes nothing
        return step_time(cost.reshape(R, M), objective), float(cost.sum()) / R, float(tokens.sum())

    def record(self, tally: Tally, packs: Packs) -> None:
        tokens = packs.tokens(self.feats["total_tokens"])
        tally.pack_tokens.append(tokens[tokens > 0])
        tally.trained.append(packs.positions)


def packs_of(labels: np.ndarray, n_packs: int) -> Packs:
    """Occurrence ``i`` in pack ``labels[i]`` (kept in their order within a pack)."""
    order = np.argsort(labels, kind="stable")
    offsets = np.zeros(n_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(labels, minlength=n_packs), out=offsets[1:])
    return Packs(positions=order.astype(np.int64), offsets=offsets)


def run_slots(
    plan_s: float,
    pricer: Pricer,
    bin_of: np.ndarray,
    slot_of_bin: np.ndarray,
    R: int,
    G: int,
    objectives: Sequence[str],
) -> dict[str, Tally]:
    """Prices packs dealt to slots (``slot = k * R * G + r * G + m``), one tally per objective
    (the same packs priced under each synchronisation)."""
    per_batch = R * G
    K = max(1, math.ceil((int(slot_of_bin.max()) + 1) / per_batch)) if len(slot_of_bin) else 1
    labels = slot_of_bin[bin_of]
    packs = packs_of(labels, K * per_batch)
    out = {o: Tally(plan_s=plan_s) for o in objectives}
    for k in range(K):
        sub = Packs(packs.positions, packs.offsets[k * per_batch : (k + 1) * per_batch + 1])
        sub = Packs(sub.positions[sub.offsets[0] : sub.offsets[-1]], sub.offsets - sub.offsets[0])
        for o in objectives:
            busy, ideal, tokens = pricer.packs(sub, R, G, o)
            out[o].add(busy, ideal, tokens)
        for o in objectives:
            pricer.record(out[o], sub)
    return out


# -- the peers' planners --------------------------------------------------------------------


def veomni_assign(lengths: np.ndarray, R: int) -> np.ndarray:
    """VeOmni's ``post_mbs_balancing_greedy_without_pad`` as we read it: images by length,
    longest first; the first ``R`` one to each rank in order, then each to the rank of least
    summed ``length^2`` (the first such rank). Returns each image's rank."""
    n = len(lengths)
    order = np.argsort(-lengths, kind="stable")
    sq = lengths.astype(np.int64) ** 2
    enc = np.empty(n, dtype=np.int64)
    first = min(R, n)
    enc[order[:first]] = np.arange(first)
    heap = [(int(sq[order[i]]), i) for i in range(first)] + [(0, r) for r in range(first, R)]
    heapq.heapify(heap)
    squares = sq.tolist()
    for i in order[first:].tolist():
        load, r = heap[0]
        enc[i] = r
        heapq.heapreplace(heap, (load + squares[i], r))
    assert len(enc) == n and (n == 0 or (enc.min() >= 0 and enc.max() < R))
    return enc


def omnibal_groups(
    vit: np.ndarray,
    llm: np.ndarray,
    *,
    vit_max: int,
    vit_thresh: int,
    llm_max: int,
    llm_thresh: int,
    iter_time: int,
    seed: int,
) -> tuple[np.ndarray, int]:
    """OmniBal's ISF as we read ``iter_random_groups``: returns each item's group and the
    number of groups. An item above a cap (OmniBal skips it) forms a group of its own here, so
    that no sample is lost (none in the shared mixes)."""
    n = len(vit)
    vit_l, llm_l = vit.tolist(), llm.tolist()

    def next_fit(items: np.ndarray, s: int) -> list[list[int]]:
        order = items[np.random.RandomState(s % 2**32).permutation(len(items))].tolist()
        groups: list[list[int]] = []
        cur: list[int] = []
        sv = sl = 0
        for i in order:
            v, t = vit_l[i], llm_l[i]
            if v > vit_max or t > llm_max:
                groups.append([i])
                continue
            sv += v
            sl += t
            if sv > vit_max or sl > llm_max:
                groups.append(cur)
                cur, sv, sl = [i], v, t
            else:
                cur.append(i)
        if cur:
            groups.append(cur)
        return groups

    groups = next_fit(np.arange(n), seed)
    kept: list[list[int]] = []
    for i in range(iter_time - 1):
        redo: list[int] = []
        for g in groups:
            if sum(vit_l[j] for j in g) == vit_thresh or sum(llm_l[j] for j in g) >= llm_thresh:
                kept.append(g)
            else:
                redo.extend(g)
        groups = next_fit(np.asarray(redo, dtype=np.int64), seed + i) if redo else []
    kept.extend(groups)
    labels = np.full(n, -1, dtype=np.int64)
    for gid, g in enumerate(kept):
        labels[g] = gid
    assert (labels >= 0).all() and sum(len(g) for g in kept) == n, "ISF lost or doubled items"
    return labels, len(kept)


def omnibal_caps(mix: Mix, rows: np.ndarray, seq_len: int, from_mix: bool) -> dict[str, int]:
    """``omnibal``: the repository's defaults (4,096 tokens, threshold 4,050, 9 tiles) scaled
    to ``seq_len``; ``@mixcaps``: ``get_init_llm_vit_len``'s vision cap at ``seq_len`` tokens
    and the search's text threshold (cap - 128)."""
    if not from_mix:
        return {
            "llm_max": seq_len,
            "llm_thresh": round(4050 / 4096 * seq_len),
            "vit_max": round(9 / 4096 * seq_len),
            "vit_thresh": round(9 / 4096 * seq_len),
        }
    tiles = np.ceil(mix.image[rows] / TILE_TOKENS)
    per_tile = ((float(mix.total[rows].mean()) // max(float(tiles.mean()), 1.0) + 1) // 16) * 16
    vit = max(1, int(seq_len // max(per_tile, 1.0)))
    return {"llm_max": seq_len, "llm_thresh": seq_len - 128, "vit_max": vit, "vit_thresh": vit}


def lpt_ranks(cost: np.ndarray, R: int) -> np.ndarray:
    """Longest first to the least loaded rank (ties: the lowest rank): Megatron's
    ``next_hdp_group`` when every sample needs one rank (``cp = 1``)."""
    order = np.argsort(-cost, kind="stable")
    heap = [(0.0, r) for r in range(R)]
    costs = cost.tolist()
    out = [0] * len(costs)
    for i in order.tolist():
        load, r = heap[0]
        out[i] = r
        heapq.heapreplace(heap, (load + costs[i], r))
    return np.asarray(out, dtype=np.int64)


def first_fit_decreasing(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Each item, longest first, into the first bin it fits (a new one if none): its bin."""
    order = np.argsort(-lengths, kind="stable")
    room: list[int] = []
    lens = lengths.tolist()
    out = [0] * len(lens)
    for i in order.tolist():
        L = lens[i]
        for b, free in enumerate(room):
            if free >= L:
                room[b] = free - L
                out[i] = b
                break
        else:
            out[i] = len(room)
            room.append(cap - L)
    return np.asarray(out, dtype=np.int64)


def worst_fit_decreasing(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """NeMo Automodel's ``greedy_knapsack`` as we read it: longest first, to the least filled
    bin if it fits there, else to a new bin. Returns each item's bin and the bin count."""
    order = np.argsort(-lengths, kind="stable")
    heap: list[tuple[int, int]] = []
    lens = lengths.tolist()
    out = [0] * len(lens)
    bins = 0
    for i in order.tolist():
        L = lens[i]
        if heap and heap[0][0] + L <= cap:
            fill, b = heapq.heappop(heap)
            heapq.heappush(heap, (fill + L, b))
        else:
            b = bins
            bins += 1
            heapq.heappush(heap, (L, b))
        out[i] = b
    return np.asarray(out, dtype=np.int64), bins


def wlb_pack(
    batches: list[np.ndarray],
    lengths: np.ndarray,
    workload: np.ndarray,
    N: int,
    s_max: int,
    bounds: Sequence[int],
) -> tuple[list[list[np.ndarray]], list[float]]:
    """WLB-LLM's Algorithm 1 as we read it, over the documents of consecutive global batches
    (occurrence ids): returns per iteration its ``N`` micro-batches and the planning seconds.
    After the last input batch, iterations continue (queues flushed) until nothing is left."""
    lens, wls = lengths.tolist(), workload.tolist()
    queues: list[list[int]] = [[] for _ in bounds]
    deferred: list[int] = []
    out: list[list[np.ndarray]] = []
    times: list[float] = []
    k = 0
    while k < len(batches) or deferred or any(queues):
        start = time.perf_counter()
        flush = k >= len(batches)
        new: list[int] = []
        for d in batches[k].tolist() if not flush else []:
            level = next((i for i in reversed(range(len(bounds))) if lens[d] > bounds[i]), -1)
            if level >= 0:
                queues[level].append(d)
            else:
                new.append(d)
        for q in queues:  # one outlier per micro-batch once a level holds N (all at the end)
            if len(q) >= N or (flush and q):
                take = min(N, len(q))
                new.extend(q[:take])
                del q[:take]
        docs = sorted(deferred, key=lambda d: -lens[d]) + sorted(new, key=lambda d: -lens[d])
        deferred = []
        wl = [0.0] * N
        ln = [0] * N
        hw = [(0.0, j) for j in range(N)]
        hl = [(0, j) for j in range(N)]
        members: list[list[int]] = [[] for _ in range(N)]
        for d in docs:
            L, w = lens[d], wls[d]
            while hw[0][0] != wl[hw[0][1]]:  # stale entries (lazy deletion)
                heapq.heappop(hw)
            while hl[0][0] != ln[hl[0][1]]:
                heapq.heappop(hl)
            j = hw[0][1]
            if ln[j] + L > s_max:
                j = hl[0][1]
                if ln[j] + L > s_max:
                    deferred.append(d)
                    continue
            members[j].append(d)
            wl[j] += w
            ln[j] += L
            heapq.heappush(hw, (wl[j], j))
            heapq.heappush(hl, (ln[j], j))
        out.append([np.asarray(m, dtype=np.int64) for m in members])
        times.append(time.perf_counter() - start)
        k += 1
        # an empty micro-batch takes any document (none is longer than s_max): progress
        assert not flush or any(len(m) for m in members), "WLB-LLM packing made no progress"
    return out, times


# -- one configuration -----------------------------------------------------------------------


@dataclass
class Config:
    mix: Mix
    R: int
    G: int
    occ: Batches
    pricer: Pricer
    exchange: Any
    seq_len: int
    seed: int


def run_veomni(c: Config, objectives: Sequence[str]) -> dict[str, dict]:
    """Routes the images of ``off``'s packs per micro-step (VeOmni) and prices the steps."""
    pool, R, G, ex = c.mix.pool, c.R, c.G, c.exchange
    images = pool.images
    tallies = {o: Tally() for o in objectives}
    plan_s = 0.0
    for k, draw in enumerate(c.occ.draws):
        placed = draw.reshape(R, G)
        busy = path = payload = gather = 0.0
        for m in range(G):
            packs = placed[:, m]
            idx, home = images.of_micro_step(packs)
            tokens = images.tokens[idx]
            start = time.perf_counter()
            enc = veomni_assign(tokens, R)
            plan_s += time.perf_counter() - start
            assert len(enc) == len(idx), "an image was not assigned exactly once"
            load = images.per_call_ms + np.bincount(enc, weights=images.cost_ms[idx], minlength=R)
            busy += float(images.llm_ms[packs].max()) + float(load.max())
            away = enc != home
            moved = tokens[away].astype(np.float64)
            pixels = moved * ex.image_token_bytes
            back = moved * ex.embedding_token_bytes
            path += ex.transfer_ms(home[away], enc[away], pixels, R)
            path += 2.0 * ex.transfer_ms(enc[away], home[away], back, R)
            # an all-gather of the image counts, then one of the images' lengths (int64)
            path += allgather_ms(ex, R, 8.0 * len(idx) / R, calls=2)
            payload += float(pixels.sum() + 2.0 * back.sum())
            gather += R * (R - 1) * 8.0 + (R - 1) * 8.0 * len(idx)
        sub = _off_packs(c, k)
        cost = pool.cost_ms[draw]
        for o in objectives:  # every micro-step is a meeting: the same step for both
            tallies[o].add(
                busy, float(cost.sum()) / R, float(pool.tokens[draw].sum()), payload, gather, path
            )
            c.pricer.record(tallies[o], sub)
    rows = {}
    for o in objectives:
        tallies[o].plan_s = plan_s
        rows[o] = tallies[o].row(R, c.seq_len, len(c.occ), pool.efficiency)
    return rows


def _off_packs(c: Config, k: int) -> Packs:
    """``off``'s packs of global batch ``k`` as packs of occurrence ids (slot order)."""
    lo, hi = int(c.occ.starts[k]), int(c.occ.starts[k + 1])
    return Packs(
        positions=np.arange(lo, hi, dtype=np.int64),
        offsets=np.concatenate(
            [[0], np.cumsum(np.bincount(c.occ.slot[lo:hi], minlength=c.R * c.G))]
        ).astype(np.int64),
    )


def price_off(c: Config, objective: str) -> float:
    """``off`` priced here (the check that this file prices as the simulator does)."""
    steps = []
    for k in range(len(c.occ.draws)):
        busy, _, _ = c.pricer.packs(_off_packs(c, k), c.R, c.G, objective)
        steps.append(busy)
    return float(np.mean(steps))


def run_megatron(c: Config, objectives: Sequence[str]) -> dict[str, dict]:
    R, ex, occ = c.R, c.exchange, c.occ
    length = c.pricer.feats["total_tokens"]
    nbytes = c.mix.sample_bytes[occ.rows]
    tallies = {o: Tally() for o in objectives}
    plan_s = 0.0
    for k in range(len(occ.draws)):
        lo, hi = int(occ.starts[k]), int(occ.starts[k + 1])
        L = length[lo:hi]
        start = time.perf_counter()
        rank = lpt_ranks(L.astype(np.float64) ** 2, R)  # L^2 / cp, cp = 1
        by_rank = np.argsort(rank, kind="stable")
        bounds = np.searchsorted(rank[by_rank], np.arange(R + 1))
        micro = np.empty(hi - lo, dtype=np.int64)
        for r in range(R):
            mine = by_rank[bounds[r] : bounds[r + 1]]
            micro[mine] = first_fit_decreasing(L[mine], c.seq_len)
        plan_s += time.perf_counter() - start
        M = int(micro.max()) + 1
        sub = packs_of(rank * M + micro, R * M)
        sub = Packs(positions=sub.positions + lo, offsets=sub.offsets)
        origin = occ.rank[lo:hi]
        away = rank != origin
        moved = nbytes[lo:hi][away]
        max_n = int(np.bincount(origin, minlength=R).max())
        # counts (int32), then every rank's lengths padded to the longest list (int32)
        path = allgather_ms(ex, R, 4.0 + 4.0 * max_n, calls=2)
        path += ex.transfer_ms(origin[away], rank[away], moved, R)
        gather = R * (R - 1) * (4.0 + 4.0 * max_n)
        for o in objectives:
            busy, ideal, tokens = c.pricer.packs(sub, R, M, o)
            tallies[o].add(busy, ideal, tokens, float(moved.sum()), gather, path)
            c.pricer.record(tallies[o], sub)
    rows = {}
    for o in objectives:
        tallies[o].plan_s = plan_s
        rows[o] = tallies[o].row(R, c.seq_len, len(occ), None)
    return rows


def run_omnibal(c: Config, objectives: Sequence[str], from_mix: bool) -> dict[str, dict]:
    occ = c.occ
    caps = omnibal_caps(c.mix, occ.rows, c.seq_len, from_mix)
    vit = np.ceil(c.pricer.feats["image_tokens"] / TILE_TOKENS).astype(np.int64)
    start = time.perf_counter()
    labels, n_groups = omnibal_groups(
        vit, c.pricer.feats["total_tokens"], iter_time=10, seed=1024 + c.seed, **caps
    )
    # OmniBal's sampler is random over groups: a random deal onto slots
    slot_of_group = np.random.default_rng([c.seed, 7]).permutation(n_groups)
    plan_s = time.perf_counter() - start
    rows = run_slots(plan_s, c.pricer, labels, slot_of_group, c.R, c.G, objectives)
    out = {}
    for o, t in rows.items():
        out[o] = t.row(c.R, c.seq_len, len(occ), None)
        out[o]["caps"] = caps
    return out


def run_nemo(c: Config, objectives: Sequence[str], shuffle: bool) -> dict[str, dict]:
    R, G = c.R, c.G
    start = time.perf_counter()
    labels, n_bins = worst_fit_decreasing(c.pricer.feats["total_tokens"], c.seq_len)
    vt = np.bincount(labels, weights=c.pricer.feats["image_tokens"], minlength=n_bins)
    order = np.argsort(vt, kind="stable")  # bins by visual tokens, ascending
    if shuffle:  # the loader's default, DistributedSampler(shuffle=True): the sort is undone
        order = order[np.random.default_rng([c.seed, 11]).permutation(n_bins)]
    # DistributedSampler(shuffle=False): position i -> rank i % R, its (i // R)-th item; with
    # ga micro-steps, global batch k, micro-step m, rank r holds position (k * G + m) * R + r
    i = np.arange(n_bins)
    k, rem = np.divmod(i, R * G)
    m, r = np.divmod(rem, R)
    slot_of_position = k * R * G + r * G + m
    slot_of_bin = np.empty(n_bins, dtype=np.int64)
    slot_of_bin[order] = slot_of_position
    plan_s = time.perf_counter() - start
    rows = run_slots(plan_s, c.pricer, labels, slot_of_bin, R, G, objectives)
    return {o: t.row(R, c.seq_len, len(c.occ), None) for o, t in rows.items()}


def run_wlb(c: Config, objectives: Sequence[str], vision: bool) -> dict[str, dict]:
    R, G, occ = c.R, c.G, c.occ
    workload = (c.mix.sample_ms if vision else c.mix.llm_workload)[occ.rows]
    batches = [np.arange(occ.starts[k], occ.starts[k + 1]) for k in range(len(occ.draws))]
    bounds = (c.seq_len // 4, c.seq_len // 2)  # outlier levels (judgement: see the notes)
    iterations, times = wlb_pack(
        batches, c.pricer.feats["total_tokens"], workload, R * G, c.seq_len, bounds
    )
    labels = np.full(len(occ), -1, dtype=np.int64)
    for k, micro in enumerate(iterations):
        for j, members in enumerate(micro):
            labels[members] = k * R * G + j  # micro-batch j -> rank j // G, micro-step j % G
    assert (labels >= 0).all(), "WLB-LLM packing lost a document"
    n_slots = len(iterations) * R * G
    rows = run_slots(float(sum(times)), c.pricer, labels, np.arange(n_slots), R, G, objectives)
    out = {}
    for o, t in rows.items():
        out[o] = t.row(R, c.seq_len, len(occ), None)
        out[o]["outlier_bounds"] = list(bounds)
    return out


def run_peers(c: Config, objectives: Sequence[str], peers: Sequence[str]) -> dict[str, dict]:
    runners: dict[str, Callable[[], dict[str, dict]]] = {
        "veomni": lambda: run_veomni(c, objectives),
        "omnibal": lambda: run_omnibal(c, objectives, from_mix=False),
        "omnibal@mixcaps": lambda: run_omnibal(c, objectives, from_mix=True),
        "megatron": lambda: run_megatron(c, objectives),
        "nemo_automodel": lambda: run_nemo(c, objectives, shuffle=False),
        "nemo_automodel@shuffle": lambda: run_nemo(c, objectives, shuffle=True),
        "wlb_llm": lambda: run_wlb(c, objectives, vision=False),
        "wlb_llm+vision": lambda: run_wlb(c, objectives, vision=True),
    }
    return {p: runners[p]() for p in peers}


# -- our modes -------------------------------------------------------------------------------


class _ModeClock:
    """Times the simulator's per-mode work inside :func:`simulate` (its ``_run`` per mode, and
    forming the source epoch for ``source``), by wrapping the module's functions for the
    duration of one call. Attributes nothing when the simulator's internals differ."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> _ModeClock:
        self._run = getattr(SIM, "_run", None)
        self._source = getattr(SIM, "_SourcePool", None)
        if self._run is not None:
            clock = self

            def timed_run(mode: str, *a: Any, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return clock._run(mode, *a, **kw)
                finally:
                    clock.add(mode, time.perf_counter() - start)

            SIM._run = timed_run
        if self._source is not None:
            original = self._source

            class TimedSource(original):  # type: ignore[misc,valid-type]
                def __init__(inner, *a: Any, **kw: Any) -> None:  # noqa: N805
                    start = time.perf_counter()
                    super().__init__(*a, **kw)
                    self.add("source", time.perf_counter() - start)

            SIM._SourcePool = TimedSource
        return self

    def add(self, mode: str, seconds: float) -> None:
        self.seconds[mode] = self.seconds.get(mode, 0.0) + seconds

    def __exit__(self, *exc: Any) -> None:
        if self._run is not None:
            SIM._run = self._run
        if self._source is not None:
            SIM._SourcePool = self._source


def our_modes() -> list[str]:
    return [*OUR_MODES, *(("auto",) if "auto" in SIM.ALL_MODES else ())]


def run_ours(
    mix: Mix,
    R: int,
    G: int,
    sync_every: str,
    args: argparse.Namespace,
    cost_model: CostModel,
    exchange: Any,
    occ: Batches,
) -> tuple[list[dict], dict[str, float]]:
    modes = our_modes()
    with _ModeClock() as clock:
        rows = SIM.simulate(
            mix.table,
            seq_len=args.seq_len,
            cost_model=cost_model,
            dp=[R],
            ga=[G],
            modes=modes,
            exchange=exchange,
            batches=args.batches,
            seed=args.seed,
            sync_every=sync_every,
        )
    pool = mix.pool
    drawn = np.concatenate(occ.draws)
    pack_bytes = float(pool.bytes[drawn].mean())
    first, last = pool.images.offsets[drawn], pool.images.offsets[drawn + 1]
    image_idx = np.concatenate([np.arange(a, b) for a, b in zip(first, last)])
    image_tokens = float(pool.images.tokens[image_idx].mean()) if len(image_idx) else 0.0
    per_image = image_tokens * (exchange.image_token_bytes + 2.0 * exchange.embedding_token_bytes)
    K = int((last - first).max()) if len(first) else 0
    out = []
    for row in rows:
        mode = row["mode"]
        payload = (
            row.get("moved_packs", 0.0) * pack_bytes + row.get("moved_images", 0.0) * per_image
        )
        gather = 0.0
        if mode not in ("off", "source") and R > 1:  # a runtime planner gathers pack features
            gather = R * (R - 1) * G * FEATURE_ROW_BYTES
            if mode.startswith("encoder") or mode == "auto":  # and the images' sizes
                gather += R * (R - 1) * G * max(K, 1) * 8.0
        planning = clock.seconds.get(mode)
        out.append(
            {
                "algorithm": f"ours:{mode}",
                "batches": row["batches"],
                "tokens": int(row["tokens"]),
                "step_ms": row["step_ms"],
                "ideal_step_ms": row["ideal_step_ms"],
                "waste_frac": row["waste_frac"],
                "tokens_per_s_per_rank": row["tokens_per_s_per_rank"],
                "packing_efficiency": row["packing_efficiency"],
                "payload_bytes": payload,
                "gather_bytes": gather,
                "moved_bytes": payload + gather,
                "moved_bytes_estimated": True,
                "moved_packs": row.get("moved_packs"),
                "moved_images": row.get("moved_images"),
                "planning_ms": planning * 1e3 / row["batches"] if planning is not None else None,
                **({"auto_choices": row["choices"]} if "choices" in row else {}),
                **(
                    {"formed_at_source": row["formed_at_source"]}
                    if "formed_at_source" in row
                    else {}
                ),
            }
        )
    return out, clock.seconds


# -- the run ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", type=comma_list(choices=MIXES), default=list(MIXES))
    p.add_argument("--text-shares", type=comma_list(float), default=[0.3, 0.5], metavar="F[,F]")
    p.add_argument("--dp", type=comma_list(int, minimum=1), default=[8, 64, 512, 1024])
    p.add_argument("--ga", type=comma_list(int, minimum=1), default=[1, 4, 8])
    p.add_argument(
        "--strategies", type=comma_list(choices=tuple(STRATEGIES)), default=list(STRATEGIES)
    )
    p.add_argument("--peers", type=comma_list(choices=PEERS), default=list(PEERS))
    p.add_argument("--batches", type=int, default=8, metavar="B")
    p.add_argument("--seq-len", type=int, default=8192, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny configuration (one mix, dp 8, ga 1 and 2, 2 batches): for the tests",
    )
    p.add_argument(
        "--synthetic-samples",
        type=int,
        default=20_000,
        help="samples of the synthetic mix used where the shared data is absent",
    )
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.quick:
        args.mixes, args.text_shares, args.dp, args.ga = ["ai2d"], [0.3], [8], [1, 2]
        args.batches = 2
    if args.batches < 1 or args.seq_len < 1:
        p.error("--batches and --seq-len must be >= 1")
    if any(not 0.0 <= s < 1.0 for s in args.text_shares):
        p.error("--text-shares must be in [0, 1)")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    cost_model = CostModel()
    exchange = SIM.ExchangeModel()
    found = mix_files()
    objectives = {s: STRATEGIES[s] for s in args.strategies}
    rows: list[dict] = []
    checks: list[dict] = []
    timings: list[dict] = []
    for name in args.mixes:
        files = found.get(name) if found else None
        label = name if files is not None else f"synthetic({name})"
        for share in args.text_shares:
            start = time.perf_counter()
            mix = load_mix(label, files, share, args, cost_model, exchange)
            load_s = time.perf_counter() - start
            for R in args.dp:
                for G in args.ga:
                    t0 = time.perf_counter()
                    draws = SIM._draws(mix.pool, R, G, args.batches, args.seed, False, 0)
                    occ = Batches.of(mix.pool, draws, G)
                    c = Config(
                        mix,
                        R,
                        G,
                        occ,
                        Pricer(mix, occ, cost_model),
                        exchange,
                        args.seq_len,
                        args.seed,
                    )
                    peer_rows = run_peers(c, list(objectives.values()), args.peers)
                    t_peers = time.perf_counter() - t0
                    t_ours = 0.0
                    for strategy, objective in objectives.items():
                        t1 = time.perf_counter()
                        ours, _ = run_ours(mix, R, G, objective, args, cost_model, exchange, occ)
                        t_ours += time.perf_counter() - t1
                        off = next(r for r in ours if r["algorithm"] == "ours:off")
                        drawn_tokens = float(sum(mix.pool.tokens[d].sum() for d in draws))
                        off_here = price_off(c, objective)
                        checks.append(
                            {
                                "mix": label,
                                "text_share": share,
                                "dp": R,
                                "ga": G,
                                "strategy": strategy,
                                "same_draws": off["tokens"] == int(drawn_tokens),
                                "off_step_ms_simulator": off["step_ms"],
                                "off_step_ms_here": off_here,
                                "off_reproduced": abs(off_here - off["step_ms"])
                                <= 1e-9 * max(1.0, off["step_ms"]),
                            }
                        )
                        key = {
                            "mix": label,
                            "text_share": share,
                            "dp": R,
                            "ga": G,
                            "strategy": strategy,
                        }
                        for r in ours:
                            rows.append({**key, **r})
                        for peer, by_objective in peer_rows.items():
                            rows.append({**key, "algorithm": peer, **by_objective[objective]})
                    timings.append(
                        {
                            "mix": label,
                            "text_share": share,
                            "dp": R,
                            "ga": G,
                            "peers_s": round(t_peers, 2),
                            "ours_s": round(t_ours, 2),
                            "load_s": round(load_s, 2),
                        }
                    )
                    print(
                        f"{label} share={share} dp={R} ga={G}: peers {t_peers:.1f}s,"
                        f" ours {t_ours:.1f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    load_s = 0.0
    return {
        "rows": rows,
        "summary": summarize(rows),
        "checks": checks,
        "timings": timings,
        "peers": list(args.peers),
        "our_modes": our_modes(),
        "batches": args.batches,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "data": "shared" if found else "synthetic",
        **stamp("numpy", "numba", "lightning_vlmbalance"),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: the best peer, our best fixed mode and ``auto`` (tokens/s/rank)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["mix"], r["text_share"], r["dp"], r["ga"], r["strategy"])
        groups.setdefault(key, []).append(r)
    out = []
    for key, group in groups.items():
        peers = [r for r in group if not r["algorithm"].startswith("ours:")]
        fixed = [
            r for r in group if r["algorithm"].startswith("ours:") and r["algorithm"] != "ours:auto"
        ]
        auto = next((r for r in group if r["algorithm"] == "ours:auto"), None)
        best_peer = max(peers, key=lambda r: r["tokens_per_s_per_rank"]) if peers else None
        best_ours = max(fixed, key=lambda r: r["tokens_per_s_per_rank"]) if fixed else None
        entry: dict[str, Any] = dict(zip(("mix", "text_share", "dp", "ga", "strategy"), key))
        if best_peer is not None:
            entry["best_peer"] = best_peer["algorithm"]
            entry["best_peer_tokens_per_s"] = best_peer["tokens_per_s_per_rank"]
        if best_ours is not None:
            entry["best_ours"] = best_ours["algorithm"]
            entry["best_ours_tokens_per_s"] = best_ours["tokens_per_s_per_rank"]
        if auto is not None:
            entry["auto_tokens_per_s"] = auto["tokens_per_s_per_rank"]
        if best_peer is not None and best_peer["tokens_per_s_per_rank"] > 0:
            if best_ours is not None:
                entry["ours_over_peer"] = (
                    best_ours["tokens_per_s_per_rank"] / best_peer["tokens_per_s_per_rank"]
                )
            if auto is not None:
                entry["auto_over_peer"] = (
                    auto["tokens_per_s_per_rank"] / best_peer["tokens_per_s_per_rank"]
                )
        out.append(entry)
    return out


def print_table(result: dict[str, Any]) -> None:
    last = None
    for r in result["rows"]:
        key = (r["mix"], r["text_share"], r["dp"], r["ga"], r["strategy"])
        if key != last:
            print(f"\n{key[0]} text={key[1]} dp={key[2]} ga={key[3]} {key[4]}")
            last = key
        print(
            f"  {r['algorithm']:>22} waste {r['waste_frac']:.3f} packing"
            f" {r['packing_efficiency']:.3f} tok/s/rank {r['tokens_per_s_per_rank']:8.0f}"
            f" moved {r['moved_bytes'] / 1e6:10.1f} MB plan {r['planning_ms'] or 0:8.2f} ms"
        )
    print()
    for s in result["summary"]:
        print(
            f"{s['mix']} {s['text_share']} dp={s['dp']} ga={s['ga']} {s['strategy']}: best peer"
            f" {s.get('best_peer')} {s.get('best_peer_tokens_per_s', 0):.0f}, ours"
            f" {s.get('best_ours')} {s.get('best_ours_tokens_per_s', 0):.0f}, auto"
            f" {s.get('auto_tokens_per_s', float('nan')):.0f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchmarkError as err:
        print(f"peers.py: error: {err}", file=sys.stderr)
        return 2
    failed = [c for c in result["checks"] if not (c["same_draws"] and c["off_reproduced"])]
    failed += [
        r
        for r in result["rows"]
        if not r["algorithm"].startswith("ours:")
        and not (r["trained_once"] and r["max_pack_tokens"] <= args.seq_len)
    ]
    if args.json:
        print_json(result)
    else:
        print_table(result)
    if failed:
        print(f"peers.py: {len(failed)} failed checks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
