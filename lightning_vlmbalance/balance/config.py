"""``RebalanceConfig``: the rebalancing options, validated once, shared by the strategy, the
loader and the simulator (no Lightning import)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from lightning_vlmbalance.balance.calibration import Calibration
from lightning_vlmbalance.balance.choice import OPTIONS, PACK_OPTIONS
from lightning_vlmbalance.balance.planner import OBJECTIVES, Objective
from lightning_vlmbalance.parallel import resolve_objective

__all__ = ["MODES", "RebalanceConfig", "resolve_objective"]

Mode = Literal["auto", "overlap", "sync", "off"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass(kw_only=True, slots=True, frozen=True)
class RebalanceConfig:
    """How each global batch is rebalanced.

    Args:
        mode: ``"auto"`` (the default: each global batch, one global batch ahead in a
            background thread, is priced with the cost model for every option the model allows
            (packs as placed, packs moved, and with ``encoder=True`` images routed, or packs
            moved then images routed) as the ranks will meet, and the cheapest is carried out;
            see :mod:`~lightning_vlmbalance.balance.choice`), ``"overlap"`` (the pack planner
            and exchange, or with ``encoder=True`` the image routing, always, in the thread),
            ``"sync"`` (the same in line) or ``"off"`` (no move; the loss weights are still
            set).
        objective: ``"auto"`` (decided by who synchronises how often: ``"step"`` when ranks
            meet once per optimizer step, ``"microstep"`` when they meet every micro-batch),
            ``"microstep"``, ``"step"`` or ``"both"`` (see ``docs/rebalancing.md``).
        tolerance: planner tolerance, a fraction of the balance-optimal value that may be given
            up to move fewer packs.
        exchange_timeout_s: deadline of every wait for a peer or for the background thread; a
            failed or dead peer becomes an error on every rank within it.
        encoder: also balance the vision encoder image by image at every micro-step (the
            packs stay where they are: see ``docs/two_level_balancing.md``); the model encodes
            through :func:`~lightning_vlmbalance.balance.encoder.encode_images`.
        options: what ``"auto"`` chooses among, some of
            :data:`~lightning_vlmbalance.balance.choice.OPTIONS` (``"placed"``, ``"packs"``,
            ``"images"``, ``"both"``); default every option the model allows (the last two only
            with ``encoder=True``).
        calibration: online calibration of the cost model while training (a
            :class:`~lightning_vlmbalance.balance.calibration.Calibration`, the default one),
            or ``None`` to plan with the given model throughout. Needs the StragglerMonitor,
            whose timings it refits on.

    Raises:
        ValueError: for an unknown mode or objective, a negative tolerance or a non-positive
            timeout, quoting the call.

    Example::

        config = RebalanceConfig(mode="sync", tolerance=0.001)
        trainer = L.Trainer(strategy=VLMBalanceStrategy(config=config))
    """

    mode: Mode = "auto"
    objective: Literal["auto"] | Objective = "auto"
    tolerance: float = 0.0
    exchange_timeout_s: float = 300.0
    encoder: bool = False
    options: tuple[str, ...] | None = None
    calibration: Calibration | None = field(default_factory=Calibration)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`RebalanceConfig(mode={self.mode!r})`: expected one of {MODES}")
        if self.objective != "auto" and self.objective not in OBJECTIVES:
            raise ValueError(
                f"`RebalanceConfig(objective={self.objective!r})`: expected 'auto' or one of"
                f" {OBJECTIVES}"
            )
        if self.options is not None:
            options = tuple(self.options) if not isinstance(self.options, str) else ()
            unknown = [o for o in options if o not in OPTIONS]
            if unknown or not options:
                raise ValueError(
                    f"`RebalanceConfig(options={self.options!r})`: expected some of {OPTIONS}"
                )
            if self.mode != "auto":
                raise ValueError(
                    f"`RebalanceConfig(mode={self.mode!r}, options={self.options!r})`: options"
                    " are what mode='auto' chooses among; the other modes take no options"
                )
            if not self.encoder and any(o in ("images", "both") for o in options):
                raise ValueError(
                    f"`RebalanceConfig(options={self.options!r})`: routing images needs"
                    " `encoder=True` (a model that encodes through `encode_images`)"
                )
            object.__setattr__(self, "options", options)
        if not self.tolerance >= 0:
            raise ValueError(f"`RebalanceConfig(tolerance={self.tolerance!r})` must be >= 0")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ValueError(
                f"`RebalanceConfig(calibration={self.calibration!r})`: expected a Calibration"
                " or None"
            )
        if not self.exchange_timeout_s > 0:
            raise ValueError(
                f"`RebalanceConfig(exchange_timeout_s={self.exchange_timeout_s!r})` must be > 0"
            )

    @property
    def auto_options(self) -> tuple[str, ...]:
        """What ``"auto"`` chooses among: ``options``, else every option the model allows
        (images only with ``encoder=True``: a model encoding through
        :func:`~lightning_vlmbalance.balance.encoder.encode_images`)."""
        if self.options is not None:
            return tuple(self.options)
        return OPTIONS if self.encoder else PACK_OPTIONS

    def resolved(self, *, sync_every_micro_batch: bool) -> RebalanceConfig:
        """This config with ``objective="auto"`` decided: ``"microstep"`` if the ranks
        synchronise at every micro-batch (FSDP, or Lightning's per-micro-batch flag broadcast),
        else ``"step"``."""
        objective = resolve_objective(self.objective, sync_every_micro_batch=sync_every_micro_batch)
        return self if objective == self.objective else replace(self, objective=objective)
