"""Whether an epoch is formed at the source: the per-epoch decision of ``mode="auto"``.

A :class:`~lightning_vlmbalance.PackingSampler` that balances at the source
(``balance=SourceBalance(...)``, ``when="auto"``, the default) under a strategy in
``mode="auto"`` plans each epoch both ways, on the same samples: packed as they come
(:func:`~lightning_vlmbalance.packing.plan.build_epoch_plan`) and formed at the source
(:func:`~lightning_vlmbalance.balance.source.build_balanced_epoch_plan`), and where the loader
may route images (``encoder=True``) also formed by the language model's cost alone (the
encoder's work then spread by the routing: ``SourceBalance(llm_only=None)``). Each plan's global
batches are priced as the runtime will train them: :func:`~lightning_vlmbalance.balance.
choice.choose_step` with the options the strategy's loader has, each global batch at its
cheapest (what the loader's thread then decides again with the gathered features). Every plan
holds every sample once, so the fastest is the one of the smallest predicted epoch time; ties
keep the stream's order (the plain plan).

The prices come from the length table (a sample's image tokens split evenly over its images,
:class:`~lightning_vlmbalance.balance.images.PackImages`, as the simulator sees them) and the
cost model the epoch starts with: the calibrated one once online calibration has adopted a
refit. A refit adopted during the epoch re-plans its rest, but never changes the epoch's
decision (the batches trained so far were formed one way). Every rank computes the same
decision from the same integers and settings; the loader checks that the ranks agree at the
start of every pass.

At most :attr:`EpochRuntime.priced_batches` global batches of each plan are priced (evenly
spaced, the same on every rank), so the decision costs the same at any epoch length: it runs
where the plan is made (the first epoch's before the first step, later ones in the sampler's
background thread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_vlmbalance.balance.choice import OPTIONS, StepInputs, Transfer, choose_step
from lightning_vlmbalance.balance.cost import CostModel, features_from_packs
from lightning_vlmbalance.balance.images import PackImages
from lightning_vlmbalance.packing.binpack import Packs
from lightning_vlmbalance.packing.plan import EpochPlan

__all__ = ["PLANS", "EpochChoice", "EpochRuntime", "choose_epoch", "price_plan"]


@dataclass(frozen=True)
class EpochRuntime:
    """How the strategy's loader will train an epoch: what the per-epoch decision prices with.

    Attributes:
        options: what the loader chooses among every global batch (some of
            :data:`~lightning_vlmbalance.balance.choice.OPTIONS`).
        meets_every_micro_batch: whether the ranks meet at every micro-step anyway.
        objective: the pack planner's objective (``"step"`` or ``"microstep"``).
        tolerance: the pack planner's tolerance.
        transfer: what moving bytes costs.
        priced_batches: global batches priced per plan (evenly spaced over the epoch).
    """

    options: tuple[str, ...]
    meets_every_micro_batch: bool
    objective: str
    tolerance: float = 0.0
    transfer: Transfer = field(default_factory=Transfer)
    priced_batches: int = 32

    def __post_init__(self) -> None:
        bad = [o for o in self.options if o not in OPTIONS]
        if bad or not self.options:
            raise ValueError(f"EpochRuntime(options={self.options!r}): expected some of {OPTIONS}")
        if self.objective not in ("step", "microstep"):
            raise ValueError(f"EpochRuntime(objective={self.objective!r}): 'step' or 'microstep'")
        if self.priced_batches < 1:
            raise ValueError(f"EpochRuntime(priced_batches={self.priced_batches}) must be >= 1")

    @property
    def routes_images(self) -> bool:
        """Whether the loader may encode a pack's images on another rank."""
        return any(o in ("images", "both") for o in self.options)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a sampler's fingerprint: the decision depends on it)."""
        return {
            "options": list(self.options),
            "meets_every_micro_batch": self.meets_every_micro_batch,
            "objective": self.objective,
            "tolerance": self.tolerance,
            "transfer": {k: getattr(self.transfer, k) for k in self.transfer.__dataclass_fields__},
            "priced_batches": self.priced_batches,
        }


