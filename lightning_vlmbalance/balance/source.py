"""Balance at the source: global batches whose packs come out of even cost, formed by the sampler.

Every rank computes the whole epoch plan from the length table, so it knows every pack of every
rank at every step, and the pack cost features come from the same table. For a map-style dataset
the sampler can therefore form each global batch (``num_replicas x micro_steps`` packs) so that its
packs cost the same, and place them on ranks and micro-steps for the objective: no feature
all-gather, no exchange, no thread.

One global batch is formed from the front of the epoch's shuffled sample stream:

1. **window**: samples from the stream until their tokens reach ``P x seq_len x (1 + slack)``
   (``P`` packs; samples left over from the previous batch first);
2. **balance**: the samples with images and the long text samples, by decreasing cost, each into
   the pack of least cost that has room (longest-processing-time first, with capacity);
3. **fill**: the short text samples, longest first, each into the fullest pack it fits (best fit),
   then text samples from the next ``lookahead`` of the stream that fit a remaining gap (and
   samples with images, with ``fill_with_images``);
4. what did not fit waits for the next global batch (first in its window);
5. **place**: the packs' costs go to the rebalancing planner (``plan_rebalance``) with the
   objective, which puts them on ranks and micro-steps.

Every sample is in exactly one pack per epoch; the epoch's last global batch takes what is left
(padding packs, counted, where it has fewer than ``P``). The plan depends only on the integers of
the length table and the settings: every rank computes the same plan.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lightning_vlmbalance._moved import DP_RANKS, renamed_keyword
from lightning_vlmbalance.balance.cost import (
    LLM_PHASES,
    MODELLED_PHASES,
    CostModel,
    features_from_packs,
    sample_features,
)
from lightning_vlmbalance.balance.planner import plan_rebalance
from lightning_vlmbalance.packing.binpack import Packs
from lightning_vlmbalance.packing.plan import (
    PADDING,
    EpochPlan,
    PackingConfig,
    apply_overlong_policy,
    as_length_column,
    build_epoch_plan,
    check_length_table,
)
from lightning_vlmbalance.parallel import resolve_objective

__all__ = [
    "SourceBalance",
    "build_balanced_epoch_plan",
    "form_balanced_batches",
    "sample_costs",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class SourceBalance:
    """How a :class:`~lightning_vlmbalance.PackingSampler` balances at the source
    (``PackingSampler(balance=SourceBalance(...))``; ``balance=True`` is ``SourceBalance()``).
    Every setting of the algorithm is here; all ranks must use the same (they are part of the
    sampler's fingerprint).

    Attributes:
        cost_model: the pack cost model: a :class:`~lightning_vlmbalance.CostModel`, a path to
            one saved as JSON, or ``None`` (the defaults).
        micro_steps: packs per rank per global batch; ``None``: the Trainer's optimizer step's
            (:class:`~lightning_vlmbalance.parallel.StepSpec`) when the loader knows it, else 1.
        objective: ``"step"``, ``"microstep"`` (as the rebalancing planner's) or ``"auto"``
            (how the ranks meet under the trainer's strategy,
            :func:`~lightning_vlmbalance.parallel.resolve_objective`; ``"step"`` without
            a trainer).
        slack: extra tokens read into a global batch's window, as a fraction of its capacity.
        small_tokens: text samples up to this many tokens fill gaps (phase 3) instead of being
            balanced (phase 2).
        lookahead: samples further in the stream that may fill a gap of this global batch.
        fill_with_images: after the text samples of the lookahead, let its samples with images
            fill the gaps too, longest first, each into the least loaded pack it fits, where a
            pack's load counts the fixed image cost once it has an image, also one it gains in
            this fill (fuller packs, less even costs).
        exact: keep every global batch's samples of the unbalanced plan (the parameters then
            equal the unbalanced run's) and only re-form its packs; where the samples do not
            fit into as many packs, the batch keeps its packs and the planner only places them
            (counted in the plan's ``fallback_batches``).
        plan_ahead: plan the next epoch in a background thread once the current epoch's plan
            is made (the sampler's ``planned_ahead`` counts the plans taken from it).
        when: ``"auto"`` (under a strategy in ``mode="auto"``, each epoch is formed at the
            source only where that is predicted faster than the packs as they come, with the
            cost model the epoch starts with: :mod:`~lightning_vlmbalance.balance.
            epoch_choice`; formed every epoch under any other strategy or mode) or
            ``"always"`` (every epoch).
        llm_only: form and place the packs by their language model's cost alone, the vision
            encoder's left to the image routing (the two levels then agree); ``None``: with
            ``when="auto"`` where the strategy's loader may route images (``mode="auto"``
            with ``encoder=True``), priced both ways each epoch, else ``False``.

    Raises:
        ValueError: for a bad setting, quoting it.
    """

    cost_model: CostModel | str | Path | None = None
    micro_steps: int | None = None
    objective: Literal["auto", "step", "microstep"] = "auto"
    slack: float = 0.02
    small_tokens: int = 2048
    lookahead: int = 4096
    fill_with_images: bool = False
    exact: bool = False
    plan_ahead: bool = True
    when: Literal["auto", "always"] = "auto"
    llm_only: bool | None = None

    def __post_init__(self) -> None:
        if self.micro_steps is not None and self.micro_steps < 1:
            raise ValueError(f"`SourceBalance(micro_steps={self.micro_steps!r})` must be >= 1")
        if self.objective not in ("auto", "step", "microstep"):
            raise ValueError(
                f"`SourceBalance(objective={self.objective!r})`: expected 'auto', 'step' or"
                " 'microstep'"
            )
        if self.when not in ("auto", "always"):
            raise ValueError(f"`SourceBalance(when={self.when!r})`: expected 'auto' or 'always'")
        if not (self.llm_only is None or isinstance(self.llm_only, bool)):
            raise ValueError(
                f"`SourceBalance(llm_only={self.llm_only!r})`: expected True, False or None"
            )
        for name in ("slack", "small_tokens", "lookahead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"`SourceBalance({name}={getattr(self, name)!r})` must be >= 0")
        if not isinstance(self.cost_model, CostModel):  # defaults, or loaded once here
            model = CostModel() if self.cost_model is None else CostModel.load(self.cost_model)
            object.__setattr__(self, "cost_model", model)

    @property
    def model(self) -> CostModel:
        """The cost model (loaded)."""
        assert isinstance(self.cost_model, CostModel)
        return self.cost_model

    def resolved(self, *, micro_steps: int, objective: str) -> SourceBalance:
        """These settings with ``micro_steps`` and ``objective`` decided where left to the
        trainer (``None`` and ``"auto"``), and ``llm_only=None`` as ``False`` (the per-epoch
        decision sets it where it prices both)."""
        return replace(
            self,
            micro_steps=micro_steps if self.micro_steps is None else self.micro_steps,
            llm_only=bool(self.llm_only),
            objective=resolve_objective(
                objective if self.objective == "auto" else self.objective,
                sync_every_micro_batch=False,
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (the cost model's coefficients included): a fingerprint."""
        out = {name: getattr(self, name) for name in self.__slots__ if name != "cost_model"}
        return {**out, "cost_model": self.model.to_dict()}


def form_balanced_batches(
    order: np.ndarray,
    tokens: np.ndarray,
    image_tokens: np.ndarray,
    cost: np.ndarray,
    *,
    packs_per_batch: int,
    seq_len: int,
    pack_fixed_image_cost: float,
    settings: SourceBalance,
) -> list[Packs]:
    """The epoch's global batches, each as :class:`~lightning_vlmbalance.packing.Packs` of
    ``packs_per_batch`` packs (positions are sample ids).

    Args:
        order: the epoch's samples in stream order (shuffled, over-long ones removed).
        tokens, image_tokens: per sample id.
        cost: per sample id, the sample's additive cost (a pack's cost is the sum of its samples'
            plus ``pack_fixed_image_cost`` once if any of them has an image).
        packs_per_batch: ``P = num_replicas x micro_steps``.
        seq_len: tokens per pack.
        settings: the algorithm's settings.

    Returns:
        The global batches in order; the last may have fewer than ``P`` packs.
    """
    from lightning_vlmbalance.balance._source_kernel import form_epoch

    P = int(packs_per_batch)
    samples, pack_len, window_packs = form_epoch(
        np.ascontiguousarray(order, dtype=np.int64),
        np.ascontiguousarray(tokens, dtype=np.int64),
        np.ascontiguousarray(image_tokens, dtype=np.int64),
        np.ascontiguousarray(cost, dtype=np.float64),
        P,
        int(seq_len),
        float(pack_fixed_image_cost),
        float(settings.slack),
        int(settings.small_tokens),
        int(settings.lookahead),
        bool(settings.fill_with_images),
    )
    offsets = np.zeros(len(pack_len) + 1, dtype=np.int64)
    np.cumsum(pack_len, out=offsets[1:])
    batches: list[Packs] = []
    first = 0
    for made in window_packs.tolist():
        # a window makes P packs, but for the last, which may need more for what was left
        for k in range(first, first + made, P):
            stop = min(k + P, first + made)
            lo = offsets[k]
            batches.append(Packs(samples[lo : offsets[stop]], offsets[k : stop + 1] - lo))
        first += made
    return batches


def sample_costs(
    cost_model: CostModel,
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    *,
    llm_only: bool = False,
) -> tuple[np.ndarray, float]:
    """Each sample's additive cost under ``cost_model`` (all phases, or with ``llm_only`` the
    language model's) and the fixed cost a pack pays once when any of its samples has an image
    (the per-pack constant is left out: every pack pays it)."""
    features = sample_features(total_tokens, image_tokens, images)
    phases = LLM_PHASES if llm_only else MODELLED_PHASES
    cost, _, image_pack = cost_model.additive_cost_ms(features, phases)
    return cost, image_pack


@renamed_keyword(*DP_RANKS)
def build_balanced_epoch_plan(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    config: PackingConfig,
    *,
    num_replicas: int,
    epoch: int,
    balance: SourceBalance,
    cost_model: CostModel | None = None,
    schedule: Sequence[tuple[int, CostModel]] | None = None,
) -> EpochPlan:
    """The epoch plan of a source-balanced sampler (see the module docstring): rank ``r``'s
    packs in order, ``micro_steps`` per global batch, placed by the planner for the objective.

    ``schedule`` (online calibration) changes the cost model during the epoch: ``[(0, m0),
    (b1, m1), ...]`` forms and places global batches ``b1, b1 + 1, ...`` with ``m1``, from the
    samples the batches before ``b1`` left in the stream, in stream order (the rest of the
    epoch re-planned from that position, as every rank does the same). Default: ``[(0,
    cost_model or balance.model)]``. The epoch's pack count may change with the model.

    Raises:
        ValueError: as :func:`~lightning_vlmbalance.packing.plan.build_epoch_plan`, and for
            ``remainder='drop'`` (a balanced plan pads its last global batch).
    """
    if balance.micro_steps is None or balance.objective == "auto":
        raise ValueError(
            "build_balanced_epoch_plan needs `micro_steps` and `objective` decided:"
            f" {balance.micro_steps=}, {balance.objective=} (`SourceBalance.resolved(...)`)"
        )
    schedule = _check_schedule(
        schedule or [(0, balance.model if cost_model is None else cost_model)]
    )
    total_tokens = as_length_column(total_tokens, "total_tokens")
    image_tokens = as_length_column(image_tokens, "image_tokens")
    check_length_table(total_tokens, image_tokens)
    if config.remainder != "pad":
        raise ValueError(
            "a source-balanced PackingSampler pads its last global batch: `remainder='drop'`"
            " is not supported with `balance=`"
        )
    if config.packer != "greedy":
        raise ValueError(f"`balance=` forms its own packs: `packer={config.packer!r}` conflicts")
    lengths, skipped, truncated = apply_overlong_policy(
        total_tokens, image_tokens, config.seq_len, config.overlong
    )
    order = _sample_stream(len(lengths), skipped, config, epoch)
    llm_only = bool(balance.llm_only)
    costs = [
        (start, model, *sample_costs(model, lengths, image_tokens, images, llm_only=llm_only))
        for start, model in schedule
    ]
    R, G = num_replicas, balance.micro_steps
    fallback = 0
    if balance.exact:
        batches, fallback = _exact_batches(
            total_tokens, image_tokens, lengths, costs, config, R, G, epoch, balance
        )
    else:
        batches = _scheduled_batches(order, lengths, image_tokens, costs, config, R * G, balance)
    # packs balanced on their language model: the images go where the routing puts them,
    # and a micro-step that routes one is a meeting (its own language models must be even)
    objective = "microstep" if llm_only else balance.objective
    rank_packs, rank_ids, tokens, padding = _deal_batches(
        batches, lengths, image_tokens, images, costs, R, G, objective, llm_only
    )
    return EpochPlan(
        epoch=epoch,
        num_replicas=R,
        rank_packs=rank_packs,
        rank_pack_ids=rank_ids,
        pack_tokens=np.asarray(tokens, dtype=np.int64),
        seq_len=config.seq_len,
        padding_packs=padding,
        skipped_sample_ids=skipped,
        truncated_sample_ids=truncated,
        balanced_batches=len(batches) - fallback,
        fallback_batches=fallback,
        formed_at_source=True,
    )


def _sample_stream(
    n_samples: int, skipped: np.ndarray, config: PackingConfig, epoch: int
) -> np.ndarray:
    """The epoch's sample stream: every sample but the ``skipped`` ones, shuffled (when the
    config shuffles) by ``(seed, epoch)``, as every rank draws it.

    Raises:
        ValueError: if every sample was skipped.
    """
    keep = np.ones(n_samples, dtype=bool)
    keep[skipped] = False
    order = np.flatnonzero(keep)
    if config.shuffle:
        order = order[np.random.default_rng([config.seed, epoch]).permutation(len(order))]
    if len(order) == 0:
        raise ValueError("no sample is left to pack (every sample was skipped)")
    return order


def _scheduled_batches(
    order: np.ndarray,
    lengths: np.ndarray,
    image_tokens: np.ndarray,
    costs: list[tuple[int, CostModel, np.ndarray, float]],
    config: PackingConfig,
    packs_per_batch: int,
    balance: SourceBalance,
) -> list[Packs]:
    """The epoch's balanced global batches when the cost model changes on a schedule: each
    ``(first batch, model, cost, fixed)`` of ``costs`` forms its batches from the samples that
    the batches before it left in the stream, in stream order, up to the next one's first
    batch."""
    batches: list[Packs] = []
    for k, (start, _, cost, fixed) in enumerate(costs):
        if start > len(batches):
            break  # the epoch ended before this model's first batch
        if batches:  # the samples the earlier batches left, in stream order
            order = order[~np.isin(order, np.concatenate([b.positions for b in batches]))]
            if not len(order):
                break
        formed = form_balanced_batches(
            order,
            lengths,
            image_tokens,
            cost,
            packs_per_batch=packs_per_batch,
            seq_len=config.seq_len,
            pack_fixed_image_cost=fixed,
            settings=balance,
        )
        end = costs[k + 1][0] if k + 1 < len(costs) else None
        batches.extend(formed if end is None else formed[: end - start])
    return batches


def _deal_batches(
    batches: list[Packs],
    lengths: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    costs: list[tuple[int, CostModel, np.ndarray, float]],
    R: int,
    G: int,
    objective: str,
    llm_only: bool = False,
) -> tuple[list[list[np.ndarray]], list[list[int]], list[int], int]:
    """Each global batch's packs placed on the ranks (:func:`_place`, with the model that
    formed the batch), a batch short of ``R x G`` packs padded with empty ones. Returns each
    rank's packs in order, their pack ids (:data:`PADDING` for a padding pack), the tokens of
    each real pack by id, and the padding packs' count."""
    starts = [start for start, *_ in costs]
    rank_packs: list[list[np.ndarray]] = [[] for _ in range(R)]
    rank_ids: list[list[int]] = [[] for _ in range(R)]
    tokens: list[int] = []
    padding = 0
    empty = np.zeros(0, np.int64)
    for index, batch in enumerate(batches):
        n_real = len(batch)
        padding += R * G - n_real
        pack_tokens = batch.tokens(lengths).tolist()
        model = costs[bisect.bisect_right(starts, index) - 1][1]
        placed = _place(batch, lengths, image_tokens, images, model, R, G, objective, llm_only)
        for r in range(R):
            for p in placed[r]:
                if p < n_real:
                    rank_packs[r].append(batch[p])
                    rank_ids[r].append(len(tokens))
                    tokens.append(pack_tokens[p])
                else:
                    rank_packs[r].append(empty)
                    rank_ids[r].append(PADDING)
    return rank_packs, rank_ids, tokens, padding


def _place(
    batch: Packs,
    lengths: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    cost_model: CostModel,
    R: int,
    G: int,
    objective: str,
    llm_only: bool = False,
) -> list[list[int]]:
    """Which of the batch's packs (index; ``>= len(batch)``: padding) each rank trains at each
    micro-step: the planner's placement for the objective, of the packs' cost (``llm_only``:
    their language model's). With one micro-step every placement is as good (each rank has
    one pack): pack ``r`` to rank ``r``."""
    if G == 1:
        return [[r] for r in range(R)]
    feats = features_from_packs(batch, lengths, image_tokens, images)
    pack_cost = np.zeros(R * G, dtype=np.int64)
    if llm_only:
        pack_cost[: len(batch)] = np.rint(cost_model.llm_cost_ms(feats) * 1000.0)
    else:
        pack_cost[: len(batch)] = cost_model.pack_cost_us(feats)
    return (
        plan_rebalance(
            pack_cost, np.repeat(np.arange(R), G), R, G, objective=objective, tolerance=0.0
        )
        .assignment[:, :, 0]
        .tolist()
    )  # (R, G)


def _check_schedule(schedule: Sequence[tuple[int, CostModel]]) -> list[tuple[int, CostModel]]:
    """``[(first global batch, model), ...]`` from batch 0 on, first batches increasing."""
    out = [(int(start), model) for start, model in schedule]
    starts = [start for start, _ in out]
    if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
        raise ValueError(
            f"a cost-model schedule starts at global batch 0 and increases; got first batches"
            f" {starts}"
        )
    return out


def _exact_batches(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    lengths: np.ndarray,
    costs: list[tuple[int, CostModel, np.ndarray, float]],
    config: PackingConfig,
    R: int,
    G: int,
    epoch: int,
    balance: SourceBalance,
) -> tuple[list[Packs], int]:
    """The unbalanced plan's global batches, each re-formed into as many balanced packs from its
    own samples where they fit; otherwise kept as they are. Returns the batches and how many
    were kept. ``costs``: per sample, from each ``(first batch, model, cost, fixed)`` on."""
    from lightning_vlmbalance.balance._source_kernel import balance_window, emit_packs

    plain = build_epoch_plan(total_tokens, image_tokens, config, num_replicas=R, epoch=epoch)
    n = plain.packs_per_rank
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    image_tokens = np.ascontiguousarray(image_tokens, dtype=np.int64)
    starts = [start for start, *_ in costs]
    batches, fallback = [], 0
    for k in range(0, n, G):
        _, _, cost, fixed = costs[bisect.bisect_right(starts, k // G) - 1]
        cost = np.ascontiguousarray(cost, dtype=np.float64)
        packs = [plain.rank_packs[r][j] for r in range(R) for j in range(k, min(k + G, n))]
        packs = Packs.from_lists([p for p in packs if len(p)])
        seq_s = np.empty(len(packs.positions), dtype=np.int64)
        seq_p = np.empty(len(packs.positions), dtype=np.int64)
        nseq, left, _ = balance_window(
            packs.positions,
            lengths,
            image_tokens,
            cost,
            len(packs),
            config.seq_len,
            fixed,
            balance.small_tokens,
            seq_s,
            seq_p,
        )
        if len(left):
            fallback += 1
            batches.append(packs)
        else:
            batches.append(emit_packs(seq_s[:nseq], seq_p[:nseq], len(packs)))
    return batches, fallback
