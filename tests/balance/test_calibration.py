"""Online calibration's core (``balance/calibration.py``): refits on a rolling window, judged on
held-out records, never a worse model, bad records skipped and counted, stage changes."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlmbalance.balance.calibration import Calibration, OnlineCalibrator
from lightning_vlmbalance.balance.cost import FEATURES, CostModel


def _records(truth: CostModel, n: int, seed: int, noise: float = 0.02) -> list[dict]:
    """``n`` micro-batch records with varied packs, timed by ``truth`` (+ noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        images = int(rng.integers(0, 4))
        sizes = rng.integers(64, 1280, size=images)
        total = int(rng.integers(2048, 8192))
        docs = rng.integers(64, 2048, size=int(rng.integers(1, 6)))
        feats = {
            "total_tokens": total,
            "image_tokens": int(sizes.sum()),
            "images": images,
            "doc_sq_tokens": int((docs.astype(np.int64) ** 2).sum()),
            "image_sq_tokens": int((sizes.astype(np.int64) ** 2).sum()),
        }
        assert set(feats) == set(FEATURES)
        pred = truth.predict({k: [v] for k, v in feats.items()})
        jitter = rng.normal(1.0, noise, size=3)
        out.append(
            {
                **feats,
                "vision_fwd_ms": float(pred["vision_fwd"][0] * jitter[0]),
                "llm_fwd_ms": float(pred["llm_fwd"][0] * jitter[1]),
                "backward_ms": float((pred["vision_bwd"][0] + pred["llm_bwd"][0]) * jitter[2]),
            }
        )
    return out


def _scaled(model: CostModel, vision: float, llm: float) -> CostModel:
    data = model.to_dict()
    for phase, terms in data["coefficients"].items():
        for term in terms:
            terms[term] *= vision if phase.startswith("vision") else llm
    return CostModel.from_dict(data)


def _feed(cal: OnlineCalibrator, truth: CostModel, steps: range, seed: int = 0) -> None:
    for s in steps:
        cal.add(s, _records(truth, 8, seed=seed * 100_000 + s))


def test_a_wrong_model_is_replaced_by_a_better_one_and_never_by_a_worse() -> None:
    truth = _scaled(CostModel(), vision=4.0, llm=0.5)  # far from the defaults
    cal = OnlineCalibrator(CostModel(), Calibration(every_n_steps=10, window_steps=40))
    _feed(cal, truth, range(20))
    first = cal.refit()
    assert first.accepted and cal.version == 1, first
    assert first.error_candidate < 0.1 < first.error_current
    # the accepted model predicts the truth; a refit on more of the same keeps or improves it
    held = _records(truth, 64, seed=999)
    error = cal.model.evaluate(held).mape["total_ms"]
    assert error < 0.05, error
    _feed(cal, truth, range(20, 40))
    again = cal.refit()
    assert again.model is cal.model
    if not again.accepted:  # worse, or better only by the noise: never a churn
        assert again.error_candidate > 0.95 * again.error_current, again
        assert again.reason in (
            "the current model predicts better",
            "the candidate predicts less than 5% better",
        )
    assert cal.model.evaluate(held).mape["total_ms"] <= error + 0.01


def test_bad_records_are_skipped_and_counted() -> None:
    truth = CostModel()
    good = _records(truth, 4, seed=1)
    bad = [
        {**good[0], "vision_fwd_ms": float("nan")},
        {**good[0], "llm_fwd_ms": -1.0},
        {**good[0], "backward_ms": float("inf")},
        {k: v for k, v in good[0].items() if k != "images"},  # a feature missing
        {k: v for k, v in good[0].items() if not k.endswith("_ms")},  # no time at all
        "not a record",
    ]
    cal = OnlineCalibrator(CostModel())
    assert cal.add(0, [*good, *bad]) == 4
    assert cal.skipped == 6 and cal.records == 4


def test_too_few_records_or_a_failing_fit_keep_the_model() -> None:
    model = CostModel()
    cal = OnlineCalibrator(model, Calibration(min_records=32))
    cal.add(0, _records(model, 8, seed=2))
    out = cal.refit()
    assert not out.accepted and out.model is model and "too few" in out.reason
    # records that time only the vision forward, all of one pack: the fit cannot determine
    # enough, and the model in use stays
    one = {**_records(model, 1, seed=3)[0]}
    for k in ("llm_fwd_ms", "backward_ms"):
        one.pop(k)
    cal = OnlineCalibrator(model, Calibration(min_records=2))
    cal.add(0, [one])
    cal.add(1, [one])
    out = cal.refit()
    assert out.model is model and cal.version == 0


def test_a_stage_change_drops_the_old_window() -> None:
    """Unfreezing the vision tower: its cost jumps. The jump is detected (the current model's
    error on the newest step is far above its error when accepted) and the refit sees only the
    new timings; ``reset`` does it on purpose."""
    frozen = _scaled(CostModel(), vision=0.5, llm=1.0)
    unfrozen = _scaled(CostModel(), vision=3.0, llm=1.0)
    config = Calibration(every_n_steps=10, window_steps=200, min_records=16)
    cal = OnlineCalibrator(CostModel(), config)
    _feed(cal, frozen, range(30))
    assert cal.refit().accepted
    _feed(cal, unfrozen, range(30, 40), seed=1)
    out = cal.refit()
    assert out.stage_change and out.accepted, out
    held = _records(unfrozen, 64, seed=7)
    assert cal.model.evaluate(held).mape["total_ms"] < 0.05
    cal.reset()
    assert cal.records == 0
    assert not cal.refit().accepted  # nothing left to fit


def test_the_state_round_trips_without_the_window() -> None:
    truth = _scaled(CostModel(), vision=2.0, llm=2.0)
    cal = OnlineCalibrator(CostModel(), Calibration(min_records=8))
    _feed(cal, truth, range(10))
    assert cal.refit().accepted
    state = cal.state_dict()
    again = OnlineCalibrator(CostModel())
    again.load_state_dict(state)
    assert again.version == 1 and again.records == 0
    assert again.model.to_dict() == cal.model.to_dict()


@pytest.mark.parametrize(
    "bad",
    [
        {"every_n_steps": 0},
        {"window_steps": -1},
        {"holdout": 1.0},
        {"holdout": 0.0},
        {"jump": 1.0},
        {"min_records": 2.5},
        {"min_gain": 1.0},
        {"min_gain": -0.1},
    ],
)
def test_bad_options_are_named(bad) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"Calibration\({name}="):
        Calibration(**bad)


