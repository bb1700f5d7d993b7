"""Online calibration of the cost model: refitted while training, from the ranks' own timings.

Balancing is only as good as its cost model, and the default coefficients were set for one
model: a user's encoder/decoder cost ratio can differ by an order of magnitude, and a run's cost
changes on purpose (a frozen vision tower unfrozen, a new resolution or sequence length). An
:class:`OnlineCalibrator` keeps a rolling window of micro-batch records (pack features and
measured phase times, as the StragglerMonitor writes them, from every rank) and refits a copy of
the current model on it:

1. the newest ``holdout`` share of the window's optimizer steps is held out;
2. a copy of the current model is fitted (:meth:`CostModel.fit`, the current coefficients as
   the prior of what the records cannot determine) on the rest;
3. the copy is accepted only if it predicts the held-out records better than the current model
   by ``min_gain`` (5% lower MAPE of the total, or of the mean of the fitted phases where no
   record has them all).

Records with a missing feature, or a non-finite or negative time, are skipped and counted
(:attr:`OnlineCalibrator.skipped`). A fit that fails (too few records, a degenerate window)
leaves the current model in place, with the reason in the :class:`Refit`.

**Stage changes.** :meth:`OnlineCalibrator.reset` drops the window: the model's cost changed on
purpose, the old timings no longer describe it (the refits then see only new records). A jump
is also detected: when the current model's error on the newest records is more than ``jump``
times its error when it was accepted, everything older than those records is dropped before the
refit.

The calibrator itself is pure (no torch, no collective): the StragglerMonitor feeds it every
rank's records and ships rank 0's accepted model to every rank, which adopts it from the same
global batch on (see :class:`~lightning_vlmbalance.callbacks.StragglerMonitor`).
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_vlmbalance.balance.cost import FEATURES, MEASURED_FIELDS, CostModel, FitReport
from lightning_vlmbalance.balance.model_schedule import ModelSchedule

__all__ = ["Calibration", "OnlineCalibrator", "Refit", "usable_records"]


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Options of online calibration.

    Attributes:
        every_n_steps: optimizer steps between refits.
        window_steps: optimizer steps of records kept (all ranks' micro-batches of each).
        holdout: the newest share of the window's steps the candidate is judged on.
        min_records: micro-batch records needed before a refit is tried.
        max_records: the most records a refit fits or judges on; beyond it an evenly spaced
            subset is used (the fit's time grows with the records: about 5 us each on one CPU
            core, ``benchmarks/calibration_cost.py``).
        jump: the current model's error on the newest records, over its error when accepted,
            beyond which the window before them is dropped (a stage change).
        min_gain: a candidate is accepted when its held-out error is below the current
            model's by at least this share (0.05: 5% lower): refits that only follow the
            timing noise do not churn the plans (a source-balanced sampler re-plans the rest of
            its epoch at each adoption).
    """

    every_n_steps: int = 50
    window_steps: int = 400
    holdout: float = 0.25
    min_records: int = 32
    max_records: int = 8192
    jump: float = 2.0
    min_gain: float = 0.05

    def __post_init__(self) -> None:
        for name in ("every_n_steps", "window_steps", "min_records", "max_records"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Calibration({name}={value!r}): must be an integer >= 1")
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"Calibration(holdout={self.holdout!r}): must be in (0, 1)")
        if not self.jump > 1.0:
            raise ValueError(f"Calibration(jump={self.jump!r}): must be > 1")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"Calibration(min_gain={self.min_gain!r}): must be in [0, 1)")


@dataclass(frozen=True)
class Refit:
    """The outcome of one refit.

    Attributes:
        accepted: whether the candidate replaced the current model.
        model: the model in use after the refit (the candidate when accepted).
        error_current: the current model's error on the held-out records (``None``: no refit).
        error_candidate: the candidate's error on them.
        records: records the candidate was fitted on; ``held_out``: records it was judged on.
        stage_change: whether a jump in the error dropped the older records first.
        reason: why no candidate was accepted (empty when one was).
        report: the candidate's fit report.
    """

    accepted: bool
    model: CostModel
    error_current: float | None = None
    error_candidate: float | None = None
    records: int = 0
    held_out: int = 0
    stage_change: bool = False
    reason: str = ""
    report: FitReport | None = None


