"""``mode="auto"``'s decision (``balance/choice.py``): each option priced as the ranks meet."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlmbalance.balance.choice import (
    OPTIONS,
    StepInputs,
    Transfer,
    choose_step,
    met_step_ms,
)
from lightning_vlmbalance.balance.config import RebalanceConfig

FREE = Transfer(bandwidth_gb_s=1e9, latency_ms=0.0)  # moving costs nothing: compute decides


def _inputs(llm, images, per_call=0.0, W=2) -> StepInputs:
    """Packs rank by rank: ``llm[i]`` and the encoder costs of pack ``i``'s images (their
    tokens: the cost x 10, any positive number does)."""
    K = max(1, max(len(x) for x in images))
    image_ms = np.zeros((len(llm), K))
    for i, x in enumerate(images):
        image_ms[i, : len(x)] = x
    counts = np.array([len(x) for x in images])
    vision = image_ms.sum(axis=1) + np.where(counts > 0, per_call, 0.0)
    return StepInputs(
        pack_ms=np.asarray(llm, dtype=float) + vision,
        llm_ms=np.asarray(llm, dtype=float),
        image_ms=image_ms,
        image_tokens=(image_ms * 10).astype(np.int64),
        counts=counts,
        per_call_ms=per_call,
        pack_bytes=np.full(len(llm), 1000.0),
        num_replicas=W,
    )


def test_a_step_is_priced_as_the_ranks_meet() -> None:
    work = np.array([[3.0, 1.0], [1.0, 3.0]])
    assert met_step_ms(work, meets_every_micro_batch=False) == 4.0  # totals 4 and 4
    assert met_step_ms(work, meets_every_micro_batch=True) == 6.0  # 3 + 3
    # micro-step 0 moves images: its encoder (1 | 0) and language (2 | 1) are each waited for;
    # micro-step 1 does not, and the ranks meet at the step's end only: 1 + 2 + max(1, 3)
    encoder = np.array([[1.0, 0.0], [0.0, 0.0]])
    language = work - encoder
    meetings = np.array([True, False])
    got = met_step_ms(
        work,
        meets_every_micro_batch=False,
        meetings=meetings,
        encoder=encoder,
        language=language,
    )
    assert got == 1.0 + 2.0 + 3.0


def test_one_micro_batch_per_step_routes_the_images_of_a_heavy_pack() -> None:
    # rank 0's pack: 4 images of 10 ms; rank 1's: text. Images spread: 20 + 20 + 5 = 25 ms
    inputs = _inputs([5.0, 5.0], [[10.0] * 4, []])
    choice = choose_step(
        inputs, objective="step", meets_every_micro_batch=False, threaded=True, transfer=FREE
    )
    assert choice.option == "images"
    assert choice.prices["placed"] == 45.0 and choice.prices["packs"] == 45.0
    assert choice.step_ms == pytest.approx(25.0)
    assert choice.routing is not None and choice.routing.moved_images == 2
    # without routes (a model that does not encode through encode_images), nothing moves
    pack_only = choose_step(
        inputs,
        options=("placed", "packs"),
        objective="step",
        meets_every_micro_batch=False,
        threaded=True,
        transfer=FREE,
    )
    assert pack_only.option == "placed" and pack_only.pack_plan is None  # a tie: moving less


def test_with_accumulation_a_meeting_per_micro_step_can_cost_more_than_it_saves() -> None:
    # two micro-steps, rank totals equal (12 | 12) but each micro-step uneven: meeting at the
    # step's end only, the placed packs are balanced; routing images would make each
    # micro-step a meeting and expose the language model's imbalance (10 | 2, then 2 | 10)
    inputs = _inputs([10.0, 1.0, 1.0, 10.0], [[], [1.0], [1.0], []])
    choice = choose_step(
        inputs, objective="step", meets_every_micro_batch=False, threaded=True, transfer=FREE
    )
    assert choice.option == "placed" and choice.step_ms == 12.0
    assert choice.prices["images"] >= choice.prices["placed"]


def test_uneven_ranks_with_accumulation_move_packs() -> None:
    inputs = _inputs([9.0, 9.0, 1.0, 1.0], [[], [], [], []])
    choice = choose_step(
        inputs, objective="step", meets_every_micro_batch=False, threaded=True, transfer=FREE
    )
    assert choice.option == "packs" and choice.step_ms == 10.0
    assert choice.pack_plan is not None and choice.pack_plan.moved_packs == 2


def test_an_exchange_slower_than_the_step_is_paid_in_line_and_its_excess_in_a_thread() -> None:
    slow = Transfer(bandwidth_gb_s=1e-6, latency_ms=0.0)  # 1,000 bytes: 1,000 ms
    inputs = _inputs([9.0, 9.0, 1.0, 1.0], [[], [], [], []])
    inline = choose_step(
        inputs,
        options=("packs",),
        objective="step",
        meets_every_micro_batch=False,
        threaded=False,
        transfer=slow,
    )
    hidden = choose_step(
        inputs,
        options=("packs",),
        objective="step",
        meets_every_micro_batch=False,
        threaded=True,
        transfer=slow,
    )
    assert inline.step_ms == pytest.approx(10.0 + 1000.0)
    assert hidden.step_ms == pytest.approx(1000.0)  # 10 ms of it hidden behind the step
    both = choose_step(
        inputs, objective="step", meets_every_micro_batch=False, threaded=True, transfer=slow
    )
    assert both.option == "placed"  # the exchange costs more than it saves


def test_every_rank_takes_the_same_option_from_the_same_numbers() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        W, G = 4, 3
        images = [list(rng.uniform(0, 20, rng.integers(0, 4))) for _ in range(W * G)]
        inputs = _inputs(list(rng.uniform(1, 30, W * G)), images, per_call=0.5, W=W)
        kw = dict(objective="step", meets_every_micro_batch=False, threaded=True)
        a, b = choose_step(inputs, **kw), choose_step(inputs, **kw)
        assert (a.option, a.step_ms) == (b.option, b.step_ms)
        assert a.step_ms == min(a.prices.values()) and set(a.prices) == set(OPTIONS)


def test_unknown_options_and_routes_without_the_encoder_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"options=\['teleport'\]"):
        choose_step(
            _inputs([1.0, 1.0], [[], []]),
            options=("teleport",),
            objective="step",
            meets_every_micro_batch=False,
            threaded=True,
        )
    needs = r"RebalanceConfig\(options=\('both',\)\)`: routing images needs"
    with pytest.raises(ValueError, match=needs):
        RebalanceConfig(options=("both",))
    with pytest.raises(ValueError, match="expected some of"):
        RebalanceConfig(options=("placed", "teleport"))
    assert RebalanceConfig(encoder=True, options=["images"]).options == ("images",)
    assert RebalanceConfig().mode == "auto"


def test_the_step_scale_is_the_median_of_measured_over_priced() -> None:
    """The former prices the batch of optimizer step N; the monitor times it as N + 1 (the
    global step after its optimizer step). Unmatched steps are ignored; the state restores."""
    from types import SimpleNamespace

    from lightning_vlmbalance.balance.choice import StepScale

    scale = StepScale(window=3)
    for n in range(4):
        scale.priced(n, 100.0)
    measured = [110.0, 130.0, 120.0, 500.0]
    timed = [SimpleNamespace(global_step=n + 1, step_ms=ms) for n, ms in enumerate(measured)]
    scale.on_timed_steps([*timed[:3], SimpleNamespace(global_step=99, step_ms=1.0)], 3)
    assert scale.factor == pytest.approx(1.2) and scale.timed == 3
    scale.on_timed_steps(timed[3:], 4)  # the window keeps the last 3: 1.3, 1.2, 5.0
    assert scale.factor == pytest.approx(1.3)
    again = StepScale(window=3)
    again.start(None, 4, scale.state_dict())
    assert again.factor == pytest.approx(1.3)


def test_a_new_cost_model_forgets_the_old_ones_ratios() -> None:
    """After ``reset(from_step)`` only steps priced from ``from_step`` on count; the factor so
    far stands until the first of them is timed. A CPU step priced by the GPU-scale defaults
    gives a factor below 1, never a negative prediction."""
    from types import SimpleNamespace

    from lightning_vlmbalance.balance.choice import StepScale

    scale = StepScale()
    for n in range(4):
        scale.priced(n, 900.0)
    scale.on_timed_steps([SimpleNamespace(global_step=n + 1, step_ms=45.0) for n in (0, 1)], 2)
    assert scale.factor == pytest.approx(0.05)
    scale.reset(3)  # a refit prices step 3 on
    scale.on_timed_steps([SimpleNamespace(global_step=3, step_ms=500.0)], 3)  # step 2: old
    assert scale.factor == pytest.approx(0.05) and scale.timed == 0
    scale.priced(3, 40.0)
    scale.on_timed_steps([SimpleNamespace(global_step=4, step_ms=44.0)], 4)
    assert scale.factor == pytest.approx(1.1) and scale.timed == 1


def test_a_choice_can_take_any_option_it_priced() -> None:
    """Rank 0's option is taken everywhere: each rank made every option's plan alike."""
    inputs = _inputs([9.0, 9.0, 1.0, 1.0], [[4.0, 4.0], [], [], []])
    choice = choose_step(
        inputs, objective="step", meets_every_micro_batch=False, threaded=True, transfer=FREE
    )
    for option in OPTIONS:
        other = choice.taking(option)
        assert other.option == option and other.step_ms == choice.prices[option]
        assert (other.pack_plan is not None) == (option in ("packs", "both"))
        assert (other.routing is not None) == (option in ("images", "both"))


def test_options_belong_to_auto_and_the_strategies_take_them() -> None:
    import lightning_vlmbalance as vb

    with pytest.raises(ValueError, match=r"mode='overlap', options=\('placed',\)"):
        RebalanceConfig(mode="overlap", options=("placed",))
    strategy = vb.VLMBalanceStrategy(encoder=True, options=("placed", "images"))
    assert strategy.rebalancer.config.options == ("placed", "images")
    fsdp = vb.FSDPVLMBalanceStrategy(options=("packs",))
    assert fsdp.rebalancer.config.options == ("packs",)
    with pytest.raises(ValueError, match="expected some of"):
        vb.VLMBalanceStrategy(options=("bogus",))


def test_expected_max_is_the_mean_of_the_slowest_of_normal_times() -> None:
    from lightning_vlmbalance.balance.choice import expected_max

    # two equal ranks, each off by one: the slower is 1/sqrt(pi) above the mean
    assert expected_max(np.array([10.0, 10.0]), np.array([1.0, 1.0])) == pytest.approx(
        10 + 1 / np.sqrt(np.pi), abs=1e-5
    )
    # one rank exact: the other is slower half the time
    assert expected_max(np.array([10.0, 10.0]), np.array([0.0, 1.0])) == pytest.approx(
        10 + 1 / np.sqrt(2 * np.pi), abs=1e-3
    )
    rng = np.random.default_rng(0)
    mean, sd = rng.uniform(5, 10, 32), rng.uniform(0, 2, 32)
    sampled = (mean + sd * rng.standard_normal((100_000, 32))).max(axis=1).mean()
    assert expected_max(mean, sd) == pytest.approx(sampled, rel=2e-3)
    assert expected_max(mean, np.zeros(32)) == mean.max()


def test_a_jitter_makes_every_meeting_cost_more_and_zero_changes_nothing() -> None:
    from lightning_vlmbalance.balance.choice import met_step_ms

    even = np.full((2, 2), 2.0)  # two ranks, two micro-steps of 2 ms each
    for meets in (False, True):
        exact = met_step_ms(even, meets_every_micro_batch=meets)
        assert exact == 4.0
        assert met_step_ms(even, meets_every_micro_batch=meets, jitter=0.0) == exact
    # off by 10%: meeting once per step exposes the sum's error once (4 + 0.2 sqrt(2)/sqrt(pi)),
    # at every micro-step each micro-step's (2 x (2 + 0.2/sqrt(pi))): more meetings, more wait
    once = met_step_ms(even, meets_every_micro_batch=False, jitter=0.1)
    every = met_step_ms(even, meets_every_micro_batch=True, jitter=0.1)
    assert once == pytest.approx(4 + 0.2 * np.sqrt(2 / np.pi), abs=1e-4)
    assert every == pytest.approx(4 + 0.4 / np.sqrt(np.pi), abs=1e-4)
    # a rank far ahead is never the slowest: the error then costs (almost) nothing
    uneven = np.array([[3.0, 1.0], [1.0, 3.0]])
    assert met_step_ms(uneven, meets_every_micro_batch=True, jitter=0.1) == pytest.approx(6.0)


def test_price_taken_reprices_the_chosen_plans() -> None:
    from lightning_vlmbalance.balance.choice import price_taken

    inputs = _inputs([10.0, 1.0, 1.0, 10.0], [[], [1.0], [1.0], []])
    transfer = Transfer(bandwidth_gb_s=1e9, latency_ms=0.0)
    for option in ("placed", "packs", "images", "both"):
        choice = choose_step(
            inputs,
            options=(option,),
            objective="step",
            meets_every_micro_batch=False,
            threaded=True,
            transfer=transfer,
        )
        kw = {"meets_every_micro_batch": False, "threaded": True}
        step, _ = price_taken(choice, inputs, transfer, **kw)
        assert step == pytest.approx(choice.step_ms), option  # the same plans, the same price
        noisy, _ = price_taken(choice, inputs, transfer, jitter=0.1, **kw)
        assert noisy > step, option