def test_a_large_window_is_fitted_on_an_evenly_spaced_subset() -> None:
    """``max_records`` bounds a refit's time: beyond it, evenly spaced records are used."""
    truth = _scaled(CostModel(), vision=3.0, llm=0.5)
    cal = OnlineCalibrator(CostModel(), Calibration(min_records=8, max_records=40))
    _feed(cal, truth, range(20))  # 160 records
    out = cal.refit()
    assert out.accepted and out.records + out.held_out <= 80, out
    assert cal.model.evaluate(_records(truth, 64, seed=5)).mape["total_ms"] < 0.05


def test_a_candidate_must_beat_the_current_model_by_min_gain() -> None:
    """A model 10% off the truth: the refit predicts the held-out records about 10x better;
    that is enough under ``min_gain=0.5`` and not under ``0.95`` (which asks for 20x)."""
    near = _scaled(CostModel(), vision=1.1, llm=1.1)
    for gain, adopted in ((0.5, True), (0.95, False)):
        cal = OnlineCalibrator(near, Calibration(every_n_steps=10, min_gain=gain))
        _feed(cal, CostModel(), range(20))
        refit = cal.refit()
        assert refit.error_candidate < 0.2 * refit.error_current, refit
        assert refit.accepted is adopted and cal.version == int(adopted), refit
        if not adopted:
            assert refit.reason == "the candidate predicts less than 95% better"


