"""Encoder balancing: the image planner, the embeddings' return on real gloo ranks, and real
2- and 4-process fits whose parameters equal the same runs without it."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.image_lp import lp_bound, lp_min_ranks
from harness.jobs import check, result, selected
from harness.ranks import run_ranks
from lightning_vlmbalance.balance.encoder import ReturnChannel, encode_images, route_for
from lightning_vlmbalance.balance.images import image_bound, plan_images
from lightning_vlmbalance.loaders.rebalancing import image_payload_fields
from tests.balance.fits import fit_result, job, max_rel_diff
from tests.balance.strategy_job import run_fits

# -- the planner ------------------------------------------------------------------------------


def _brute_force_max(base: np.ndarray, cost: np.ndarray) -> float:
    R = len(base)
    best = float("inf")
    for assign in itertools.product(range(R), repeat=len(cost)):
        load = base + np.bincount(np.array(assign, dtype=np.int64), weights=cost, minlength=R)
        best = min(best, float(load.max()))
    return best


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.integers(0, 50), min_size=2, max_size=3),
    cost=st.lists(st.sampled_from([0, 7, 12, 20, 33]), min_size=0, max_size=6),
    data=st.data(),
)
def test_the_plan_is_between_the_bound_and_home_and_never_worse_than_the_greedy(
    base, cost, data
) -> None:
    """Every image gets one encoding rank; the largest load is at least the lower bound and the
    optimum, at most the largest load with every image at home; on these small cases it is
    within one largest image of the optimum (best fit on a bisected load)."""
    R = len(base)
    home = data.draw(st.lists(st.integers(0, R - 1), min_size=len(cost), max_size=len(cost)))
    b, c, h = (np.array(x, dtype=np.float64) for x in (base, cost, home))
    plan = plan_images(b, c, h.astype(np.int64))
    assert plan.encoder.shape == (len(cost),) and set(plan.encoder.tolist()) <= set(range(R))
    load = b + np.bincount(plan.encoder, weights=c, minlength=R)
    assert np.allclose(load, plan.load)
    optimum = _brute_force_max(b, c)
    assert image_bound(b, c) <= optimum + 1e-9 and plan.bound <= optimum + 1e-9
    assert optimum - 1e-9 <= load.max() <= plan.load_home.max() + 1e-9
    assert load.max() <= optimum + max(cost, default=0) + 1e-9


@settings(max_examples=80, deadline=None)
@given(
    ranks=st.integers(2, 4),
    cost=st.lists(st.sampled_from([3.0, 5.0, 8.0, 13.0]), min_size=1, max_size=7),
    base=st.sampled_from([0.0, 4.0]),
)
def test_the_lp_bound_never_exceeds_the_optimum(ranks, cost, base) -> None:
    """The configuration LP's bound (a report's tighter bound) is a lower bound: never above
    the brute-force optimum of equal ranks, never below the cheap bound it starts from."""
    b, c = np.full(ranks, base), np.array(cost)
    optimum = _brute_force_max(b, c)
    cheap = image_bound(b, c)
    tight = lp_bound(base, c, ranks, upper=optimum, lower=cheap)
    assert cheap - 1e-9 <= tight <= optimum + 1e-9, (cheap, tight, optimum)


def test_the_lp_bound_proves_what_the_cheap_bound_cannot() -> None:
    """chartqa's shape at 512 ranks: 1,501 images of 1,075 ms, 108 of 645 and 53 of 215, a
    per-call cost of 180 ms. Three large images leave no room for a middle one; the middle ones
    force 54 ranks with at most two large, and the large ones then need more than 512 ranks
    below a load of 180 + 3 x 1,075 + 645: the plan is optimal. The cheap bound stays at or
    below 180 + 3 x 1,075 + 215."""
    cost = np.array([1075.2] * 1501 + [645.1] * 108 + [215.0] * 53)
    base = np.full(512, 180.0)
    plan = plan_images(base, cost, np.arange(len(cost)) % 512)
    cheap = image_bound(base, cost)
    tight = lp_bound(180.0, cost, 512, upper=float(plan.load.max()), lower=cheap)
    assert cheap <= 180 + 3 * 1075.2 + 215.0 + 1e-6
    assert tight == pytest.approx(180 + 3 * 1075.2 + 645.1) == pytest.approx(plan.load.max())
    # the relaxation's own count at the cheap bound's capacity: more than 512 ranks
    assert lp_min_ranks(np.array([1075.2, 645.1, 215.0]), np.array([1501, 108, 53]), 3440.6) > 512


def test_images_stay_home_where_moving_gains_nothing() -> None:
    plan = plan_images(np.array([10.0, 10.0]), np.array([5.0, 5.0]), np.array([0, 1]))
    assert plan.moved_images == 0 and plan.waste == 0.0
    # one heavy rank: its second image moves to the idle one
    plan = plan_images(np.array([10.0, 10.0]), np.array([5.0, 5.0]), np.array([0, 0]))
    assert plan.moved_images == 1 and plan.load.tolist() == [15.0, 15.0]


def test_same_sizes_reach_the_pigeonhole_bound() -> None:
    """22 equal images on 8 equal ranks: some rank takes 3 (the bound says so), none takes 4."""
    base = np.full(8, 100.0)
    plan = plan_images(base, np.full(22, 10.0), np.zeros(22, dtype=np.int64))
    assert plan.load.max() == plan.bound == 130.0
    assert plan.load.sum() == 8 * 100.0 + 22 * 10.0


def test_bad_planner_input_is_named() -> None:
    with pytest.raises(ValueError, match="home rank is outside"):
        plan_images(np.zeros(2), np.ones(1), np.array([2]))
    with pytest.raises(ValueError, match="`cost` must be finite and >= 0"):
        plan_images(np.zeros(2), np.array([-1.0]), np.array([0]))
    with pytest.raises(ValueError, match="one entry per image"):
        plan_images(np.zeros(2), np.ones(2), np.array([0]))


# -- the return of the embeddings on real gloo ranks ---------------------------------------

FEATURE = 3


class _Encoder(torch.nn.Module):
    """A linear map, then each image's rows minus their mean (attention-like: within each image
    only, through ``cu_seqlens``), so a wrong image boundary changes the result."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(FEATURE, 4, dtype=torch.float64)

    def forward(self, pixels: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = self.proj(pixels)
        bounds = cu.tolist()
        parts = [x[a:b] - x[a:b].mean(0, keepdim=True) for a, b in itertools.pairwise(bounds)]
        return torch.cat([*parts, x[:0]])


class _BatchNormed(_Encoder):
    """Batch statistics over every row of a call: not image by image."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4, dtype=torch.float64)

    def forward(self, pixels: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        out = super().forward(pixels, cu, max_seqlen)
        return self.norm(out) if len(out) > 1 else out


class _Wrong(_Encoder):
    def forward(self, pixels: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        return super().forward(pixels, cu, max_seqlen)[1:]


def _pack(sizes: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(sizes), FEATURE, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int32)
    return {
        "pixel_values": pixels,
        "image_cu_seqlens": cu,
        "image_max_seqlen": max(sizes, default=0),
    }


# every rank's images (rows each), and which rank encodes each: rank 2 has no image at all,
# rank 1 keeps none of its own
SIZES = {0: [4, 2, 3], 1: [5, 1], 2: []}
PLAN = {0: [0, 1, 2], 1: [0, 2], 2: []}


def _route_job(rank: int, world: int, encoder_cls: type) -> dict:
    channel = ReturnChannel()  # the world group
    encoder = encoder_cls()
    batch = _pack(SIZES[rank], seed=rank)
    foreign, pixels = [], []
    for owner in range(world):  # what this rank encodes for others, in the route's order
        other = _pack(SIZES[owner], seed=owner)
        cu = other["image_cu_seqlens"].tolist()
        for i, e in enumerate(PLAN[owner]):
            if e == rank and owner != rank:
                foreign.append((owner, SIZES[owner][i]))
                pixels.append(other["pixel_values"][cu[i] : cu[i + 1]])
    batch["encoder_route"] = route_for(
        group=channel,
        rank=rank,
        world=world,
        own_sizes=SIZES[rank],
        own_encoder=PLAN[rank],
        foreign=foreign,
    )
    batch["encoder_fields"] = {
        "pixel_values": torch.cat([*pixels, torch.empty(0, FEATURE, dtype=torch.float64)])
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_images(encoder, batch)
    # the same loss at home: this rank's own images through its own encoder copy
    home = encode_images(encoder_cls(), _pack(SIZES[rank], seed=rank))
    weights = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in encoder.parameters()]
    for g in grads:  # the data-parallel sum
        torch.distributed.all_reduce(g)
    return {
        "same_rows": bool(torch.allclose(out, home, rtol=0, atol=1e-12)),
        "grads": [g.tolist() for g in grads],
        "warnings": [str(w.message) for w in caught],
    }


def _home_grads() -> list[np.ndarray]:
    total = None
    for rank, sizes in SIZES.items():
        encoder = _Encoder()
        out = encoder(**_as_call(_pack(sizes, seed=rank)))
        weights = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape)
        (out * weights).sum().backward()
        grads = [p.grad.numpy().copy() for p in encoder.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total  # type: ignore[return-value]


def _as_call(batch: dict) -> dict:
    return {
        "pixels": batch["pixel_values"],
        "cu": batch["image_cu_seqlens"],
        "max_seqlen": batch["image_max_seqlen"],
    }


def test_embeddings_come_back_in_pack_order_and_gradients_sum_as_at_home() -> None:
    """3 gloo ranks: images encoded elsewhere come back to their pack in its order (the same
    rows as encoding at home); a rank without images and a rank that keeps none take part;
    the encoder's gradient summed over ranks is the one of encoding every image at home."""
    results = run_ranks(_route_job, 3, _Encoder, timeout=120, start_method="forkserver")
    assert all(status == "ok" for status, _ in results.values()), results
    assert all(r["same_rows"] for _, r in results.values())
    expected = _home_grads()
    for _, r in results.values():
        for got, want in zip(r["grads"], expected):
            np.testing.assert_allclose(np.array(got), want, rtol=1e-12, atol=1e-12)


def test_an_encoder_with_batch_statistics_is_warned_about() -> None:
    """BatchNorm in training mode mixes the images of a call, and balancing changes which
    images share one: the parameters cannot equal DDP's (1.88 relative once), so it is
    warned, naming the layer; an image-by-image encoder is not."""
    results = run_ranks(_route_job, 3, _BatchNormed, timeout=120, start_method="forkserver")
    assert all(status == "ok" for status, _ in results.values()), results
    for _, r in results.values():
        assert any("BatchNorm in training mode (norm)" in w for w in r["warnings"]), r
    plain = run_ranks(_route_job, 3, _Encoder, timeout=120, start_method="forkserver")
    assert all(not r["warnings"] for _, r in plain.values()), plain


def test_batch_statistics_inside_a_function_are_warned_about_too() -> None:
    """The encoder given as a function over the module (what the tuple error suggests): the
    module it closes over is looked into (the warning was lost)."""
    from lightning_vlmbalance.balance.encoder import warn_batch_norm

    vision = _BatchNormed()
    with pytest.warns(UserWarning, match=r"BatchNorm in training mode \(norm\)"):
        warn_batch_norm(lambda *a: vision(*a))


def test_an_encoder_returning_a_tuple_is_named() -> None:
    """``encode_images`` needs one tensor: a tuple (a Hugging Face-style output) is a
    ``TypeError`` naming the encoder, with balancing off too (it was an AttributeError)."""

    def pair(pixels: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> tuple:
        return pixels, pixels

    with pytest.raises(TypeError, match=r"encoder function returned a tuple.*one tensor"):
        encode_images(pair, _pack([2, 3], seed=0))


def test_an_encoder_with_other_row_counts_is_named() -> None:
    results = run_ranks(_route_job, 3, _Wrong, timeout=120, start_method="forkserver")
    errors = [detail for status, detail in results.values() if status == "error"]
    assert errors and all("_Wrong returned" in e and "image tokens" in e for e in errors), results


def test_a_per_image_field_the_balancer_does_not_know_is_refused_by_name() -> None:
    pixels = torch.zeros(8, 3)
    grid = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"image fields \['image_grid_thw'\] without their rows"):
        image_payload_fields(
            {
                "image_fields": {"pixel_values": pixels, "image_grid_thw": grid},
                "image_field_rows": {"pixel_values": [4, 4]},
            }
        )
    with pytest.raises(ValueError, match=r"'pixel_values' has 8 rows but .* gives 6"):
        image_payload_fields(
            {
                "image_fields": {"pixel_values": pixels},
                "image_field_rows": {"pixel_values": [3, 3]},
            }
        )
    fields = image_payload_fields(
        {
            "image_fields": {"pixel_values": pixels, "image_grid_thw": grid},
            "image_field_rows": {"pixel_values": [4, 4], "image_grid_thw": [1, 1]},
        }
    )
    assert fields["pixel_values"][1].tolist() == [0, 4, 8]
    assert fields["image_grid_thw"][1].tolist() == [0, 1, 2]
    assert image_payload_fields({"image_fields": {}}) == {}  # a text-only pack: nothing moves


# -- real fits: the same parameters as without encoder balancing ------------------------------

SHORT = ("--max-steps", "3", "--samples", "240")


def _args(strategy: str, accumulate: int, *extra: str, devices: int = 2) -> tuple[str, ...]:
    return (
        *("--strategy", strategy, "--accumulate", str(accumulate), "--devices", str(devices)),
        *SHORT,
        *extra,
    )


# steps where no rank has an image (accumulation 1, mostly text): the vision gradients must stay
# None there, as under DDP, or AdamW moves the encoder (0.53 relative once)
UNUSED = ("--images-only-when-tokens", "--find-unused", "--text-share", "0.9", "--max-steps", "10")
FITS = {  # the longest first (4 ranks: with `pytest -m suite`)
    "ddp4_ga3": _args("ddp", 3, devices=4),
    "overlap4_ga3": _args("vlmbalance", 3, "--encoder", devices=4),
    # baselines: no encoder balancing (plain DDP / FSDP2: the same math as every mode)
    "ddp_ga3": _args("ddp", 3),
    "ddp_ga1": _args("ddp", 1),
    # balanced at the source, images seldom need to move: a longer fit
    "source_ga3": _args("vlmbalance", 3, "--balance", "--max-steps", "8"),
    "fsdp_ga3": _args("fsdp", 3),
    # encoder balancing in the modes ("sync" runs overlap's code in line, without the thread)
    "off_ga3": _args("vlmbalance", 3, "--mode", "off", "--encoder"),
    "overlap_ga3": _args("vlmbalance", 3, "--mode", "overlap", "--encoder"),
    "overlap_ga1": _args("vlmbalance", 1, "--mode", "overlap", "--encoder"),
    "source_encoder_ga3": _args("vlmbalance", 3, "--balance", "--encoder", "--max-steps", "8"),
    "fsdp_encoder_ga3": _args("fsdp_vlmbalance", 3, "--encoder"),
    # the model normalises the pixels: in the encoder (every image this rank encodes gets it)
    # or, refused by name under encoder balancing, in on_after_batch_transfer (own images only)
    "ddp_ga3_preprocess": _args("ddp", 3, "--preprocess", "batch"),
    "overlap_ga3_preprocess": _args("vlmbalance", 3, "--encoder", "--preprocess", "encoder"),
    "overlap_ga3_batch_preprocess": _args("vlmbalance", 3, "--encoder", "--preprocess", "batch"),
    # a model that uses the embeddings only in packs with image tokens (many text-only packs)
    "ddp_ga1_unused": _args("ddp", 1, *UNUSED),
    "overlap_ga1_unused": _args("vlmbalance", 1, "--encoder", *UNUSED),
    # trainer.fit(torch.compile(model)): the encoder compiled, the route's bookkeeping eager
    "overlap_ga3_compiled": _args("vlmbalance", 3, "--encoder", "--compile"),
    # mode="auto": each global batch priced and the cheapest option taken; restricted to one
    # option, each way of carrying a choice out runs at every global batch
    "auto_ga3": _args("vlmbalance", 3, "--mode", "auto", "--encoder", "--monitor"),
    "auto_both_ga3": _args("vlmbalance", 3, "--mode", "auto", "--encoder", "--options", "both"),
    "auto_images_ga3": _args("vlmbalance", 3, "--mode", "auto", "--encoder", "--options", "images"),
    "fsdp_auto_both_ga3": _args(
        "fsdp_vlmbalance", 3, "--mode", "auto", "--encoder", "--options", "both"
    ),
    # auto after online refits adopted at one micro-batch per step: the prices of a CPU-scale
    # model are tens of ms, where a rank-local number in a price once split the ranks' choices
    "ddp_ga1_long": _args("ddp", 1, "--max-steps", "30", "--samples", "700"),
    "auto_ga1_calibrated": _args(
        "vlmbalance",
        1,
        *("--mode", "auto", "--encoder", "--monitor", "--calibrate-every", "10"),
        *("--max-steps", "30", "--samples", "700"),
    ),
}
# the fits of one launch run one after the other in the same processes (process start-up is
# most of a short fit's time), the baseline first: before any encoder-balancing code ran there
LAUNCHES = [
    ("ddp4_ga3", "overlap4_ga3"),
    ("source_ga3", "source_encoder_ga3"),
    ("fsdp_ga3", "fsdp_encoder_ga3", "fsdp_auto_both_ga3"),
    ("ddp_ga3", "off_ga3", "overlap_ga3", "auto_ga3", "auto_both_ga3", "auto_images_ga3"),
    ("ddp_ga1", "overlap_ga1", "overlap_ga3_compiled"),
    ("ddp_ga1_unused", "overlap_ga1_unused", "ddp_ga3_preprocess", "overlap_ga3_preprocess"),
    ("ddp_ga1_long", "auto_ga1_calibrated"),
    ("overlap_ga3_batch_preprocess",),  # fails: alone
]
PAIRS = [  # (with encoder balancing, its baseline)
    ("off_ga3", "ddp_ga3"),
    ("overlap_ga3", "ddp_ga3"),
    ("overlap_ga1", "ddp_ga1"),
    ("overlap4_ga3", "ddp4_ga3"),
    ("source_encoder_ga3", "source_ga3"),
    ("fsdp_encoder_ga3", "fsdp_ga3"),
    ("overlap_ga3_preprocess", "ddp_ga3_preprocess"),
    ("overlap_ga1_unused", "ddp_ga1_unused"),
    ("overlap_ga3_compiled", "ddp_ga3"),
    ("auto_both_ga3", "ddp_ga3"),
    ("auto_images_ga3", "ddp_ga3"),
    ("fsdp_auto_both_ga3", "fsdp_ga3"),
]


@pytest.fixture(scope="module")
def fits(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("encoder_fits")
    procs = run_fits(
        {name: job(root / name, *a) for name, a in selected(request, FITS).items()},
        LAUNCHES,
    )
    return {"root": root, "procs": procs}


def _pair(run: str, baseline: str) -> Any:
    marks = [pytest.mark.jobs(run, baseline)]
    if "4_" in run:  # 4 processes on 2 cores: the longest fits, among the full suites
        marks.append(pytest.mark.suite)
    if run == "overlap_ga3_preprocess":  # the CI's 20 minutes: the refusal runs in CI
        marks.append(pytest.mark.suite)
    # the CI's 20 minutes: overlap_ga1_unused covers accumulation 1, and overlap_ga3 the encoder
    # balancing that overlap_ga3_compiled compiles
    if run in ("overlap_ga1", "overlap_ga3_compiled"):
        marks.append(pytest.mark.suite)
    return pytest.param(run, baseline, marks=marks, id=run)


@pytest.mark.parametrize(("run", "baseline"), [_pair(*p) for p in PAIRS])
def test_same_parameters_with_images_moved(fits, run, baseline) -> None:
    """Float64: a fit whose images are encoded on other ranks ends with the parameters of the
    same fit without encoder balancing, to 1e-10 relative; images did move."""
    for name in (run, baseline):
        check(result(fits["procs"], name))
    got, want = fit_result(fits["root"] / run), fit_result(fits["root"] / baseline)
    assert max_rel_diff(got["params"], want["params"]) < 1e-10
    moved = sum(s["encoder_moved_images"] for s in got[0]["stats"])
    assert moved > 0, f"{run}: no image moved, the test would prove nothing"
    stats = got[0]["stats"]  # rank 0's: the bytes of the images it received
    assert all((s["encoder_bytes"] > 0) == (s["encoder_received_images"] > 0) for s in stats)
    assert any(s["encoder_received_images"] for s in stats)
    assert {"balance/encoder_moved_images", "balance/encoder_bytes"} <= set(got[0]["logged"])


@pytest.mark.jobs("auto_ga3", "auto_both_ga3", "ddp_ga3")
def test_auto_takes_one_option_per_global_batch_on_every_rank_and_keeps_the_parameters(
    fits,
) -> None:
    """``mode="auto"``: every global batch has a choice and a predicted step, the same on
    both ranks, logged to the metrics; the parameters are those of plain DDP (float64, 1e-10).
    Restricted to ``both``, every global batch moves packs and then routes their images."""
    from lightning_vlmbalance.balance.choice import OPTIONS

    want = fit_result(fits["root"] / "ddp_ga3")
    for run in ("auto_ga3", "auto_both_ga3"):
        check(result(fits["procs"], run))
        got = fit_result(fits["root"] / run)
        assert max_rel_diff(got["params"], want["params"]) < 1e-10, run
        chosen = [[OPTIONS[int(s["choice"])] for s in got[r]["stats"]] for r in (0, 1)]
        assert chosen[0] == chosen[1] and chosen[0], (run, chosen)
        assert all(s["predicted_step_ms"] > 0 for s in got[0]["stats"])
        assert {"balance/choice", "balance/predicted_step_ms"} <= set(got[0]["logged"])
    # the monitor's measured steps teach how the step relates to its price (auto_ga3 has a
    # StragglerMonitor): every step but the last few is matched with its price; the default
    # model prices a large GPU model, far above these CPU steps
    for r in (0, 1):
        scale = fit_result(fits["root"] / "auto_ga3")[r]["step_scale"]
        assert scale["timed"] >= 2 and 0.0 < scale["factor"] < 1.0, scale
    both = fit_result(fits["root"] / "auto_both_ga3")[0]["stats"]
    assert {OPTIONS[int(s["choice"])] for s in both} == {"both"}
    assert sum(s["moved_packs"] for s in both) > 0 and sum(s["encoder_moved_images"] for s in both)


@pytest.mark.jobs("auto_ga1_calibrated", "ddp_ga1_long")
def test_auto_after_refits_takes_the_same_option_on_every_rank(fits) -> None:
    """With refits adopted (a model priced in tens of ms) every rank reaches the same option
    by itself (rank 0's broadcast never overrules one), and the parameters are DDP's."""
    from lightning_vlmbalance.balance.choice import OPTIONS

    check(result(fits["procs"], "auto_ga1_calibrated"))
    got = fit_result(fits["root"] / "auto_ga1_calibrated")
    want = fit_result(fits["root"] / "ddp_ga1_long")
    assert max_rel_diff(got["params"], want["params"]) < 1e-10
    for r in (0, 1):
        stats = got[r]["stats"]
        assert len(stats) == 30 and not any(s.get("choice_overruled") for s in stats)
    chosen = [[OPTIONS[int(s["choice"])] for s in got[r]["stats"]] for r in (0, 1)]
    assert chosen[0] == chosen[1]
    # after the refits the model prices this machine's compute: the step takes more (the
    # optimizer step and the reduction weigh on this tiny model); kept across the last refit
    assert got[0]["step_scale"]["factor"] > 0.9, got[0]["step_scale"]


@pytest.mark.jobs("overlap_ga3_batch_preprocess")
def test_preprocessing_the_batch_before_the_encoder_is_refused_by_name(fits) -> None:
    """Normalising ``pixel_values`` in ``on_after_batch_transfer`` reaches this rank's own
    images only (the received ones are encoded as loaded: 1.36 relative from DDP once):
    refused, naming the field and where to preprocess instead."""
    proc = result(fits["procs"], "overlap_ga3_batch_preprocess")
    assert proc.returncode != 0
    assert "the pack's image field 'pixel_values' changed between the loader" in proc.stderr
    assert "Preprocess inside the encoder given to `encode_images`" in proc.stderr


def test_micro_steps_are_reordered_within_ranks_to_even_vision_work() -> None:
    from lightning_vlmbalance.balance.images import order_micro_steps

    rng = np.random.default_rng(0)
    vision = rng.choice([0.0, 645.0, 1075.0, 2150.0], size=(64, 8))
    order = order_micro_steps(vision)
    assert all(sorted(row) == list(range(8)) for row in order.tolist())  # a permutation each
    before = vision.sum(axis=0)
    after = np.take_along_axis(vision, order, axis=1).sum(axis=0)
    assert after.sum() == before.sum() and np.ptp(after) < 0.5 * np.ptp(before)
    assert (order_micro_steps(vision[:, :1]) == 0).all()  # one micro-step: nothing to order


def test_any_change_to_the_loaders_pixels_is_refused_at_any_call_and_a_cast_is_not() -> None:
    """The check compares the loader's values, cast as the batch was cast, exactly, at every
    call: a 0.9% scaling passed the old 1% tolerance, and preprocessing that started after the
    first 16 calls (augmentation after a warm-up) passed unchecked."""
    from lightning_vlmbalance.balance.encoder import check_unchanged, probe_fields

    pixels = _pack([4, 2, 3], seed=0)["pixel_values"].float()
    route = route_for(
        group=ReturnChannel(),
        rank=0,
        world=1,
        own_sizes=[4, 2, 3],
        own_encoder=[0, 0, 0],
        foreign=[],
    )
    route.probe = probe_fields({"pixel_values": (pixels, None)})
    for _ in range(40):  # unchanged, or cast (bf16-true, .double(), fp16): accepted
        for cast in (pixels, pixels.double(), pixels.bfloat16(), pixels.half()):
            check_unchanged(route, "pixel_values", cast)
    for changed in (pixels * 1.009, pixels.bfloat16().float(), (pixels - 0.1) * 2.0):
        with pytest.raises(ValueError, match="'pixel_values' changed between the loader"):
            check_unchanged(route, "pixel_values", changed)


def test_a_route_keeps_its_channel_through_lightnings_batch_transfer() -> None:
    """The channel (the return's group, timers and returns) rides on the route, which
    Lightning's batch transfer copies field by field: the copy carries the same channel."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    channel = ReturnChannel()
    route = route_for(group=channel, rank=0, world=1, own_sizes=[2], own_encoder=[0], foreign=[])
    moved = move_data_to_device({"encoder_route": route, "x": torch.zeros(1)}, "cpu")
    assert moved["encoder_route"].group is channel


def test_a_route_named_by_the_deprecated_register_group_still_returns() -> None:
    """``register_group(name, group)`` and ``route_for(group=name)`` (routes made by hand
    before channels) work on, with a deprecation warning; an unknown name is refused by name."""
    from lightning_vlmbalance.balance.encoder import register_group, return_home

    with pytest.warns(DeprecationWarning, match="register_group"):
        register_group("by-hand", None)
    out = torch.arange(6.0).reshape(3, 2)
    route = route_for(
        group="by-hand",
        rank=0,
        world=1,
        own_sizes=[1, 2],
        own_encoder=[0, 0],
        foreign=[],
        moved_any=False,
    )
    assert torch.equal(return_home(route, out), out)
    route.group = "never-named"
    with pytest.raises(ValueError, match="'never-named'"):
        return_home(route, out)
