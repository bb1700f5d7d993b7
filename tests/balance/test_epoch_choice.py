"""The per-epoch decision of ``mode="auto"``: a sampler that may balance at the source
(``SourceBalance(when="auto")``) forms an epoch there only where that is predicted faster,
with the cost model the epoch starts with, the same on every rank and through a re-plan."""

from __future__ import annotations

import numpy as np
import pytest

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.choice import OPTIONS
from lightning_vlmbalance.balance.epoch_choice import (
    EpochRuntime,
    choose_epoch,
    price_plan,
)
from lightning_vlmbalance.synthetic import LengthTable, synthetic_length_table

SEQ = 2048


def _sampler(table, *, when="auto", runtime=None, rank=0, world=4, model=None, **kw):
    balance = vb.SourceBalance(
        micro_steps=kw.pop("micro_steps", 4),
        objective="step",
        when=when,
        cost_model=model,
        plan_ahead=False,
    )
    s = vb.PackingSampler(
        table.total_tokens,
        table.image_tokens,
        seq_len=SEQ,
        num_replicas=world,
        rank=rank,
        balance=balance,
        images=table.images,
        **kw,
    )
    if runtime is not None:
        s.decide_epochs(runtime)
    return s


def _raw(table, **kw) -> vb.PackingSampler:
    return vb.PackingSampler(
        table.total_tokens,
        table.image_tokens,
        images=table.images,
        seq_len=SEQ,
        num_replicas=4,
        rank=0,
        **kw,
    )


def _ids(plan) -> list[int]:
    return sorted(int(i) for rank in plan.rank_packs for pack in rank for i in pack)


def _runtime(options=("placed",), meets=False, **kw) -> EpochRuntime:
    return EpochRuntime(options=options, meets_every_micro_batch=meets, objective="step", **kw)


# a few heavy image samples among many short texts (the source former pays), and text alone
# at one length (nothing to balance: the plain packs are as even and fuller)
IMAGES = synthetic_length_table(1200, text_share=0.5, tile_tokens=64, max_text_tokens=900, seed=3)
TEXT = LengthTable(
    total_tokens=np.full(1500, 300, dtype=np.int64),
    image_tokens=np.zeros(1500, dtype=np.int64),
    images=np.zeros(1500, dtype=np.int64),
)


def test_the_epoch_takes_the_plan_predicted_faster_and_records_both_prices() -> None:
    seen = set()
    for table in (IMAGES, TEXT):
        for epoch in (0, 1):
            s = _sampler(table, runtime=_runtime())
            s.set_epoch(epoch)
            plan = s.plan()
            choice = plan.epoch_choice
            assert choice is not None
            prices = {k[: -len("_ms")]: v for k, v in choice.items() if k.endswith("_ms")}
            assert choice["taken"] == min(prices, key=prices.get)
            assert plan.formed_at_source == (choice["taken"] != "plain")
            assert _ids(plan) == sorted(
                i for i in range(len(table.total_tokens)) if table.total_tokens[i] <= SEQ
            )  # every sample once, either way
            seen.add(plan.formed_at_source)
    assert seen == {True, False}  # each outcome happens on these tables


def test_prices_are_the_runtime_choice_summed_over_the_epoch() -> None:
    """Every global batch priced (few enough): the epoch's price is the sum of each batch's
    cheapest step, so more options never price an epoch higher."""
    s = _sampler(IMAGES)
    plain = _raw(IMAGES).plan()
    kw = dict(
        micro_steps=4,
        total_tokens=IMAGES.total_tokens,
        image_tokens=IMAGES.image_tokens,
        images=IMAGES.images,
        cost_model=s.cost_model,
    )
    placed = price_plan(plain, runtime=_runtime(priced_batches=10_000), **kw)
    every = price_plan(plain, runtime=_runtime(options=OPTIONS, priced_batches=10_000), **kw)
    assert 0 < every <= placed
    sampled = price_plan(plain, runtime=_runtime(priced_batches=5), **kw)
    assert sampled == pytest.approx(placed, rel=0.25)  # an estimate of the same epoch
    # a tie keeps the stream's order
    same = choose_epoch({"plain": plain, "formed": plain}, runtime=_runtime(), **kw)
    assert not same.formed_at_source and same.prices["plain"] == same.prices["formed"]


def test_every_rank_and_process_makes_the_same_decision_and_plan() -> None:
    plans = [_sampler(IMAGES, runtime=_runtime(), rank=r).plan() for r in range(4)]
    for p in plans[1:]:
        assert p.epoch_choice == plans[0].epoch_choice
        assert all(
            np.array_equal(a, b)
            for ra, rb in zip(p.rank_packs, plans[0].rank_packs)
            for a, b in zip(ra, rb)
        )


def test_always_and_no_runtime_form_every_epoch() -> None:
    for s in (
        _sampler(TEXT, when="always", runtime=_runtime()),
        _sampler(TEXT),  # no strategy in mode="auto" told it how the epoch trains
    ):
        plan = s.plan()
        assert plan.formed_at_source and plan.epoch_choice is None