# -- the joints: the model the sampler plans with is the model calibration judges ---------------


def _balanced_sampler(model: CostModel | None = None):
    import lightning_vlmbalance as vb
    from lightning_vlmbalance.synthetic import synthetic_length_table

    table = synthetic_length_table(200, text_share=0.3, tile_tokens=8, max_text_tokens=64, seed=1)
    balance = vb.SourceBalance(cost_model=model, micro_steps=2)
    return vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=128, balance=balance, num_replicas=1
    )


def test_the_calibrator_judges_the_model_the_sampler_plans_with() -> None:
    """``balance=SourceBalance(cost_model=...)`` and no strategy model: the model in use is
    the sampler's, and the calibrator judged candidates against the strategy's default instead
    (a refit worse than the file's model could be adopted; ``calibration/mape_*`` reported the
    default's error)."""
    import lightning_vlmbalance as vb

    own = _scaled(CostModel(), 3.0, 3.0)
    strategy = vb.VLMBalanceStrategy()
    rebalancer = strategy.rebalancer
    rebalancer._one_model_with(_balanced_sampler(own))
    assert rebalancer.calibrator.model == own and rebalancer.cost_model == own


def test_a_reloaded_sampler_plans_with_the_adopted_model() -> None:
    """``reload_dataloaders_every_n_epochs`` after an adopted refit: the new loader's sampler
    plans with the adopted model (version 1), not its starting one."""
    import lightning_vlmbalance as vb

    strategy = vb.VLMBalanceStrategy()
    rebalancer = strategy.rebalancer
    rebalancer._one_model_with(_balanced_sampler())
    adopted = _scaled(CostModel(), 0.5, 0.5)
    rebalancer.calibrator.adopt(adopted)  # into the strategy's schedule, which it shares
    reloaded = _balanced_sampler()
    rebalancer._one_model_with(reloaded)
    assert reloaded.cost_model == adopted and reloaded.cost_schedule(0) == [(0, adopted)]


def test_a_resume_plans_its_first_global_batch_with_the_checkpoints_model() -> None:
    """A resume adopts the checkpoint's model before any global batch is planned: it applies
    from the first one (it was the fourth: three planned with the starting model)."""
    import lightning_vlmbalance as vb
    from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader

    strategy = vb.VLMBalanceStrategy(mode="off")
    rebalancer = strategy.rebalancer
    rebalancer.loader = RebalancingLoader(
        [], micro_steps=2, num_replicas=1, rank=0, mode="off", models=rebalancer.models
    )
    checkpointed = _scaled(CostModel(), 2.0, 2.0)
    assert rebalancer.adopt(checkpointed, global_step=40) == 0
    assert rebalancer.loader.former.model_for_next_batch() == checkpointed


def test_records_with_no_time_at_all_are_skipped() -> None:
    """All-zero timings (a timer that did not run) gave a NaN error, then a false stage change
    that dropped the window: they are skipped and counted, like other bad records."""
    from lightning_vlmbalance.balance.calibration import usable_records

    good = _records(CostModel(), 4, seed=3)
    zero = [{**r, "vision_fwd_ms": 0.0, "llm_fwd_ms": 0.0, "backward_ms": 0.0} for r in good]
    assert usable_records(good + zero) == good


