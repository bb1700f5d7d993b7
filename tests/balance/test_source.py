"""Balance at the source: ``PackingSampler(balance=...)`` forms cost-balanced global batches; with
``strategy="vlmbalance"`` nothing moves and the parameters equal plain DDP fed the same batches."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import lightning_vlmbalance as vb
from lightning_vlmbalance.balance.source import (
    SourceBalance,
    form_balanced_batches,
    sample_costs,
)
from lightning_vlmbalance.synthetic import LengthTable, synthetic_length_table
from tests.balance.fits import fit as _fit
from tests.balance.fits import fit_result as _result
from tests.balance.fits import job as _job
from tests.balance.fits import max_rel_diff as _max_rel_diff
from tests.launch import ROOT, run_jobs, run_modules

EPOCH = ("--samples", "300", "--epochs", "1", "--max-steps", "-1", "--accumulate", "3")
AUTO = ("--strategy", "vlmbalance", *EPOCH, "--balance", "--mode", "auto", "--encoder")
DDP_STEP = ("--strategy", "ddp", *EPOCH, "--balance", "--balance-objective", "step")


# a model whose tokens cost more than its packs (as a calibrated one on a GPU): the epochs of
# the strategy job's table are then predicted faster formed at the source
TOKEN_HEAVY = vb.CostModel(
    coefficients={
        "vision_fwd": {"image_pack": 1.0, "image_tokens": 1.0},
        "vision_bwd": {"image_pack": 2.0, "image_tokens": 2.0},
        "llm_fwd": {"pack": 1.0, "total_tokens": 0.1},
        "llm_bwd": {"pack": 2.0, "total_tokens": 0.2},
    }
)


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("source_fits")
    heavy = root / "token_heavy.json"
    TOKEN_HEAVY.save(heavy)
    formed = ("--balance-cost-model", str(heavy))
    jobs = {
        "vlmbalance": ("--strategy", "vlmbalance", *EPOCH, "--balance", "--checkpoint-every", "4"),
        # plain DDP meets every micro-batch ("auto" would plan for "microstep"): the plan that
        # "vlmbalance" resolves to, given
        "ddp": ("--strategy", "ddp", *EPOCH, "--balance", "--balance-objective", "step"),
        "exact": ("--strategy", "vlmbalance", *EPOCH, "--balance-exact"),
        "unbalanced_ddp": ("--strategy", "ddp", *EPOCH),
        # mode="auto" decides the epoch (SourceBalance(when="auto")): plain or formed, every
        # sample once either way, and a resume lands on the same decision and packs
        "auto": (*AUTO, "--checkpoint-every", "4"),
        # ... formed: the parameters are those of DDP on the same formed plan
        "auto_formed": (*AUTO, *formed),
        "ddp_formed": (*DDP_STEP, *formed),
    }
    run_modules([_job(root / name, *args) for name, args in jobs.items()])
    return {"root": root, **{name: _result(root / name) for name in jobs}}


def test_strategy_on_a_source_balanced_loader_moves_nothing_and_equals_ddp(fits) -> None:
    run, ddp = fits["vlmbalance"], fits["ddp"]
    assert run[0]["optimizer_steps"] == ddp[0]["optimizer_steps"] > 10
    assert _max_rel_diff(run["params"], ddp["params"]) < 1e-10
    assert sum(s["moved_packs"] for s in run[0]["stats"]) == 0
    assert "balance/source_balanced" in run[0]["logged"]
    for r in (0, 1):  # the same packs in the same places: the sampler placed them
        assert run[r]["seen"] == ddp[r]["seen"]
    ids = sorted(s for r in (0, 1) for _, _, sample_ids in run[r]["seen"] for s in sample_ids)
    assert ids == list(range(300))  # every sample exactly once


def test_exact_keeps_the_unbalanced_global_batches(fits) -> None:
    """exact=True: every optimizer step trains the samples of the unbalanced plan's step, so the
    parameters equal plain DDP on the unbalanced plan."""
    run, ddp = fits["exact"], fits["unbalanced_ddp"]
    assert _max_rel_diff(run["params"], ddp["params"]) < 1e-10

    def steps(res: dict) -> list[list[int]]:
        per_step: dict[int, list[int]] = {}
        for r in (0, 1):
            for k, (_, _, ids) in enumerate(res[r]["seen"]):
                per_step.setdefault(k // 3, []).extend(ids)
        return [sorted(v) for _, v in sorted(per_step.items())]

    assert steps(run) == steps(ddp)


def test_exact_global_batches_hold_the_unbalanced_samples() -> None:
    t = _table()
    kw = {"seq_len": 8192, "num_replicas": 4, "rank": 0}
    plain = vb.PackingSampler(t.total_tokens, t.image_tokens, **kw).plan()
    balance = vb.SourceBalance(micro_steps=2, exact=True)
    exact = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=balance, **kw)
    plan = exact.plan()
    assert plan.balanced_batches + plan.fallback_batches == -(-plain.packs_per_rank // 2)
    for k in range(0, plain.packs_per_rank, 2):
        want = sorted(s for r in plain.rank_packs for p in r[k : k + 2] for s in p)
        got = sorted(s for r in plan.rank_packs for p in r[k : k + 2] for s in p)
        assert got == want


@pytest.mark.suite
def test_resume_mid_epoch_lands_on_the_same_packs(fits, tmp_path) -> None:
    ckpt = fits["root"] / "vlmbalance" / "ckpt" / "step=4.ckpt"
    resumed = _fit(tmp_path, "--strategy", "vlmbalance", *EPOCH, "--balance", "--resume", str(ckpt))
    for r in (0, 1):
        assert resumed[r]["seen"] == fits["vlmbalance"][r]["seen"][4 * 3 :]


def test_auto_decides_the_epoch_and_trains_every_sample_once(fits) -> None:
    run = fits["auto"]
    decided = run[0]["epoch_choice"]
    assert decided == run[1]["epoch_choice"]  # every rank
    choice = decided["choice"]
    prices = {k: v for k, v in choice.items() if k.endswith("_ms")}
    assert set(prices) == {"plain_ms", "formed_ms", "formed_llm_ms"}  # images routed: three
    assert choice["taken"] + "_ms" == min(prices, key=prices.get)
    ids = sorted(s for r in (0, 1) for _, _, sample_ids in run[r]["seen"] for s in sample_ids)
    assert ids == list(range(300))
    assert ("balance/source_balanced" in run[0]["logged"]) == decided["formed_at_source"]


def test_auto_forms_where_that_is_predicted_faster_and_keeps_the_parameters(fits) -> None:
    run, ddp = fits["auto_formed"], fits["ddp_formed"]
    assert run[0]["epoch_choice"]["formed_at_source"], run[0]["epoch_choice"]
    assert run[0]["epoch_choice"]["choice"]["taken"] == "formed"  # as DDP's sampler formed it
    assert "balance/source_balanced" in run[0]["logged"]
    assert run[0]["optimizer_steps"] == ddp[0]["optimizer_steps"] > 10
    assert _max_rel_diff(run["params"], ddp["params"]) < 1e-10
    ids = sorted(s for r in (0, 1) for _, _, sample_ids in run[r]["seen"] for s in sample_ids)
    assert ids == list(range(300))
    # every option stays open on a formed epoch: auto priced them all
    assert {s["choice"] for s in run[0]["stats"]} - {0.0}, "nothing but 'placed' was taken"


def test_auto_resumed_mid_epoch_lands_on_the_same_decision_and_packs(fits, tmp_path) -> None:
    ckpt = fits["root"] / "auto" / "ckpt" / "step=4.ckpt"
    resumed = _fit(tmp_path, *AUTO, "--resume", str(ckpt))
    for r in (0, 1):
        assert resumed[r]["seen"] == fits["auto"][r]["seen"][4 * 3 :]
        assert resumed[r]["epoch_choice"] == fits["auto"][r]["epoch_choice"]


def test_llm_only_without_image_routing_is_told(tmp_path) -> None:
    """``SourceBalance(llm_only=True)`` leaves the encoder's work to the image routing: without
    ``encoder=True`` nothing routes it, and the user is told (an outside try found it silent)."""
    args = ("--strategy", "vlmbalance", "--samples", "120", "--max-steps", "2")
    flags = ("--accumulate", "2", "--balance", "--mode", "auto", "--balance-llm-only", "true")
    (got,) = run_jobs({"fit": _job(tmp_path / "fit", *args, *flags)}).values()
    assert got.returncode == 0, got.stderr[-3000:]
    assert "routes no image (`encoder=False`)" in got.stderr


def _table(n: int = 6000) -> LengthTable:
    return synthetic_length_table(n, text_share=0.4, seed=0)


def _digest(plan) -> str:
    h = hashlib.sha1()
    for rank in plan.rank_packs:
        for pack in rank:
            h.update(np.asarray(pack, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


_DIGEST_SCRIPT = """
import hashlib, numpy as np, lightning_vlmbalance as vb
from lightning_vlmbalance.synthetic import synthetic_length_table
t = synthetic_length_table(6000, text_share=0.4, seed=0)
s = vb.PackingSampler(t.total_tokens, t.image_tokens, seq_len=8192, num_replicas=4, rank={rank},
                      balance=vb.SourceBalance(micro_steps=2))