PLANS: tuple[str, ...] = ("plain", "formed", "formed_llm")  # in the order ties go


@dataclass(frozen=True)
class EpochChoice:
    """One epoch's decision: the plan taken (``"plain"``: packed as the samples come;
    ``"formed"``: formed at the source by every phase's cost; ``"formed_llm"``: by the language
    model's alone) and every priced plan's predicted epoch time in milliseconds."""

    taken: str
    prices: dict[str, float]

    @property
    def formed_at_source(self) -> bool:
        return self.taken != "plain"

    def to_dict(self) -> dict[str, Any]:
        return {"taken": self.taken, **{f"{k}_ms": v for k, v in self.prices.items()}}


def _priced_positions(batches: int, priced: int) -> np.ndarray:
    """The global batches priced: all, or ``priced`` evenly spaced (first and last included)."""
    if batches <= priced:
        return np.arange(batches)
    return np.unique(np.rint(np.linspace(0, batches - 1, priced)).astype(np.int64))


def price_plan(
    plan: EpochPlan,
    *,
    micro_steps: int,
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    cost_model: CostModel,
    runtime: EpochRuntime,
) -> float:
    """The predicted time of ``plan``'s epoch in milliseconds: the mean of its priced global
    batches' cheapest steps times its global batches. ``total_tokens``, ``image_tokens`` and
    ``images``: the length table the plan's sample ids index (a sample longer than the pack
    counted at the pack's length, as it is cut or skipped)."""
    R, G = plan.num_replicas, int(micro_steps)
    n = plan.packs_per_rank
    batches = math.ceil(n / G)
    if batches == 0:
        return 0.0
    positions = _priced_positions(batches, runtime.priced_batches)
    empty = np.zeros(0, np.int64)
    flat = [
        plan.rank_packs[r][k] if k < n else empty
        for b in positions.tolist()
        for r in range(R)
        for k in range(b * G, b * G + G)
    ]
    packs = Packs.from_lists(flat)
    total = np.minimum(np.asarray(total_tokens, dtype=np.int64), plan.seq_len)
    image = np.asarray(image_tokens, dtype=np.int64)
    count = np.asarray(images, dtype=np.int64)
    feats = features_from_packs(packs, total, image, count)
    pack_ms = cost_model.pack_cost_ms(feats)
    pack_ms[feats["total_tokens"] == 0] = 0.0
    per_pack = PackImages.of(packs, feats, image, count, cost_model)
    nbytes = runtime.transfer.pack_bytes(feats["total_tokens"], feats["image_tokens"])
    step = R * G
    priced = [
        choose_step(
            StepInputs.of_pack_images(
                per_pack, pack_ms, nbytes, np.arange(i * step, (i + 1) * step), R
            ),
            options=runtime.options,
            objective=runtime.objective,
            meets_every_micro_batch=runtime.meets_every_micro_batch,
            threaded=True,
            transfer=runtime.transfer,
            tolerance=runtime.tolerance,
        ).step_ms
        for i in range(len(positions))
    ]
    return float(np.mean(priced)) * batches


def choose_epoch(
    plans: dict[str, EpochPlan],
    *,
    micro_steps: int,
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    images: np.ndarray,
    cost_model: CostModel,
    runtime: EpochRuntime,
) -> EpochChoice:
    """Prices each of one epoch's ``plans`` (keys of :data:`PLANS`, on the same samples:
    :func:`price_plan`) and takes the fastest; ties go to the one that changes the stream's
    order least (the order of :data:`PLANS`)."""
    bad = [k for k in plans if k not in PLANS]
    if bad or "plain" not in plans:
        raise ValueError(f"choose_epoch: plans {list(plans)}: 'plain' and some of {PLANS}")
    prices = {
        name: price_plan(
            plan,
            micro_steps=micro_steps,
            total_tokens=total_tokens,
            image_tokens=image_tokens,
            images=images,
            cost_model=cost_model,
            runtime=runtime,
        )
        for name, plan in plans.items()
    }
    taken = min(prices, key=lambda k: (prices[k], PLANS.index(k)))
    return EpochChoice(taken, prices)