def test_a_refit_that_is_not_adopted_says_why(caplog) -> None:
    """``calibration/accepted=0`` alone never said why (``max_records=3``: fewer records than
    terms, so the fit fails): rank 0 logs the reason once per kind, and when the first refit
    comes."""
    import logging
    from types import SimpleNamespace

    import lightning_vlmbalance as vb
    from lightning_vlmbalance.balance.calibration_listener import CalibrationListener
    from lightning_vlmbalance.parallel import DataParallelWorld

    config = vb.RebalanceConfig(calibration=Calibration(every_n_steps=2, max_records=3))
    rebalancer = vb.VLMBalanceStrategy(config=config).rebalancer
    world = DataParallelWorld(size=1, rank=0, world_size=1, global_rank=0, gradient_ranks=1)
    with caplog.at_level(logging.INFO, logger="lightning_vlmbalance"):
        driver = CalibrationListener(rebalancer)
        driver.start(world, global_step=0)
        records = _records(CostModel(), 64, seed=5)
        for step in (2, 4, 6, 8):
            for s in range(step - 1, step + 1):
                batch = records[(s % 8) * 8 : (s % 8) * 8 + 8]
                driver.note([SimpleNamespace(global_step=s, micro=batch)])
            metrics = driver.feed(step)
            driver.join()
    assert "the first refit is fitted after step 2 and can be adopted at step 4" in caplog.text
    assert metrics["calibration/accepted"] == 0.0
    told = [r.message for r in caplog.records if "was not adopted" in r.message]
    failed = [m for m in told if "fit failed" in m and "fewer than the 4 terms" in m]
    assert len(failed) == 1, told  # steps 6 and 8 failed alike: said once


@pytest.mark.usefixtures("restore_process_state")
def test_calibration_listens_to_the_monitor_and_says_when_there_is_none(tmp_path) -> None:
    """The rebalancer subscribes its calibration to the fit's StragglerMonitor (the monitor
    knows no strategy), which feeds it every timed step and keeps its state in checkpoints;
    without a monitor, calibration is on and would do nothing: it says so, once."""
    import warnings

    import lightning_vlmbalance as vb
    from examples.vlm import ToyVLM
    from tests.cpu_fit import cpu_trainer, packed_loader
    from tests.test_lightning_seam import SMALL_VLM

    class Fit(ToyVLM):
        def __init__(self) -> None:
            super().__init__(**SMALL_VLM, max_positions=128)

        def train_dataloader(self):
            return packed_loader(self.trainer)

    monitor = vb.StragglerMonitor(log_every_n_steps=1, jsonl_dir=tmp_path)
    config = vb.RebalanceConfig(mode="off", calibration=Calibration(every_n_steps=2))
    strategy = vb.VLMBalanceStrategy(config=config)
    trainer = cpu_trainer([monitor], steps=4, strategy=strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Fit())
    listener = strategy.rebalancer.calibration
    assert not [w for w in caught if "no `StragglerMonitor`" in str(w.message)]
    assert listener.world is not None and listener.calibrator.records > 0  # fed: timed steps
    # a checkpoint saved after the fit keeps the model the run planned with
    assert monitor.state_dict()["calibration"]["version"] == listener.calibrator.version
    saved = monitor.state_dict()

    # the next fit of the same monitor under a plain strategy: the old listener is fed no more; a
    # restored state of an earlier run (validate(ckpt_path=...)) does not reach a later fit
    monitor.load_state_dict({**saved, "calibration": {**saved["calibration"], "version": 5}})
    records = listener.calibrator.records
    trainer = cpu_trainer([monitor], steps=2)
    trainer.fit(Fit())
    assert monitor.listeners == () and listener.calibrator.records == records
    assert "calibration" not in monitor.state_dict()
    fresh = vb.VLMBalanceStrategy(config=config)
    trainer = cpu_trainer([monitor], steps=2, strategy=fresh)
    trainer.fit(Fit())  # no ckpt_path: its own start, not the state restored for another run
    assert fresh.rebalancer.calibrator.version == 0  # not the restored 5

    alone = vb.VLMBalanceStrategy(config=config)
    trainer = cpu_trainer([], steps=2, strategy=alone)
    for fit in range(2):  # a second fit of the same Trainer: still said once
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Fit())
        told = [w for w in caught if "no `StragglerMonitor`" in str(w.message)]
        assert len(told) == (1 if fit == 0 else 0), [str(w.message) for w in caught]
