"""Where each image of a global batch is encoded (encoder balancing's plan; numpy only).

Every pack stays on its rank. With ``reorder``, each rank's packs are first re-ordered over the
micro-steps so that every micro-step carries about the same vision work
(:func:`~lightning_vlmbalance.balance.images.order_micro_steps`); then, micro-step by
micro-step, the images are planned to the ranks' encoders
(:func:`~lightning_vlmbalance.balance.images.plan_images`). Every rank computes the same plan
from the same gathered integers; the loader's former turns it into routes and moves the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_vlmbalance.balance.cost import FEATURES, CostModel

__all__ = ["ImageRouting", "MicroStepImages", "plan_image_routing", "route_images"]


@dataclass(frozen=True)
class MicroStepImages:
    """The images of one micro-step, every rank's, in rank order then each pack's image order."""

    home: np.ndarray  # the rank whose pack holds the image
    index: np.ndarray  # the image's index in its pack
    rows: np.ndarray  # its rows (image tokens)
    encoder: np.ndarray  # the rank that encodes it

    @property
    def moved_any(self) -> bool:
        return bool((self.encoder != self.home).any())


@dataclass(frozen=True)
class ImageRouting:
    """The plan of one global batch: ``placed[r, m]`` is the global pack (``rank * G + slot``)
    rank ``r`` computes at micro-step ``m``; ``steps[m]`` its images; the predicted waste of
    the step as the ranks meet, with the plan and with every image encoded at home.

    What the step's price needs (:mod:`~lightning_vlmbalance.balance.choice`), ``(W, G)`` by
    rank and micro-step: ``llm_ms`` the language model of the pack placed there, ``load_ms``
    the rank's encoder work with the plan (its per-call cost and the images it encodes),
    ``home_ms`` the same with every image encoded at home (the encoder's per-call cost only
    where the pack has an image)."""

    placed: np.ndarray
    steps: list[MicroStepImages]
    moved_images: int
    planned_waste_frac: float
    baseline_waste_frac: float
    llm_ms: np.ndarray
    load_ms: np.ndarray
    home_ms: np.ndarray

    @property
    def moved(self) -> np.ndarray:
        """``(G,)``: whether a micro-step moves an image (its returns make it a meeting)."""
        return np.array([s.moved_any for s in self.steps], dtype=bool)


def plan_image_routing(
    features: np.ndarray, sizes: np.ndarray, cost_model: CostModel, world: int, *, reorder: bool
) -> ImageRouting:
    """Plans one global batch of ``world`` ranks.

    Args:
        features: every pack's features, rank by rank (``(world * G, F)``, columns
            :data:`~lightning_vlmbalance.balance.cost.FEATURES` first).
        sizes: every pack's image sizes (rows per image), zero-padded (``(world * G, K)``).
        cost_model: what an image and a pack's language work cost.
        reorder: whether each rank's packs are re-ordered over the micro-steps.
    """
    counts = features[:, FEATURES.index("images")]
    image_ms, per_call = cost_model.image_cost_ms(sizes)
    llm_ms = cost_model.llm_cost_ms({n: features[:, i] for i, n in enumerate(FEATURES)})
    return route_images(llm_ms, image_ms, sizes, counts, per_call, world, reorder=reorder)


def route_images(
    llm_ms: np.ndarray,
    image_ms: np.ndarray,
    sizes: np.ndarray,
    counts: np.ndarray,
    per_call_ms: float,
    world: int,
    *,
    reorder: bool,
) -> ImageRouting:
    """:func:`plan_image_routing` from what the cost model says of each pack: ``llm_ms``
    ``(N,)``, ``image_ms`` and ``sizes`` ``(N, K)`` (each image's encoder cost and rows,
    zero-padded), ``counts`` ``(N,)`` images per pack, the encoder's ``per_call_ms``; ``N =
    world * G`` packs, rank by rank (the simulator plans from its tables this way)."""
    # numba's import (about 0.1 s) only in the processes that balance images
    from lightning_vlmbalance.balance.images import order_micro_steps, plan_images

    W, G = world, len(llm_ms) // world
    counts = np.asarray(counts, dtype=np.int64)
    present = np.arange(sizes.shape[1])[None, :] < counts[:, None]
    image_ms = np.where(present, image_ms, 0.0)
    placed = np.arange(W * G, dtype=np.int64).reshape(W, G)  # global pack: rank * G + m
    if reorder:
        placed = np.take_along_axis(placed, order_micro_steps(image_ms.sum(axis=1)[placed]), 1)
    steps, moved = [], 0
    load_ms, home_ms, routed_home = np.zeros((W, G)), np.zeros((W, G)), np.zeros((W, G))
    for m in range(G):
        packs = placed[:, m]
        home = np.repeat(np.arange(W), counts[packs])
        plan = plan_images(np.full(W, per_call_ms), image_ms[packs][present[packs]], home)
        steps.append(
            MicroStepImages(
                home=home,
                index=np.concatenate([np.arange(counts[p]) for p in packs]).astype(np.int64),
                rows=np.concatenate([sizes[p, : counts[p]] for p in packs]).astype(np.int64),
                encoder=plan.encoder,
            )
        )
        moved += plan.moved_images
        load_ms[:, m], routed_home[:, m] = plan.load, plan.load_home
        # at home (no route) a pack without images does not call the encoder
        home_ms[:, m] = plan.load_home - np.where(counts[packs] > 0, 0.0, per_call_ms)
    llm = np.asarray(llm_ms, dtype=np.float64)[placed]
    spent = float((llm.max(axis=0) + load_ms.max(axis=0)).sum())  # as the ranks meet
    spent_home = float((llm.max(axis=0) + routed_home.max(axis=0)).sum())
    ideal = float((llm.mean(axis=0) + load_ms.mean(axis=0)).sum())
    return ImageRouting(
        placed=placed,
        steps=steps,
        moved_images=moved,
        planned_waste_frac=1.0 - ideal / spent if spent > 0 else 0.0,
        baseline_waste_frac=1.0 - ideal / spent_home if spent_home > 0 else 0.0,
        llm_ms=llm,
        load_ms=load_ms,
        home_ms=home_ms,
    )