@pytest.mark.parametrize("table", [IMAGES, TEXT], ids=["formed", "plain"])
def test_a_refit_during_the_epoch_never_changes_its_decision(table) -> None:
    """A refit adopted mid-epoch re-plans the rest of a formed epoch and leaves a plain one as
    it is: the batches trained so far were formed one way, the rest must hold the others."""
    s = _sampler(table, runtime=_runtime())
    before = s.plan()
    heavier = vb.CostModel(  # every coefficient doubled
        coefficients={
            p: {k: 2 * v for k, v in t.items()} for p, t in s.cost_model.coefficients.items()
        }
    )
    s.adopt_cost_model(heavier, from_batch=2)
    after = s.plan()
    assert after.formed_at_source == before.formed_at_source
    assert after.epoch_choice == before.epoch_choice
    for r in range(4):  # the first two global batches as trained
        for a, b in zip(before.rank_packs[r][:8], after.rank_packs[r][:8]):
            assert np.array_equal(a, b)
    assert _ids(after) == _ids(before)
    if not before.formed_at_source:
        assert all(
            np.array_equal(a, b)
            for ra, rb in zip(before.rank_packs, after.rank_packs)
            for a, b in zip(ra, rb)
        )


def test_the_runtime_is_in_the_fingerprint_and_a_bad_runtime_is_refused() -> None:
    a, b = _sampler(IMAGES), _sampler(IMAGES, runtime=_runtime())
    assert a.fingerprint() != b.fingerprint()
    assert b.fingerprint()["balance"]["runtime"]["options"] == ["placed"]
    with pytest.raises(ValueError, match="options"):
        EpochRuntime(options=("teleport",), meets_every_micro_batch=False, objective="step")
    with pytest.raises(ValueError, match="when"):
        vb.SourceBalance(when="sometimes")


def test_with_images_routed_the_packs_are_also_priced_formed_by_their_language_model() -> None:
    routed = _runtime(options=OPTIONS)
    plan = _sampler(IMAGES, runtime=routed).plan()
    assert set(plan.epoch_choice) == {"taken", "plain_ms", "formed_ms", "formed_llm_ms"}
    assert _ids(plan) == sorted(np.flatnonzero(IMAGES.total_tokens <= SEQ).tolist())
    # the basis fixed by the user: that one alone; no routing: every phase's
    balance = vb.SourceBalance(micro_steps=4, objective="step", llm_only=True, plan_ahead=False)
    given = _raw(IMAGES, balance=balance)
    given.decide_epochs(routed)
    assert set(given.plan().epoch_choice) == {"taken", "plain_ms", "formed_llm_ms"}
    assert set(_sampler(IMAGES, runtime=_runtime()).plan().epoch_choice) == {
        "taken",
        "plain_ms",
        "formed_ms",
    }


def test_no_epoch_after_the_fits_end_is_planned_ahead() -> None:
    """A fit that ends in this epoch (its last epoch, or its last optimizer step within it)
    does not plan the next one in the background (under auto: three plans priced)."""

    def ahead(**fit_end) -> int | None:
        balance = vb.SourceBalance(micro_steps=4, objective="step")  # plans ahead
        s = _raw(IMAGES, balance=balance)
        s.decide_epochs(_runtime())
        s.set_fit_end(0, **fit_end)
        s.use_cost_model(s.cost_model)  # drops the plans made so far
        s.plan(0)
        pending = s._ahead._pending
        return None if pending is None else pending["settings"][0]

    steps = -(-_raw(IMAGES, balance=vb.SourceBalance(micro_steps=4)).plan().packs_per_rank // 4)
    assert ahead(last_epoch=None, steps_left=None) == 1
    assert ahead(last_epoch=0, steps_left=None) is None
    assert ahead(last_epoch=3, steps_left=steps) is None  # the steps end with this epoch
    assert ahead(last_epoch=3, steps_left=steps + 1) == 1


def test_evaluation_reads_epoch_zeros_plan_as_first_made_whatever_is_adopted_later() -> None:
    """A loader that also validates reads epoch 0's plan every time; refits adopted in later
    epochs re-planned epoch 0 with the latest model, which decides it otherwise (plain, 41
    packs per rank, then formed, 48: 282 of 300 samples validated in an outside try)."""
    from lightning_vlmbalance.loaders.map_style import EVALUATION
    from tests.packing.epoch_job import pack_heavy, sampler

    s = sampler(seed=6, window=16, balance=True, num_replicas=2, rank=0, micro_steps=2, when="auto")
    s.decide_epochs(_runtime(options=("placed", "packs")))
    first = s.plan(EVALUATION)
    assert first.epoch_choice["taken"] == "plain"
    s.adopt_cost_model(pack_heavy(24), epoch=0, from_batch=2)
    s.set_epoch(1)
    s.plan(1)
    s.adopt_cost_model(pack_heavy(30), epoch=1, from_batch=2)
    assert s.plan(0).epoch_choice["taken"] == "formed"  # epoch 0 as now planned: other packs
    assert s.plan(EVALUATION) is first  # what evaluation reads: as first made


def test_llm_only_must_be_a_bool_or_none() -> None:
    for bad in ("false", 1, "yes"):
        with pytest.raises(ValueError, match="llm_only"):
            vb.SourceBalance(llm_only=bad)
