"""The fit's one holder of the cost model in use: ``ModelSchedule``, keyed by optimizer step."""

from __future__ import annotations

import pytest

from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.model_schedule import ModelSchedule


def _model(scale: float) -> CostModel:
    base = CostModel().coefficients
    return CostModel(
        coefficients={p: {t: v * scale for t, v in c.items()} for p, c in base.items()}
    )


def test_a_model_plans_from_its_step_and_a_later_adoption_replaces_what_follows() -> None:
    a, b, c = _model(1.0), _model(2.0), _model(3.0)
    models = ModelSchedule(a)
    models.adopt(b, 10)
    assert [models.at(s) for s in (0, 9, 10, 50)] == [a, a, b, b]
    models.adopt(c, 5)  # scheduled earlier: b (from 10) is replaced, not kept after c
    assert models.entries == [(0, a), (5, c)] and models.latest == c
    models.adopt(b, 0)
    assert models.entries == [(0, b)]


def test_the_schedule_round_trips_through_a_checkpoint_state() -> None:
    models = ModelSchedule(_model(1.0))
    models.adopt(_model(0.5), 7)
    restored = ModelSchedule()
    restored.load_state_dict(models.state_dict())
    assert restored.entries == models.entries
    with pytest.raises(ValueError, match="at least one model"):
        restored.load_state_dict({"entries": []})


def test_the_strategy_loader_and_calibrator_read_one_schedule() -> None:
    """The rebalancer, its calibrator and its training loader hold no model of their own: a
    refit adopted at a step is what each of them reads."""
    import lightning_vlmbalance as vb
    from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader

    rebalancer = vb.VLMBalanceStrategy(mode="sync").rebalancer
    rebalancer.loader = RebalancingLoader(
        [], micro_steps=2, num_replicas=1, rank=0, mode="sync", models=rebalancer.models
    )
    rebalancer._wrapped_at_step = 100
    rebalancer.loader.former._planned = 1  # one global batch formed: the switch is ahead
    refit = _model(0.25)
    assert rebalancer.adopt(refit, global_step=100) == 3
    assert rebalancer.models.entries[-1] == (103, refit)
    assert rebalancer.cost_model == rebalancer.calibrator.model == rebalancer.loader.cost_model
    assert rebalancer.cost_model == refit


def test_a_resumed_loader_plans_each_step_with_the_uninterrupted_runs_model() -> None:
    """The schedule travels in the loader's checkpoint state: a refit adopted from step 12,
    saved at step 10, plans step 12 on the resumed run too (not from its first batch)."""
    from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader

    class Source(list):
        start = 0

        def state_at(self, position: int) -> dict:
            return {"consumed": position}

        def state_dict(self) -> dict:
            return {"consumed": 0}

        def load_state_dict(self, state: dict) -> None:
            self.loaded = state

    start, refit = _model(1.0), _model(4.0)
    saved_models = ModelSchedule(start)
    saved_models.adopt(refit, 12)
    saved = RebalancingLoader(Source(), micro_steps=1, num_replicas=1, rank=0, models=saved_models)
    state = saved.state_dict()

    models = ModelSchedule(start)
    source = Source()
    resumed = RebalancingLoader(
        source, micro_steps=1, num_replicas=1, rank=0, models=models, first_step=10
    )
    resumed.load_state_dict(state)
    assert source.loaded == {"consumed": 0}  # the source gets its own state only
    planned = [resumed.former.model_for_next_batch() for _ in range(3)]  # steps 10, 11, 12
    assert planned == [start, start, refit]


def test_a_state_or_a_model_that_is_not_one_is_refused_by_name() -> None:
    """Out-of-order steps loaded as given answered the wrong model (``at(12)`` gave step 0's);
    ``adopt(None, ...)`` made the next plan's model ``None``; a calibrator state without a
    version reset the strategy's shared schedule before it failed."""
    from lightning_vlmbalance.balance.calibration import OnlineCalibrator

    a, b = _model(1.0), _model(2.0)
    models = ModelSchedule(a)
    for entries in ([[10, b.to_dict()], [0, a.to_dict()]], [[5, a.to_dict()]], [[0]]):
        with pytest.raises(ValueError, match=r"ModelSchedule\.load_state_dict"):
            models.load_state_dict({"entries": entries})
    with pytest.raises(TypeError, match="expected a CostModel"):
        models.adopt(None, 3)  # type: ignore[arg-type]
    assert models.entries == [(0, a)]
    calibrator = OnlineCalibrator(models)
    with pytest.raises(ValueError, match="not a calibrator state"):
        calibrator.load_state_dict({"model": b.to_dict()})
    assert models.latest is a and calibrator.version == 0
