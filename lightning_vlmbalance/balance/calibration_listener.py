"""Online calibration during a fit: the rebalancer's listener to the StragglerMonitor's timed
steps (the core is :mod:`lightning_vlmbalance.balance.calibration`). The rebalancing strategy
owns it and subscribes it to the monitor; the monitor knows no strategy.

Every ``every_n_steps`` optimizer steps, on every rank at the same step:

1. each rank's micro-batch records since the last point (pack features and measured phase
   times) are gathered to every rank, with rank 0's latest refit result, in one
   ``all_gather_object`` (the only collective calibration adds);
2. an accepted result is adopted by every rank's rebalancer from the same global batch on
   (:meth:`Rebalancer.adopt <lightning_vlmbalance.strategy.Rebalancer.adopt>`); a sampler that
   balances at the source re-plans the rest of its epoch from the first global batch no rank
   has read yet (each rank's read position travels in the same gather);
3. rank 0 adds the records to its calibrator's window and starts the next refit in a
   background thread, whose result travels with the next point's gather: the fit costs rank 0
   a thread's time, and no rank waits for it.

Rank 0 logs ``calibration/*``: the model version in use, whether a refit was accepted, the
held-out errors of the current and the candidate model, and the in-use model's error per phase
on the newest records (its prediction error over time).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import torch.distributed as dist

from lightning_vlmbalance.balance.calibration import Refit, usable_records
from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.parallel import DataParallelWorld

__all__ = ["CalibrationListener"]

log = logging.getLogger(__name__)


class CalibrationListener:
    """Feeds a rebalancer's :class:`~lightning_vlmbalance.balance.calibration.OnlineCalibrator`
    from a monitor's timed steps, and adopts the refits every rank agrees on (a
    ``TimedStepsListener`` of :class:`~lightning_vlmbalance.StragglerMonitor`).

    Args:
        rebalancer: the strategy's ``Rebalancer`` (with a ``calibrator``; its ``adopt``,
            ``sampler_position`` and ``cost_model``).
    """

    state_key = "calibration"  # in the monitor's checkpoint state

    def __init__(self, rebalancer: Any) -> None:
        self.rebalancer = rebalancer
        self.calibrator = rebalancer.calibrator
        self.every = self.calibrator.config.every_n_steps
        self.world: DataParallelWorld | None = None
        self.is_rank_zero = False
        self._records: list[tuple[int, list[dict[str, Any]]]] = []  # local, since the last point
        self._thread: threading.Thread | None = None
        self._result: Refit | None = None  # rank 0: finished, not shipped yet
        self._lock = threading.Lock()
        self.shipped: list[dict[str, Any]] = []  # every result adopted, as shipped (rank 0's)
        self._told_reasons: set[str] = set()

    # -- the listener ------------------------------------------------------------------------
    def start(self, world: DataParallelWorld, global_step: int, state: Any = None) -> None:
        """At the start of training (after a checkpoint was restored): the gather spans every
        process of ``world`` and global rank 0 fits; ``state`` (this listener's
        :meth:`state_dict` from the checkpoint) restores the model the run was planning with,
        adopted from the first global batch."""
        self.world, self.is_rank_zero = world, world.global_rank == 0
        self._records = []
        if state is not None:
            self.calibrator.load_state_dict(state, model=False)
            model = CostModel.from_dict(state["model"])
            if model != self.rebalancer.cost_model:  # else the loader's state restored it
                self.rebalancer.adopt(model, global_step=global_step)
        if self.is_rank_zero:
            log.info(
                "lightning_vlmbalance: online calibration gathers timings every %d optimizer"
                " steps; the first refit is fitted after step %d and can be adopted at step %d"
                " (calibration/* metrics from step %d on)",
                self.every,
                self.every,
                2 * self.every,
                self.every,
            )

    def on_timed_steps(self, steps: list[Any], global_step: int) -> dict[str, float]:
        """Newly timed optimizer steps (``ResolvedStep``), on every rank after the same step;
        at a calibration point, the gather and the adoption (a collective). Returns rank 0's
        ``calibration/*`` metrics (empty elsewhere and between points)."""
        self.note(steps)
        return self.feed(global_step) if self.due(global_step) else {}

    def end(self) -> None:
        """At the end of training: the refit in flight is joined."""
        self.join()

    def state_dict(self) -> dict[str, Any]:
        """The model the run plans with and its version (the calibrator's state)."""
        return self.calibrator.state_dict()

    def note(self, steps: list[Any]) -> None:
        """Keeps the micro-batch records of newly resolved steps (``ResolvedStep``)."""
        for step in steps:
            self._records.append((int(step.global_step), [dict(m) for m in step.micro]))

    def due(self, global_step: int) -> bool:
        return global_step > 0 and global_step % self.every == 0

    def feed(self, global_step: int) -> dict[str, float]:
        """The calibration point (a collective: every rank calls it at the same step). Returns
        rank 0's ``calibration/*`` metrics (empty on the others)."""
        records, self._records = self._records, []
        payload = {
            "records": records,
            "result": self._take_result() if self.is_rank_zero else None,
            # how far a source-balanced sampler has read: it re-plans past every rank's
            "position": self.rebalancer.sampler_position(),
        }
        everyone: list[Any] = [payload]
        assert self.world is not None, "start() comes first"
        if self.world.world_size > 1:
            everyone = [None] * self.world.world_size
            dist.all_gather_object(everyone, payload)
        result = everyone[0]["result"]
        metrics: dict[str, float] = {}
        if result is not None and result["accepted"]:
            model = CostModel.from_dict(result["model"])
            positions = [p["position"] for p in everyone if p["position"] is not None]
            self.rebalancer.adopt(  # into the fit's schedule, from a step every rank agrees on
                model, global_step=global_step, sampler_after=max(positions, default=None)
            )
            self.calibrator.count_adopted()
            self.shipped.append({**result, "adopted_at_step": global_step})
        if not self.is_rank_zero:
            return metrics
        newest: list[dict[str, Any]] = []
        for gathered in everyone:
            for step, recs in gathered["records"]:
                self.calibrator.add(step, recs)
                newest.extend(recs)
        metrics["calibration/version"] = float(self.calibrator.version)
        metrics["calibration/skipped_records"] = float(self.calibrator.skipped)
        metrics["calibration/window_records"] = float(self.calibrator.records)
        if result is not None:
            metrics["calibration/accepted"] = float(result["accepted"])
            reason = result.get("reason")
            kind = re.sub(r"[\d.]+", "#", reason or "")  # the reason, its numbers aside
            if not result["accepted"] and reason and kind not in self._told_reasons:
                self._told_reasons.add(kind)  # said once per kind of reason
                # a fit that failed is a problem; a model kept because it predicts as well
                # (or too few records yet) is calibration doing its job
                level = logging.WARNING if reason.startswith("fit failed") else logging.INFO
                log.log(
                    level,
                    "lightning_vlmbalance: the cost-model refit at step %d was not adopted: %s",
                    global_step,
                    reason,
                )
            for key in ("error_current", "error_candidate"):
                if result.get(key) is not None:
                    metrics[f"calibration/{key}"] = float(result[key])
        usable = usable_records(newest)
        if usable:  # the model in use, on the newest records: its prediction error over time
            report = self.rebalancer.cost_model.evaluate(usable)
            for key, value in report.mape.items():
                metrics[f"calibration/mape_{key}"] = float(value)
        self._start_refit()
        return metrics

    def _start_refit(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # the last refit still runs: its result ships at a later point

        def run() -> None:
            try:
                result = self.calibrator.refit(adopt=False)  # adopted when shipped
            except Exception as err:  # never a crash: the model in use stays
                log.warning("lightning_vlmbalance: a cost-model refit failed (%s)", err)
                return
            with self._lock:
                self._result = result

        self._thread = threading.Thread(target=run, name="vlmbalance-calibration", daemon=True)
        self._thread.start()

    def _take_result(self) -> dict[str, Any] | None:
        with self._lock:
            result, self._result = self._result, None
        if result is None:
            return None
        return {
            "accepted": result.accepted,
            "model": result.model.to_dict(),
            "error_current": result.error_current,
            "error_candidate": result.error_candidate,
            "records": result.records,
            "held_out": result.held_out,
            "stage_change": result.stage_change,
            "reason": result.reason,
        }

    def join(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
