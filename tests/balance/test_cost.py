"""The cost model: defaults, NNLS calibration from monitor records, persistence, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_vlmbalance.balance import (
    FEATURES,
    CostModel,
    features_from_packs,
    nnls,
    read_monitor_jsonl,
)
from lightning_vlmbalance.packing import pack_greedy
from lightning_vlmbalance.synthetic import synthetic_length_table

TRUE = {
    "vision_fwd": {
        "image_pack": 45.0,
        "images": 6.0,
        "image_tokens": 0.21,
        "image_sq_tokens": 2e-5,
    },
    "vision_bwd": {
        "image_pack": 80.0,
        "images": 9.0,
        "image_tokens": 0.45,
        "image_sq_tokens": 5e-5,
    },
    "llm_fwd": {"pack": 15.0, "total_tokens": 0.025, "doc_sq_tokens": 1.5e-6},
    "llm_bwd": {"pack": 25.0, "total_tokens": 0.055, "doc_sq_tokens": 3.5e-6},
}


def _random_features(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    images = rng.integers(0, 6, n)
    per_image = rng.integers(64, 1800, n)
    image_tokens = images * per_image
    total = image_tokens + rng.integers(200, 6000, n)
    docs = rng.integers(1, 12, n)
    return {
        "total_tokens": total,
        "image_tokens": image_tokens,
        "images": images,
        "image_sq_tokens": images * per_image**2,
        "doc_sq_tokens": total**2 // docs,
    }


def _records(n: int, noise: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    feats = _random_features(n, rng)
    truth = CostModel(coefficients=TRUE).predict(feats)

    def noisy(x):
        return x * (1.0 + noise * rng.standard_normal(n))

    measured = {
        "vision_fwd_ms": noisy(truth["vision_fwd"]),
        "llm_fwd_ms": noisy(truth["llm_fwd"]),
        "backward_ms": noisy(truth["vision_bwd"] + truth["llm_bwd"]),
    }
    return [
        {**{f: int(feats[f][i]) for f in FEATURES}, **{k: float(v[i]) for k, v in measured.items()}}
        for i in range(n)
    ]


def test_defaults_reproduce_the_design_numbers() -> None:
    """3,000 image tokens -> 900 ms vision forward, 500 -> 200 ms; backward twice forward."""
    feats = {
        "total_tokens": [8192, 8192, 8192],
        "image_tokens": [3000, 500, 0],
        "images": [3, 1, 0],
        "image_sq_tokens": [3 * 1000**2, 500**2, 0],
        "doc_sq_tokens": [8192**2] * 3,
    }
    pred = CostModel().predict(feats)
    np.testing.assert_allclose(pred["vision_fwd"], [900.0, 200.0, 0.0])
    np.testing.assert_allclose(pred["vision_bwd"], 2 * pred["vision_fwd"])
    np.testing.assert_allclose(pred["llm_bwd"], 2 * pred["llm_fwd"])
    cost_us = CostModel().pack_cost_us(feats)
    assert cost_us.dtype == np.int64 and cost_us[0] > cost_us[1] > cost_us[2] > 0


def test_fit_recovers_known_coefficients_from_noisy_timings() -> None:
    """NNLS on 2% noisy synthetic timings recovers every coefficient within 5%."""
    model = CostModel()
    report = model.fit(_records(10_000, noise=0.02))
    for phase, terms in TRUE.items():
        for term, value in terms.items():
            got = model.coefficients[phase][term]
            assert got == pytest.approx(value, rel=0.05), (phase, term, got, value)
    assert set(report.fitted) == {"vision_fwd_ms", "llm_fwd_ms", "backward_ms"}
    assert report.mape["total_ms"] < 0.03
    assert report.r2["total_ms"] > 0.99
    assert "MAPE" in str(report)


def test_fit_keeps_phases_without_measurements() -> None:
    records = [{k: v for k, v in r.items() if k != "vision_fwd_ms"} for r in _records(500, 0.0)]
    model = CostModel()
    before = dict(model.coefficients["vision_fwd"])
    report = model.fit(records)
    assert model.coefficients["vision_fwd"] == before
    assert "vision_fwd_ms" not in report.fitted


def test_fit_reads_monitor_jsonl(tmp_path) -> None:
    """A StragglerMonitor JSON-lines folder (records under "micro") is a valid input."""
    records = _records(600, noise=0.0, seed=1)
    for rank in range(2):
        lines = [
            json.dumps({"v": 1, "rank": rank, "micro": records[i : i + 4]})
            for i in range(rank * 300, rank * 300 + 300, 4)
        ]
        (tmp_path / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
    assert len(read_monitor_jsonl(tmp_path)) == 600
    model = CostModel()
    report = model.fit(tmp_path)
    assert report.samples == 600 and report.mape["total_ms"] < 1e-6


def test_save_load_round_trip(tmp_path) -> None:
    model = CostModel(coefficients={"llm_fwd": {"total_tokens": 0.05}})
    model.save(tmp_path / "cost.json")
    loaded = CostModel.load(tmp_path / "cost.json")
    assert loaded.coefficients == model.coefficients
    assert loaded.coefficients["vision_fwd"]["image_tokens"] == 0.28  # defaults fill the rest
    # the dict is a copy: changing it (say to derive another model) leaves the model as it is
    data = model.to_dict()
    data["coefficients"]["llm_fwd"]["total_tokens"] = 9.0
    assert model.coefficients["llm_fwd"]["total_tokens"] == 0.05


@pytest.mark.parametrize(
    ("coefficients", "match"),
    [
        ({"optimizer": {}}, "unknown phase"),
        ({"llm_fwd": {"image_tokens": 1.0}}, "has no term"),
        ({"llm_fwd": {"pack": -1.0}}, "finite and >= 0"),
        ({"llm_fwd": {"pack": float("inf")}}, "finite and >= 0"),
    ],
)
def test_bad_coefficients_are_named(coefficients, match) -> None:
    with pytest.raises(ValueError, match=match):
        CostModel(coefficients=coefficients)


def test_bad_inputs_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="features"):
        CostModel().predict({"total_tokens": [1]})
    feats = {f: [1, 2] for f in FEATURES} | {"images": [1, -1]}
    with pytest.raises(ValueError, match="pack 1 has images"):
        CostModel().predict(feats)
    with pytest.raises(ValueError, match="no micro-batch record"):
        CostModel().fit([{"vision_fwd_ms": 1.0}])
    (tmp_path / "bad.jsonl").write_text('{"micro": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_monitor_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "c.json").write_text('{"version": 2, "unit": "ms"}')
    with pytest.raises(ValueError, match="version"):
        CostModel.load(tmp_path / "c.json")


def test_nnls_meets_the_optimality_conditions() -> None:
    """x >= 0; the gradient A^T(Ax - y) is 0 where x > 0 and >= 0 where x = 0 (KKT)."""
    rng = np.random.default_rng(4)
    for case in range(200):
        m, n = int(rng.integers(3, 40)), int(rng.integers(1, 8))
        A = rng.random((m, n)) * 10.0 ** rng.integers(-3, 4, n)
        y = A @ rng.normal(size=n) + 0.1 * rng.normal(size=m)
        x = nnls(A, y)
        grad = A.T @ (A @ x - y)
        scale = np.linalg.norm(A, axis=0) * (np.linalg.norm(y) + 1)
        assert (x >= 0).all(), case
        assert np.all(np.abs(grad[x > 0]) <= 1e-8 * scale[x > 0]), case
        assert np.all(grad[x == 0] >= -1e-8 * scale[x == 0]), case
    # a positive unconstrained optimum is returned as is
    A = rng.random((50, 4))
    np.testing.assert_allclose(nnls(A, A @ np.array([1.0, 2.0, 0.5, 3.0])), [1, 2, 0.5, 3])


def test_features_from_packs_sums_per_pack() -> None:
    table = synthetic_length_table(500, seed=0)
    total = np.asarray(table.total_tokens)
    image = np.asarray(table.image_tokens)
    images = np.asarray(table.images)
    packs = pack_greedy(total, 2048)
    f = features_from_packs(packs, total, image, images)
    for i in range(len(packs)):
        ids = packs[i]
        assert f["total_tokens"][i] == total[ids].sum()
        assert f["image_tokens"][i] == image[ids].sum()
        assert f["images"][i] == images[ids].sum()
        assert f["doc_sq_tokens"][i] == (total[ids] ** 2).sum()
        per_image = np.where(images[ids] > 0, image[ids] ** 2 // np.maximum(images[ids], 1), 0)
        assert f["image_sq_tokens"][i] == per_image.sum()


def test_fit_rejects_bad_times_and_leaves_the_model_unchanged() -> None:
    records = _records(200, noise=0.0)
    records[17]["llm_fwd_ms"] = float("nan")
    model = CostModel()
    before = {p: dict(t) for p, t in model.coefficients.items()}
    with pytest.raises(ValueError, match="record 17 has llm_fwd_ms = nan"):
        model.fit(records)
    assert model.coefficients == before
    # too few records for the backward terms: vision forward must not be half-fitted either
    few = [dict(r) for r in _records(40, noise=0.0)]
    for r in few[3:]:
        del r["backward_ms"]
    with pytest.raises(ValueError, match="backward_ms has 3 records"):
        model.fit(few)
    assert model.coefficients == before


def _timed(feats: dict[str, np.ndarray], truth: CostModel) -> list[dict]:
    """Noise-free monitor records of ``truth`` on ``feats``."""
    ms = truth.predict(feats)
    n = len(feats["total_tokens"])
    return [
        {
            **{f: int(feats[f][i]) for f in FEATURES},
            "vision_fwd_ms": float(ms["vision_fwd"][i]),
            "llm_fwd_ms": float(ms["llm_fwd"][i]),
            "backward_ms": float(ms["vision_bwd"][i] + ms["llm_bwd"][i]),
        }
        for i in range(n)
    ]


def _image_features(images: np.ndarray, per_image: np.ndarray, rng) -> dict[str, np.ndarray]:
    image_tokens = images * per_image
    total = image_tokens + rng.integers(200, 6000, len(images))
    return {
        "total_tokens": total,
        "image_tokens": image_tokens,
        "images": images,
        "image_sq_tokens": images * per_image**2,
        "doc_sq_tokens": total**2 // rng.integers(1, 12, len(images)),
    }


def test_fit_on_text_only_records_keeps_the_vision_prior() -> None:
    """Records without images cannot determine a vision coefficient: every one keeps its prior
    (a 3,000-image-token pack still costs what the prior says, not 0), and the report names the
    terms it fitted and those it kept."""
    rng = np.random.default_rng(0)
    n = 300
    zeros = np.zeros(n, dtype=np.int64)
    truth = CostModel(coefficients={"llm_fwd": TRUE["llm_fwd"], "llm_bwd": TRUE["llm_bwd"]})
    model = CostModel()
    prior = {p: dict(t) for p, t in model.coefficients.items()}
    report = model.fit(_timed(_image_features(zeros, zeros, rng), truth))
    for phase in ("vision_fwd", "vision_bwd"):
        assert model.coefficients[phase] == prior[phase]
    for phase in ("llm_fwd", "llm_bwd"):
        for term, value in TRUE[phase].items():
            assert model.coefficients[phase][term] == pytest.approx(value, rel=1e-6)
    pack = {
        "total_tokens": [8192],
        "image_tokens": [3000],
        "images": [3],
        "image_sq_tokens": [3 * 1000**2],
        "doc_sq_tokens": [8192**2],
    }
    assert model.pack_cost_ms(pack) == pytest.approx(truth.pack_cost_ms(pack))
    assert report.determined["vision_fwd_ms"] == ()
    assert set(report.kept["vision_fwd_ms"]) == {
        "image_pack",
        "images",
        "image_tokens",
        "image_sq_tokens",
    }
    assert set(report.determined["llm_fwd_ms"]) == {"pack", "total_tokens", "doc_sq_tokens"}
    assert "image_tokens" in report.kept["backward_ms"]
    assert report.timed == {"vision_fwd_ms": n, "llm_fwd_ms": n, "backward_ms": n}
    assert "kept the prior" in str(report) and "image_tokens" in str(report)


def test_fit_on_one_image_size_keeps_the_prior_of_the_terms_it_cannot_tell_apart() -> None:
    """With every image the same size, images, image tokens and their squares are proportional:
    the fit determines their sum and keeps the prior split, so a model whose truth has the prior's
    shape still predicts packs of other image sizes (not 10%+ off)."""
    rng = np.random.default_rng(1)
    n = 400
    truth = CostModel()
    for terms in truth.coefficients.values():
        for term in terms:
            terms[term] *= 1.7
    same = _image_features(rng.integers(0, 6, n), np.full(n, 1024), rng)
    model = CostModel()
    report = model.fit(_timed(same, truth))
    kept = set(report.kept["vision_fwd_ms"])
    assert len(kept) == 2 and kept < {"images", "image_tokens", "image_sq_tokens"}
    varied = _image_features(rng.integers(0, 6, n), rng.integers(64, 1800, n), rng)
    np.testing.assert_allclose(model.pack_cost_ms(varied), truth.pack_cost_ms(varied), rtol=1e-6)


def test_fit_names_the_input_of_a_bad_record(tmp_path) -> None:
    """A bad record is named by its index in the records given, or by file and line."""
    records = _records(50, noise=0.0)
    records.insert(0, {"llm_fwd_ms": 1.0})  # no pack features: skipped, still counted
    records[21]["backward_ms"] = -3.0
    with pytest.raises(ValueError, match=r"record 21 has backward_ms = -3\.0"):
        CostModel().fit(records)
    records[21]["backward_ms"] = "fast"
    with pytest.raises(ValueError, match=r"record 21 has backward_ms = 'fast'"):
        CostModel().fit(records)
    records[21]["backward_ms"] = 1.0
    records[30]["images"] = "two"
    with pytest.raises(ValueError, match=r"record 30 has images = 'two'"):
        CostModel().fit(records)
    records[30]["images"] = -1
    with pytest.raises(ValueError, match=r"record 30 has images = -1"):
        CostModel().fit(records)
    records[30] = ["not", "a", "record"]
    with pytest.raises(ValueError, match=r"record 30 is not a micro-batch record"):
        CostModel().fit(records)
    good = _records(12, noise=0.0)
    bad = dict(good[5], llm_fwd_ms=float("inf"))
    lines = [
        json.dumps({"micro": good[:4]}),
        "",
        json.dumps({"micro": [good[4], bad]}),
    ]
    (tmp_path / "rank_0.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rank_0\.jsonl:3 micro\[1\] has llm_fwd_ms = inf"):
        CostModel().fit(tmp_path)
    for micro in ({"total_tokens": 1}, [1, 2], "x"):
        (tmp_path / "rank_0.jsonl").write_text(json.dumps({"micro": micro}) + "\n")
        with pytest.raises(ValueError, match=r"rank_0\.jsonl:1: \"micro\" must be a list"):
            read_monitor_jsonl(tmp_path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"version": 1, "unit": "ms"}', '"coefficients"'),
        ("[1, 2]", "a JSON object"),
        ('{"version": 1, "unit": "ms", "coefficients": [1]}', '"coefficients"'),
        ('{"version": 1, "unit": "ms", "coefficients": {"llm_fwd": 3}}', "llm_fwd"),
        (
            '{"version": 1, "unit": "ms", "coefficients": {"llm_fwd": {"pack": "x"}}}',
            "llm_fwd.pack",
        ),
    ],
)
def test_bad_cost_model_files_are_named(tmp_path, text, match) -> None:
    path = tmp_path / "cost.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        CostModel.load(path)
    assert "cost.json" in str(err.value)


def test_per_sample_costs_sum_to_the_pack_cost() -> None:
    """The source former's per-sample costs come from the cost model's own term matrix: a
    pack's samples' costs plus the per-pack costs are the model's cost of that pack, for any
    coefficients (one rounding rule for per-image sizes: rounded down, as in pack features)."""
    from lightning_vlmbalance.balance.cost import features_from_packs, sample_features
    from lightning_vlmbalance.balance.source import sample_costs

    table = synthetic_length_table(300, tile_tokens=7, seed=4)
    images = np.where(table.images > 0, table.images + 1, 0)  # image sizes that do not divide
    packs = pack_greedy(table.total_tokens, 4096)
    rng = np.random.default_rng(0)
    for _ in range(3):
        model = CostModel()
        model.coefficients = {
            phase: {term: float(rng.uniform(0, 2)) for term in terms}
            for phase, terms in model.coefficients.items()
        }
        cost, fixed = sample_costs(model, table.total_tokens, table.image_tokens, images)
        _, pack, image_pack = model.additive_cost_ms(
            sample_features(table.total_tokens, table.image_tokens, images)
        )
        assert fixed == image_pack
        feats = features_from_packs(packs, table.total_tokens, table.image_tokens, images)
        expected = model.pack_cost_ms(feats)
        has_image = packs.tokens(images) > 0
        got = packs.tokens(cost) + pack + np.where(has_image, image_pack, 0.0)
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_a_prior_the_records_contradict_is_set_to_zero() -> None:
    """A frozen vision tower: no vision backward, and every pack has an image, so the vision
    backward's fixed cost (``image_pack``) is ``pack`` again and the records cannot tell them
    apart. Kept at its prior (120 ms) the model predicted every backward 120 ms too slow (the
    LLM terms cannot go negative to take it back: backward MAPE 100%+); the records contradict
    that prior, so it is set to 0 and the backward is predicted as measured."""
    rng = np.random.default_rng(2)
    n = 400
    feats = _image_features(rng.integers(1, 6, n), rng.integers(64, 1800, n), rng)
    zero = {t: 0.0 for t in CostModel().coefficients["vision_bwd"]}
    truth = CostModel(coefficients={"vision_bwd": zero})  # frozen: no vision backward
    model = CostModel()  # the defaults: vision_bwd.image_pack = 120 ms
    report = model.fit(_timed(feats, truth))
    assert model.coefficients["vision_bwd"]["image_pack"] == 0.0
    assert "image_pack" in report.determined["backward_ms"]
    assert report.mape["backward_ms"] < 0.01, report


def test_a_model_file_is_loaded_from_a_path_and_bad_files_are_named(tmp_path) -> None:
    """``cost_model=Path(...)`` loads like a ``str`` (it once failed at the first calibration
    point: no ``evaluate`` on a PosixPath); a file that is not UTF-8 is a ``ValueError`` naming
    it (it was a bare ``UnicodeDecodeError``)."""
    import lightning_vlmbalance as vb

    path = tmp_path / "cost.json"
    CostModel().save(path)
    assert vb.VLMBalanceStrategy(cost_model=path).rebalancer.cost_model == CostModel()
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"coefficients": "\xe9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.json is not UTF-8"):
        CostModel.load(bad)
    with pytest.raises(TypeError, match="expected a CostModel or the path"):
        vb.VLMBalanceStrategy(cost_model=3)


def test_coefficients_far_off_are_named_not_overflowed() -> None:
    """Coefficients x1e16 passed validation and overflowed the planner's integer microseconds
    ("pack 0 has a negative cost -9223372036854775808"): named, with the largest coefficient."""
    data = CostModel().to_dict()
    for terms in data["coefficients"].values():
        for k in terms:
            terms[k] *= 1e16
    model = CostModel.from_dict(data)
    features = {f: np.array([4096]) for f in FEATURES}
    with pytest.raises(ValueError, match=r"pack 0 is predicted to take .* ms.*largest: "):
        model.pack_cost_us(features)