class OnlineCalibrator:
    """A rolling window of micro-batch records and the refits of a cost model on it.

    Args:
        model: the model in use at the start (the defaults, or a calibrated file): refined,
            never replaced by a worse one. Or the fit's
            :class:`~lightning_vlmbalance.balance.model_schedule.ModelSchedule`, whose newest
            model is the one in use (a strategy's calibrator reads the strategy's schedule).
        config: the :class:`Calibration` options.
    """

    def __init__(self, model: CostModel | ModelSchedule, config: Calibration | None = None) -> None:
        self.config = config or Calibration()
        self.models = model if isinstance(model, ModelSchedule) else ModelSchedule(model)
        self.version = 0  # refits accepted
        self.skipped = 0  # records skipped: a missing feature, a non-finite or negative time
        self._window: deque[tuple[int, list[dict[str, Any]]]] = deque()
        self._accepted_error: float | None = None  # the model's held-out error when accepted
        # records are added by the training thread while a refit may run in another
        self._lock = threading.Lock()

    # -- records --------------------------------------------------------------------------
    def add(self, step: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Adds optimizer step ``step``'s micro-batch records (every rank's); returns how many
        were kept. Steps older than ``window_steps`` before the newest leave the window."""
        records = list(records)
        kept = usable_records(records)
        self.skipped += len(records) - len(kept)
        with self._lock:
            if kept:
                self._window.append((int(step), kept))
            newest = self._window[-1][0] if self._window else step
            while self._window and self._window[0][0] <= newest - self.config.window_steps:
                self._window.popleft()
        return len(kept)

    @property
    def records(self) -> int:
        with self._lock:
            return sum(len(r) for _, r in self._window)

    def reset(self) -> None:
        """A stage change on purpose (a frozen tower unfrozen, a new resolution): drops every
        record, so the next refits see only timings of the model as it is now."""
        with self._lock:
            self._window.clear()
            self._accepted_error = None

    # -- refit ----------------------------------------------------------------------------
    def refit(self, *, adopt: bool = True) -> Refit:
        """Fits a candidate on the window less its newest ``holdout`` steps and accepts it if it
        predicts those better than the current model (see the module docstring). Safe to run
        in another thread than :meth:`add`.

        Args:
            adopt: make an accepted candidate the model in use now (:meth:`adopt`); ``False``
                leaves that to the caller (the StragglerMonitor adopts it on every rank at once).
        """
        with self._lock:
            stage_change = self._drop_before_a_jump()
            window = list(self._window)
            current = self.model
        steps = sorted({s for s, _ in window})
        count = sum(len(r) for _, r in window)
        if count < self.config.min_records or len(steps) < 2:
            return Refit(
                False,
                current,
                stage_change=stage_change,
                reason=f"{count} records over {len(steps)} steps: too few to refit",
            )
        # the newest ``holdout`` share of the steps (at least one) is held out
        cut = steps[min(len(steps) - 1, max(1, math.floor(len(steps) * (1 - self.config.holdout))))]
        train = _spaced([r for s, recs in window if s < cut for r in recs], self.config.max_records)
        held = _spaced([r for s, recs in window if s >= cut for r in recs], self.config.max_records)
        candidate = copy.deepcopy(current)
        try:
            report = candidate.fit(train)
        except ValueError as err:
            return Refit(False, current, stage_change=stage_change, reason=f"fit failed: {err}")
        current_error = _error(current, held)
        candidate_error = _error(candidate, held)
        outcome = dict(
            error_current=current_error,
            error_candidate=candidate_error,
            records=len(train),
            held_out=len(held),
            stage_change=stage_change,
            report=report,
        )
        if candidate_error < current_error * (1.0 - self.config.min_gain):
            with self._lock:
                self._accepted_error = candidate_error
            if adopt:
                self.adopt(candidate)
            return Refit(True, candidate, **outcome)
        with self._lock:
            if self._accepted_error is None:
                self._accepted_error = current_error
        reason = (
            "the current model predicts better"
            if candidate_error >= current_error
            else f"the candidate predicts less than {self.config.min_gain:.0%} better"
        )
        return Refit(False, current, reason=reason, **outcome)

    @property
    def model(self) -> CostModel:
        """The model in use: the newest of the schedule."""
        return self.models.latest

    def adopt(self, model: CostModel, *, from_step: int = 0) -> None:
        """Makes ``model`` (an accepted refit) the model in use from optimizer step
        ``from_step``: the next refits start from it."""
        with self._lock:
            self.models.adopt(model, from_step)
            self.version += 1

    def count_adopted(self) -> None:
        """A refit of this calibrator was adopted by the schedule's owner (the strategy's
        rebalancer, at a step every rank agrees on): counts the version."""
        with self._lock:
            self.version += 1

    def _drop_before_a_jump(self) -> bool:
        """Drops the records before the newest period's when the current model's error on the
        newest step's is more than ``jump`` times its error when it was accepted (under the
        lock)."""
        if self._accepted_error is None or len(self._window) < 2:
            return False
        newest = self._window[-1][1]
        if _error(self.model, newest) <= self.config.jump * max(self._accepted_error, 1e-3):
            return False
        keep = self.config.every_n_steps  # the newest period's steps
        newest_step = self._window[-1][0]
        while self._window and self._window[0][0] <= newest_step - keep:
            self._window.popleft()
        self._accepted_error = None
        return True

    # -- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The model in use and the counters (the window is not saved: it refills)."""
        return {
            "model": self.model.to_dict(),
            "version": self.version,
            "skipped": self.skipped,
            "accepted_error": self._accepted_error,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, model: bool = True) -> None:
        """Restores :meth:`state_dict`; ``model=False`` leaves the schedule to its owner (who
        adopts the checkpoint's model where nothing planned it yet)."""
        try:  # read whole before anything changes (the schedule may be a strategy's)
            restored = CostModel.from_dict(state["model"]) if model else None
            version, skipped = int(state["version"]), int(state.get("skipped", 0))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"OnlineCalibrator.load_state_dict: not a calibrator state ({err!r}); expected"
                " the keys model, version (and skipped, accepted_error)"
            ) from err
        if restored is not None:
            self.models.reset(restored)
        self.version, self.skipped = version, skipped
        self._accepted_error = state.get("accepted_error")
        self._window.clear()