h = hashlib.sha1()
for rank in s.plan().rank_packs:
    for pack in rank:
        h.update(np.asarray(pack, dtype=np.int64).tobytes() + b"|")
print(h.hexdigest())
"""


@pytest.mark.suite
def test_every_process_computes_the_same_plan() -> None:
    """Two processes (other ranks, other hash seeds) compute the plan from the same integers."""
    digests = set()
    for rank, hash_seed in ((0, "1"), (3, "2")):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT.format(rank=rank)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        digests.add(out.stdout.strip())
    t = _table()
    here = vb.PackingSampler(
        t.total_tokens,
        t.image_tokens,
        seq_len=8192,
        num_replicas=4,
        rank=1,
        balance=vb.SourceBalance(micro_steps=2),
    )
    digests.add(_digest(here.plan()))
    assert len(digests) == 1


@pytest.mark.parametrize(("ranks", "micro_steps"), [(1, 1), (4, 1), (4, 3), (8, 2)])
def test_every_sample_exactly_once_and_packs_fit(ranks, micro_steps) -> None:
    t = _table()
    s = vb.PackingSampler(
        t.total_tokens,
        t.image_tokens,
        seq_len=8192,
        num_replicas=ranks,
        rank=0,
        balance=vb.SourceBalance(micro_steps=micro_steps),
    )
    plan = s.plan()
    ids = np.sort(plan.sample_ids())
    assert ids.tolist() == list(range(len(t.total_tokens)))
    assert all(t.total_tokens[p].sum() <= 8192 for rank in plan.rank_packs for p in rank)
    assert len({len(r) for r in plan.rank_packs}) == 1
    assert plan.packs_per_rank % micro_steps == 0  # whole global batches
    assert plan.efficiency > 0.98


def test_global_batches_cost_more_evenly_than_the_unbalanced_plan() -> None:
    """Per global batch of 8 ranks x 1 pack, the slowest pack over the mean: closer to 1."""
    t = _table(12000)
    costs, _ = sample_costs(vb.CostModel(), t.total_tokens, t.image_tokens, t.images)

    def waste(balance) -> float:
        s = vb.PackingSampler(
            t.total_tokens,
            t.image_tokens,
            seq_len=8192,
            num_replicas=8,
            rank=0,
            balance=balance,
            seed=1,
        )
        plan = s.plan()
        per_step = np.array(
            [[costs[rank[k]].sum() for rank in plan.rank_packs] for k in range(plan.packs_per_rank)]
        )
        full = per_step.min(axis=1) > 0  # steps without a padding pack
        return float(np.mean(1 - per_step[full].mean(1) / per_step[full].max(1)))

    balanced, unbalanced = waste(True), waste(None)
    assert balanced < 0.5 * unbalanced, (balanced, unbalanced)


def test_micro_steps_and_objective_come_from_the_trainer_when_left_to_default() -> None:
    t = _table(2000)
    s = vb.PackingSampler(
        t.total_tokens, t.image_tokens, seq_len=8192, num_replicas=2, rank=0, balance=True
    )
    assert (s.micro_steps, s.objective) == (1, "auto")
    s.set_micro_steps(4, "microstep")
    assert (s.micro_steps, s.objective) == (4, "microstep")
    assert s.plan().packs_per_rank % 4 == 0
    fixed = vb.PackingSampler(
        t.total_tokens,
        t.image_tokens,
        seq_len=8192,
        num_replicas=2,
        rank=0,
        balance=vb.SourceBalance(micro_steps=2, objective="step"),
    )
    fixed.set_micro_steps(4, "microstep")
    assert (fixed.micro_steps, fixed.objective) == (2, "step")
    assert fixed.fingerprint()["balance"]["micro_steps"] == 2
    assert vb.PackingSampler(t.total_tokens, seq_len=8192, num_replicas=1).balanced is False


@pytest.mark.parametrize(
    ("balance", "kwargs", "match"),
    [
        ({"objective": "fast"}, {}, "objective='fast'"),
        ({"micro_steps": 0}, {}, "micro_steps=0"),
        ({"slack": -0.1}, {}, "slack=-0.1"),
        ({"lookahead": -1}, {}, "lookahead=-1"),
        ({}, {"remainder": "drop"}, "remainder='drop'"),
    ],
)
def test_bad_settings_are_named(balance, kwargs, match) -> None:
    t = _table(500)
    with pytest.raises(ValueError, match=match):
        vb.PackingSampler(
            t.total_tokens,
            t.image_tokens,
            seq_len=8192,
            num_replicas=2,
            rank=0,
            balance=vb.SourceBalance(**balance),
            **kwargs,
        )


def test_every_former_knob_is_settable_and_fingerprinted() -> None:
    """The balance options are one frozen config, settable in full: a knob of the former
    changes the plan and the fingerprint (ranks that disagree on it are caught)."""
    t = _table(3000)
    kw = {"seq_len": 8192, "num_replicas": 4, "rank": 0}
    base = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=True, **kw)
    small = vb.SourceBalance(small_tokens=256, lookahead=64, slack=0.0)
    other = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=small, **kw)
    assert _digest(base.plan()) != _digest(other.plan())
    assert base.fingerprint() != other.fingerprint()
    assert other.fingerprint()["balance"]["small_tokens"] == 256


def test_cost_model_from_a_json_file(tmp_path) -> None:
    model = vb.CostModel()
    model.save(tmp_path / "cost.json")
    t = _table(500)
    s = vb.PackingSampler(
        t.total_tokens,
        t.image_tokens,
        seq_len=8192,
        num_replicas=2,
        rank=0,
        balance=str(tmp_path / "cost.json"),
    )
    assert s.balanced and s.cost_model.to_dict() == model.to_dict()


def test_the_next_epoch_is_planned_in_the_background() -> None:
    """After epoch 0's plan the sampler plans epoch 1 in a thread; a new epoch takes it (the
    same plan as computed in the foreground), and a change of settings discards it."""
    t = _table()
    kwargs = dict(seq_len=8192, num_replicas=4, rank=0)
    balance = vb.SourceBalance(micro_steps=2)
    s = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=balance, **kwargs)
    s.set_epoch(1)
    ahead = s.plan()
    assert s.planned_ahead == 1
    in_line = dataclasses.replace(balance, plan_ahead=False)
    fresh = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=in_line, **kwargs)
    fresh.set_epoch(1)
    assert _digest(ahead) == _digest(fresh.plan()) and fresh.planned_ahead == 0
    s.set_micro_steps(2, "microstep")  # the objective was left to default: epoch 2 re-plans
    s.set_epoch(2)
    s.plan()
    assert s.planned_ahead == 1
    assert _digest(copy.deepcopy(s).plan()) == _digest(s.plan())  # the thread does not copy


@pytest.mark.parametrize(
    ("text_share", "packs", "lookahead", "fill_with_images"),
    [(0.4, 16, 4096, False), (0.0, 64, 4096, False), (0.7, 32, 64, False), (0.4, 16, 4096, True)],
)
def test_the_compiled_former_makes_the_packs_of_the_plain_python_one(
    text_share, packs, lookahead, fill_with_images
) -> None:
    """The heaps, tournament tree and free-room lists of the compiled former give exactly the
    packs of the plain-Python algorithm (lists, ``heapq``, ``bisect``), batch by batch."""
    from tests.balance.source_reference import form_balanced_batches as reference

    t = synthetic_length_table(4000, text_share=text_share, seed=3)
    costs, fixed = sample_costs(vb.CostModel(), t.total_tokens, t.image_tokens, t.images)
    order = np.random.default_rng(1).permutation(len(t.total_tokens))
    kwargs = dict(
        packs_per_batch=packs,
        seq_len=8192,
        pack_fixed_image_cost=fixed,
        settings=SourceBalance(lookahead=lookahead, fill_with_images=fill_with_images),
    )
    compiled = form_balanced_batches(order, t.total_tokens, t.image_tokens, costs, **kwargs)
    plain = reference(order, t.total_tokens, t.image_tokens, costs, **kwargs)
    assert len(compiled) == len(plain) > 3
    for ours, theirs in zip(compiled, plain):
        assert [ours[i].tolist() for i in range(len(ours))] == theirs


def _small_case(seed: int, fill_with_images: bool) -> tuple:
    """A small random epoch for the former: a few packs of a few hundred tokens, samples with
    and without images, a fixed image cost of up to two packs of tokens, random settings."""
    rng = np.random.default_rng(seed)
    T = int(rng.integers(32, 257))
    n = int(rng.integers(5, 120))
    tokens = rng.integers(1, T + 1, n)
    has_image = rng.random(n) < rng.random()
    image_tokens = np.where(has_image, rng.integers(1, tokens + 1), 0)
    cost = tokens + image_tokens * 3 * rng.random() + rng.random(n)
    settings = SourceBalance(
        slack=float(rng.random() * 0.3),
        small_tokens=int(rng.integers(0, T)),
        lookahead=int(rng.integers(0, n + 1)),
        fill_with_images=fill_with_images,
    )
    kwargs = dict(
        packs_per_batch=int(rng.integers(1, 7)),
        seq_len=T,
        pack_fixed_image_cost=float(rng.random() * 2 * T),
        settings=settings,
    )
    return rng.permutation(n), tokens, image_tokens, cost, kwargs


@pytest.mark.parametrize("fill_with_images", [False, True])
def test_the_compiled_former_matches_the_plain_python_one_on_small_random_epochs(
    fill_with_images,
) -> None:
    """On 400 small random epochs (seeded), the compiled former makes exactly the oracle's packs,
    every sample is in exactly one pack and no pack holds more than ``seq_len`` tokens; with
    ``fill_with_images`` a pack that gains its first image from the lookahead pays the fixed
    image cost."""
    from tests.balance.source_reference import form_balanced_batches as reference

    for seed in range(400):
        order, tokens, image_tokens, cost, kwargs = _small_case(seed, fill_with_images)
        compiled = form_balanced_batches(order, tokens, image_tokens, cost, **kwargs)
        ours = [[p.tolist() for p in batch] for batch in compiled]
        assert ours == reference(order, tokens, image_tokens, cost, **kwargs), f"seed {seed}"
        ids = sorted(s for batch in ours for pack in batch for s in pack)
        assert ids == list(range(len(tokens))), f"seed {seed}"
        assert all(tokens[pack].sum() <= kwargs["seq_len"] for b in ours for pack in b)


def test_images_from_the_lookahead_fill_gaps_and_pay_the_fixed_image_cost() -> None:
    """With ``fill_with_images``, images from the lookahead fill the gaps though no text sample
    fits them, each into the pack of least cost, where a pack's cost counts the fixed image cost
    once it has an image (also when it gains the image in the fill)."""
    # A (text, 70 tokens, cost 90) and B (image, 70 tokens, cost 60 + 50 fixed) fill two packs of
    # 100 to 70; the short texts X and Y do not fit the gaps of 30 and wait; C1 and C2 (images,
    # 15 tokens, cost 10) come from the lookahead: C1 to A's pack (90 < 110, then 150), C2 to B's
    # (110 < 150). Without the fixed cost on C1, C2 would follow it (100 < 110).
    tokens = np.array([70, 70, 45, 45, 15, 15])
    image_tokens = np.array([0, 50, 0, 0, 10, 10])
    cost = np.array([90.0, 60.0, 45.0, 45.0, 10.0, 10.0])
    batches = form_balanced_batches(
        np.arange(6),
        tokens,
        image_tokens,
        cost,
        packs_per_batch=2,
        seq_len=100,
        pack_fixed_image_cost=50.0,
        settings=SourceBalance(slack=0.0, small_tokens=50, fill_with_images=True),
    )
    assert [p.tolist() for p in batches[0]] == [[0, 4], [1, 5]]
    assert sorted(s for b in batches for p in b for s in p.tolist()) == list(range(6))


# -- online calibration: the rest of an epoch re-planned with an adopted cost model ------------


def _vision_heavy() -> vb.CostModel:
    """A model far from the defaults: the vision phases only (other batches, other packs)."""
    llm = {"pack": 0.0, "total_tokens": 0.0, "doc_sq_tokens": 0.0}
    return vb.CostModel(coefficients={"llm_fwd": llm, "llm_bwd": llm})


@pytest.mark.parametrize("exact", [False, True])
def test_an_adopted_model_re_plans_the_rest_of_the_epoch(exact) -> None:
    """Adopting a model at global batch 2 keeps batches 0-1 as they were, forms the rest from
    the samples they left (stream order) with the new model, every sample still exactly once;
    later epochs plan with the new model from their start."""
    t = _table(3000)
    kw = {"seq_len": 8192, "num_replicas": 4, "rank": 0}
    balance = vb.SourceBalance(micro_steps=2, exact=exact)
    s = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=balance, **kw)
    before = s.plan()
    new = _vision_heavy()
    assert s.adopt_cost_model(new, from_batch=2)
    after = s.plan()
    for r in range(4):
        for k in range(4):  # batches 0-1: 2 packs per rank each
            assert np.array_equal(after.rank_packs[r][k], before.rank_packs[r][k])
    assert _digest(after) != _digest(before)
    assert np.sort(after.sample_ids()).tolist() == list(range(3000))
    assert all(t.total_tokens[p].sum() <= 8192 for rank in after.rank_packs for p in rank)
    assert not s.adopt_cost_model(new, from_batch=7)  # already in use there: nothing changes
    assert [b for b, _ in s.cost_schedule()] == [0, 2]
    # the next epoch is planned with the new model from its start
    s.set_epoch(1)
    fresh = vb.PackingSampler(t.total_tokens, t.image_tokens, balance=balance, **kw)
    fresh.adopt_cost_model(new, from_batch=0)
    fresh.set_epoch(1)
    assert _digest(s.plan()) == _digest(fresh.plan())


def test_a_loader_re_plans_past_what_it_has_read_and_resumes_on_the_same_packs() -> None:
    """A loader mid-epoch switches at the first global batch after the position it is told
    (with one to spare): the packs it yields are the old plan's up to there and the new plan's
    after, every sample once; its state restores the same packs in a new loader. A rank that
    has read past the switch raises."""
    from lightning_vlmbalance.synthetic import SyntheticVLMDataset

    t = synthetic_length_table(400, text_share=0.4, tile_tokens=8, max_text_tokens=64, seed=2)
    ds = SyntheticVLMDataset(t, vocab_size=32, patch_dim=4)

    def loader() -> vb.PackedDataLoader:
        s = vb.PackingSampler(
            t.total_tokens,
            t.image_tokens,
            seq_len=128,
            num_replicas=1,
            rank=0,
            balance=vb.SourceBalance(micro_steps=2),
        )
        return vb.PackedDataLoader(ds, s, vb.PackCollator(128, image_feature_shape=(4,)))

    first = loader()
    it = iter(first)
    seen = [next(it)["meta"]["sample_ids"] for _ in range(5)]
    assert first.read_position() == 5
    switch = first.adopt_cost_model(_vision_heavy(), after=first.read_position())
    assert switch == 4  # ceil(5 / 2) + 1: the first global batch nobody has read, and one more
    state = None
    for k, batch in enumerate(it, start=5):
        seen.append(batch["meta"]["sample_ids"])
        if k == 9:
            state = first.state_at(k + 1)
    assert sorted(s for ids in seen for s in ids) == list(range(400))
    plan = first.sampler.plan()
    assert [list(ids) for ids in seen] == [p.tolist() for p in plan.rank_packs[0]]
    # the checkpoint's state holds the models by batch: a new loader trains the same packs
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b["meta"]["sample_ids"] for b in resumed]
    assert rest == seen[10:]
    # a rank told a position behind its own would switch inside what it already read
    behind = loader()
    it = iter(behind)
    for _ in range(9):
        next(it)
    with pytest.raises(RuntimeError, match="furthest position"):
        behind.adopt_cost_model(_vision_heavy(), after=2)


def test_a_re_plan_never_lengthens_the_epoch() -> None:
    """Online calibration re-plans the rest of an epoch; a re-plan that would take more packs
    (more optimizer steps than Lightning estimated: OneCycleLR sized from
    ``estimated_stepping_batches`` raised "Tried to step 99 times" at the end of the run) is
    not adopted for that epoch; the next epochs are planned with the new model."""
    from lightning_vlmbalance.balance.cost import CostModel, _default_coefficients

    rng = np.random.default_rng(0)
    refused = 0
    for seed in range(12):
        table = synthetic_length_table(
            1500, text_share=0.3, tile_tokens=16, max_text_tokens=256, seed=seed
        )

        def sampler(table=table, seed=seed) -> vb.PackingSampler:
            return vb.PackingSampler(
                table.total_tokens,
                table.image_tokens,
                seq_len=512,
                seed=seed,
                balance=vb.SourceBalance(micro_steps=3),
                num_replicas=2,
                rank=0,
            )

        for _ in range(3):
            s = sampler()
            before = s.packs_per_rank(0)
            coefficients = {
                phase: {k: v * float(rng.lognormal(0, 2)) for k, v in terms.items()}
                for phase, terms in _default_coefficients().items()
            }
            model = CostModel(coefficients=coefficients)
            # an epoch whose plan is not cached yet (epoch 3) is counted with its old model too
            epoch = 0 if seed % 2 else 3
            if epoch:
                before = sampler().packs_per_rank(epoch)
            first = int(rng.integers(1, 30))
            adopted = s.adopt_cost_model(model, epoch=epoch, from_batch=first)
            assert s.packs_per_rank(epoch) <= before
            refused += not adopted
            assert s.cost_schedule(epoch + 1) == [(0, model)]  # later epochs: the new model
    assert refused > 0, "no re-plan would have lengthened its epoch: the test proves nothing"
