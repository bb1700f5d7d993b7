"""Which cost model plans each global batch: the one answer, held in one place.

A fit starts with one cost model (the defaults, a calibrated file, or a source-balanced
sampler's); online calibration adopts refits while it trains. Every rank must plan each global
batch with the same model, however far ahead its loader (or the loader's overlap thread) forms
batches, so a new model applies from an optimizer step every rank agrees on, never "from now".
:class:`ModelSchedule` is that record: ``[(from_step, model), ...]``, keyed by the optimizer
step (``trainer.global_step`` before it) that trains the global batch. The strategy's
``Rebalancer`` owns one per fit; its training loader, its calibrator and its metrics read it.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Mapping
from typing import Any

from lightning_vlmbalance.balance.cost import CostModel

__all__ = ["ModelSchedule"]


class ModelSchedule:
    """The cost models of a fit by the first optimizer step each plans.

    Args:
        model: the model from step 0 on (default :class:`CostModel`).

    Reads and adoptions are safe from several threads (a loader's overlap thread plans while
    the training thread adopts).
    """

    def __init__(self, model: CostModel | None = None) -> None:
        if model is not None:
            _check_model(model, "ModelSchedule")
        self._lock = threading.Lock()
        self._entries: list[tuple[int, CostModel]] = [(0, model or CostModel())]

    def at(self, step: int) -> CostModel:
        """The model that plans the global batch optimizer step ``step`` trains."""
        with self._lock:
            index = bisect.bisect_right([s for s, _ in self._entries], int(step)) - 1
            return self._entries[max(index, 0)][1]

    @property
    def latest(self) -> CostModel:
        """The newest model: the one a refit is judged against and a loader made later plans
        with from its first batch."""
        with self._lock:
            return self._entries[-1][1]

    @property
    def entries(self) -> list[tuple[int, CostModel]]:
        with self._lock:
            return list(self._entries)

    def adopt(self, model: CostModel, from_step: int) -> None:
        """Plans with ``model`` from optimizer step ``from_step`` on (it replaces models
        scheduled from that step or later). Every rank adopts the same model at the same step."""
        _check_model(model, "ModelSchedule.adopt")
        from_step = max(0, int(from_step))
        with self._lock:
            kept = [(s, m) for s, m in self._entries if s < from_step]
            self._entries = [*kept, (from_step, model)] if kept else [(0, model)]

    def reset(self, model: CostModel) -> None:
        """``model`` plans every step (a model given before anything was planned)."""
        _check_model(model, "ModelSchedule.reset")
        with self._lock:
            self._entries = [(0, model)]

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": [[s, m.to_dict()] for s, m in self._entries]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`.

        Raises:
            ValueError: for a state that is not one (no ``entries``; steps not increasing from
                0; an entry that is not ``[step, model]``), naming what is wrong.
        """
        where = "ModelSchedule.load_state_dict"
        try:
            entries = [(int(s), CostModel.from_dict(m)) for s, m in state["entries"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{where}: expected {{'entries': [[step, model dict], ...]}} ({err})"
            ) from err
        steps = [s for s, _ in entries]
        if not steps or steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(
                f"{where}: the steps must start at 0 and increase, got {steps} (a schedule"
                " holds at least one model)"
            )
        with self._lock:
            self._entries = entries

    def __repr__(self) -> str:
        return f"ModelSchedule(from steps {[s for s, _ in self.entries]})"


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, CostModel):
        raise TypeError(f"`{where}`: expected a CostModel, got {type(model).__name__}")