def _spaced(records: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """At most ``most`` of ``records``, evenly spaced (all of them when they are fewer)."""
    if len(records) <= most:
        return records
    return [records[i] for i in np.linspace(0, len(records) - 1, most).round().astype(int)]


def usable_records(records: Iterable[Any]) -> list[dict[str, Any]]:
    """Copies of the records a fit or an error can use: every pack feature and at least one
    measured time, each a finite number >= 0 (the others are skipped)."""
    return [dict(rec) for rec in records if _usable(rec)]


def _usable(rec: Mapping[str, Any]) -> bool:
    """Has every pack feature and at least one measured time, each a finite number >= 0, and
    some time above zero (a micro-batch takes time: all zeros are a timer that did not run,
    whose relative errors are NaN)."""
    if not isinstance(rec, Mapping) or not all(_number(rec.get(f)) for f in FEATURES):
        return False
    times = [rec[m] for m in MEASURED_FIELDS if rec.get(m) is not None]
    return bool(times) and all(_number(t) for t in times) and sum(times) > 0


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _error(model: CostModel, records: list[dict[str, Any]]) -> float:
    """The model's MAPE on the records: of the total where some records have every phase,
    else the mean over the phases they have."""
    if not records:
        return float("inf")
    report = model.evaluate(records)
    if "total_ms" in report.mape:
        return float(report.mape["total_ms"])
    values = [v for v in report.mape.values() if math.isfinite(v)]
    return float(sum(values) / len(values)) if values else float("inf")
