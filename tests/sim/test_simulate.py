"""The what-if simulator: sanity laws, determinism, calibration, and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_vlmbalance import CostModel
from lightning_vlmbalance.sim import closed_form_waste, simulate
from lightning_vlmbalance.sim.cli import main
from lightning_vlmbalance.synthetic import LengthTable, synthetic_length_table


def _mix(n: int = 6000, seed: int = 0) -> LengthTable:
    return synthetic_length_table(n, text_share=0.3, seed=seed)


def test_identical_samples_waste_nothing() -> None:
    n = 4000
    table = LengthTable(
        total_tokens=np.full(n, 1000, dtype=np.int64),
        image_tokens=np.full(n, 600, dtype=np.int64),
        images=np.ones(n, dtype=np.int64),
    )
    rows = simulate(table, seq_len=4000, dp=[4, 16], ga=[1, 4], batches=4, modes=["off"])
    for row in rows:
        assert row["waste_frac"] == pytest.approx(0.0, abs=1e-12)
        assert row["step_ms"] == pytest.approx(row["ideal_step_ms"])


def test_off_waste_grows_with_ranks_and_shrinks_with_micro_steps() -> None:
    rows = simulate(
        _mix(), seq_len=8192, dp=[2, 8, 32, 128], ga=[1, 4, 16], batches=48, modes=["off"]
    )
    waste = {(r["dp"], r["ga"]): r["waste_frac"] for r in rows}
    for ga in (1, 4, 16):
        series = [waste[(dp, ga)] for dp in (2, 8, 32, 128)]
        assert series == sorted(series), (ga, series)
    for dp in (2, 8, 32, 128):
        series = [waste[(dp, ga)] for ga in (1, 4, 16)]
        assert series == sorted(series, reverse=True), (dp, series)


def test_rebalancing_removes_most_waste_and_is_deterministic() -> None:
    kwargs = {"seq_len": 8192, "dp": [16], "ga": [8], "batches": 6, "seed": 3}
    rows = simulate(_mix(), **kwargs)
    assert rows == simulate(_mix(), **kwargs)  # same seed, same rows
    by = {r["mode"]: r for r in rows}
    assert by["overlap"]["waste_frac"] < 0.2 * by["off"]["waste_frac"]
    assert by["overlap"]["gain"] > 0 and by["overlap"]["moved_packs"] > 0
    assert by["sync"]["exposed_exchange_ms"] > 0 and by["overlap"]["exposed_exchange_ms"] == 0
    assert by["budget"]["packing_efficiency"] < by["off"]["packing_efficiency"]
    assert 0 < by["off"]["closed_form_waste"] < 1
    other = simulate(_mix(), **{**kwargs, "seed": 4})
    assert other != rows


def test_a_streamed_mix_packs_each_ranks_shard_and_rebalances_like_the_map_style_one() -> None:
    """``stream_buffer``: each rank packs its own shard (every sample in one pack of its own
    rank's stream), the epoch's tail padding is reported, and rebalancing removes most waste
    as it does for the map-style plan."""
    kwargs = {"seq_len": 8192, "dp": [8], "ga": [8], "batches": 6, "seed": 3, "replay": True}
    rows = {r["mode"]: r for r in simulate(_mix(), modes=["off", "overlap"], **kwargs)}
    streamed = simulate(_mix(), modes=["off", "overlap"], stream_buffer=256, **kwargs)
    by = {r["mode"]: r for r in streamed}
    assert by["off"]["packing_efficiency"] > 0.98
    assert 0 <= by["off"]["stream_tail_frac"] < 0.05 and "stream_tail_frac" not in rows["off"]
    assert by["overlap"]["waste_frac"] < 0.2 * by["off"]["waste_frac"]
    assert by["overlap"]["waste_frac"] < 2 * rows["overlap"]["waste_frac"] + 0.01
    # the source formers take no stream: their rows have no tail (one raised AttributeError)
    sourced = simulate(_mix(), modes=["source", "encoder_source"], stream_buffer=256, **kwargs)
    assert all("stream_tail_frac" not in r for r in sourced)


def test_closed_form_laws() -> None:
    assert closed_form_waste(10.0, 3.0, 1, 8, "step") == 0.0
    w = [closed_form_waste(10.0, 3.0, dp, 4, "step") for dp in (2, 16, 1024)]
    assert w == sorted(w)
    assert closed_form_waste(10.0, 3.0, 64, 16, "step") < closed_form_waste(
        10.0, 3.0, 64, 1, "step"
    )
    # a barrier every micro-step takes away the averaging over micro-steps
    assert closed_form_waste(10.0, 3.0, 64, 16, "microstep") > closed_form_waste(
        10.0, 3.0, 64, 16, "step"
    )


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="modes"):
        simulate(_mix(500), seq_len=8192, modes=["fast"])
    with pytest.raises(ValueError, match="sync_every"):
        simulate(_mix(500), seq_len=8192, sync_every="never")


def _write_csv(path, table: LengthTable) -> None:
    rows = np.stack([table.total_tokens, table.image_tokens, table.images], axis=1)
    np.savetxt(
        path, rows, fmt="%d", delimiter=",", header="total_tokens,image_tokens,images", comments=""
    )


def test_cli_run_json_and_plot(tmp_path, capsys) -> None:
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(3000))
    png = tmp_path / "sim.png"
    args = f"run --data {csv} --text-share 0.3 --dp 4,16 --ga 1,4 --batches 3 --plot {png} --json"
    assert main(args.split()) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 2 * 4
    for key in ("mode", "dp", "ga", "step_ms", "ideal_step_ms", "waste_frac", "gain"):
        assert key in rows[0]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["run", "--data", str(tmp_path / "none.csv"), "--no-plot"]) == 2


def test_strategies_is_a_deprecated_name_of_modes() -> None:
    """``strategies=`` (the old name) gives the rows of ``modes=`` with a FutureWarning naming
    ``modes=``; both at once is a TypeError naming both; the old constants still import."""
    kwargs = {"seq_len": 8192, "dp": [4], "ga": [2], "batches": 2}
    table = _mix(2000)
    new = simulate(table, modes=["off", "overlap"], **kwargs)
    assert [r["mode"] for r in new] == ["off", "overlap"] and "strategy" not in new[0]
    with pytest.warns(FutureWarning, match="modes="):
        old = simulate(table, strategies=["off", "overlap"], **kwargs)
    assert old == new
    with pytest.raises(TypeError, match=r"strategies=.*modes="):
        simulate(table, modes=["off"], strategies=["off"], **kwargs)
    with pytest.warns(FutureWarning, match="modes="):  # modes=None is its default: not given
        assert simulate(table, modes=None, strategies=["off", "overlap"], **kwargs) == new
    import importlib

    import lightning_vlmbalance.sim as sim

    # the module (the package's attribute `simulate` is the function)
    core = importlib.import_module("lightning_vlmbalance.sim.simulate")
    with pytest.warns(FutureWarning, match="MODES"):
        assert sim.STRATEGIES == sim.MODES == core.MODES
    with pytest.warns(FutureWarning, match="ALL_MODES"):
        assert core.ALL_STRATEGIES == core.ALL_MODES


def test_cli_strategies_is_a_deprecated_alias_of_modes(tmp_path, capsys) -> None:
    """``--modes`` picks the modes; ``--strategies`` (the old name) gives the same rows with a
    one-line note on stderr; the table's first column is ``mode``."""
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(2000))
    base = ["run", "--data", str(csv), "--dp", "4", "--ga", "2", "--batches", "2", "--no-plot"]
    assert main([*base, "--modes", "off,overlap", "--json"]) == 0
    out, err = capsys.readouterr()
    new = json.loads(out)
    assert [r["mode"] for r in new] == ["off", "overlap"] and "deprecated" not in err
    assert main([*base, "--strategies", "off,overlap", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == new
    assert "--strategies is deprecated, use --modes" in err
    assert main([*base, "--modes", "off", "--no-progress"]) == 0
    assert capsys.readouterr().out.split()[0] == "mode"
    with pytest.raises(SystemExit):  # both: refused (the last one once won silently)
        main([*base, "--modes", "off", "--strategies", "overlap"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_training_strategy_sets_the_synchronisation(tmp_path, capsys) -> None:
    """fsdp_vlmbalance meets at every micro-batch, vlmbalance once per step: the same off run
    wastes more under FSDP at ga > 1; a contradicting --sync-every is an error."""
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(3000))
    base = f"run --data {csv} --dp 8 --ga 4 --batches 4 --modes off --no-plot --json"
    waste = {}
    for strategy in ("vlmbalance", "fsdp_vlmbalance"):
        assert main([*base.split(), "--training-strategy", strategy]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        waste[strategy] = row["waste_frac"]
    assert waste["fsdp_vlmbalance"] > waste["vlmbalance"]
    args = [*base.split(), "--training-strategy", "fsdp_vlmbalance", "--sync-every", "step"]
    assert main(args) == 2
    assert "synchronises every microstep" in capsys.readouterr().err


def test_cli_sync_every_alone_overrides_the_default(tmp_path, capsys) -> None:
    """``--sync-every`` without ``--training-strategy`` sets the synchronisation (the help says it
    overrides): ``microstep`` gives the same rows as ``--training-strategy fsdp_vlmbalance``, and
    ``step`` those of the default; only an explicit contradiction is an error."""
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(3000))
    base = f"run --data {csv} --dp 8 --ga 4 --batches 4 --modes off --no-plot --json".split()

    def rows(*flags: str) -> list:
        assert main([*base, *flags]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    assert rows("--sync-every", "microstep") == rows("--training-strategy", "fsdp_vlmbalance")
    assert rows("--sync-every", "step") == rows()
    assert rows("--sync-every", "microstep") != rows()
    assert rows("--training-strategy", "ddp", "--sync-every", "microstep") == rows(
        "--sync-every", "microstep"
    )
    assert main([*base, "--training-strategy", "vlmbalance", "--sync-every", "microstep"]) == 2
    assert "`--training-strategy vlmbalance` synchronises every step" in capsys.readouterr().err


def test_source_balancing_removes_most_of_the_waste_at_one_pack_per_rank() -> None:
    """At ga 1 no pack can move (overlap = off); balancing at the source forms even packs."""
    # 12 batches: source re-forms the samples of off's batches, and its last global batch is
    # partly empty padding, which weighs less in its packing efficiency the more batches run
    rows = simulate(
        _mix(8000),
        seq_len=8192,
        dp=[8],
        ga=[1],
        batches=12,
        modes=["off", "overlap", "source"],
    )
    by = {r["mode"]: r for r in rows}
    assert by["overlap"]["waste_frac"] == pytest.approx(by["off"]["waste_frac"])
    assert by["source"]["waste_frac"] < 0.5 * by["off"]["waste_frac"]
    assert by["source"]["moved_packs"] == 0 and by["source"]["packing_efficiency"] > 0.97
    assert by["source"]["gain"] > 0


def test_cli_calibrate_recovers_known_coefficients(tmp_path, capsys) -> None:
    """Timings generated from a known model (2% noise), written as StragglerMonitor JSON lines,
    come back as that model."""
    truth = CostModel()
    for phase in truth.coefficients:
        for term in truth.coefficients[phase]:
            truth.coefficients[phase][term] *= 1.7
    rng = np.random.default_rng(0)
    n = 400
    feats = {
        "total_tokens": rng.integers(2000, 8192, n),
        "image_tokens": rng.integers(0, 6000, n),
        "images": rng.integers(0, 8, n),
    }
    feats["images"] = np.where(feats["image_tokens"] > 0, np.maximum(feats["images"], 1), 0)
    feats["image_sq_tokens"] = feats["image_tokens"] ** 2 // np.maximum(feats["images"], 1)
    feats["doc_sq_tokens"] = feats["total_tokens"] * rng.integers(500, 4000, n)
    ms = truth.predict(feats)
    noise = lambda: rng.normal(1.0, 0.02, n)  # noqa: E731
    micro = [
        {
            **{k: int(v[i]) for k, v in feats.items()},
            "vision_fwd_ms": float(ms["vision_fwd"][i] * noise()[i]),
            "llm_fwd_ms": float(ms["llm_fwd"][i] * noise()[i]),
            "backward_ms": float((ms["vision_bwd"][i] + ms["llm_bwd"][i]) * noise()[i]),
        }
        for i in range(n)
    ]
    timings = tmp_path / "rank_0.jsonl"
    timings.write_text(
        "\n".join(json.dumps({"v": 1, "micro": micro[i : i + 4]}) for i in range(0, n, 4))
    )
    out = tmp_path / "cost.json"
    assert main(["calibrate", str(timings), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    fitted = CostModel.load(out)
    got = fitted.pack_cost_ms(feats)
    want = truth.pack_cost_ms(feats)
    assert np.max(np.abs(got / want - 1.0)) < 0.05


def test_step_overhead_fit_recovers_base_and_slope() -> None:
    from lightning_vlmbalance.sim import StepOverhead

    steps = []
    for world in (2, 4, 8):
        for k in range(5):
            busy = [10.0 + r + k for r in range(world)]
            overhead = 1.5 + 4.0 * np.log2(world)
            for r in range(world):
                micro = [{"vision_fwd_ms": busy[r], "llm_fwd_ms": 0.0, "backward_ms": 0.0}]
                steps.append(
                    {
                        "run": f"w{world}",
                        "world_size": world,
                        "global_step": k,
                        "step_ms": max(busy) + overhead,
                        "micro": micro,
                    }
                )
    fit = StepOverhead.fit(steps)
    assert fit.base_ms == pytest.approx(1.5) and fit.per_log2_rank_ms == pytest.approx(4.0)
    assert fit(8) == pytest.approx(13.5)
    with pytest.raises(ValueError, match="two world sizes"):
        StepOverhead.fit([s for s in steps if s["world_size"] == 2])


@pytest.mark.parametrize("replay", [False, True])
def test_source_is_measured_on_the_samples_of_off(replay) -> None:
    """``source`` forms its global batches from exactly the samples of ``off``'s (as ``sync``
    and ``overlap`` move them), so its gain is balance alone, not a luckier draw: every
    same-sample row processes the tokens of ``off``, and says so."""
    table = _mix(8000)
    for dp, ga in ((8, 1), (4, 4)):
        rows = simulate(
            table,
            seq_len=8192,
            dp=[dp],
            ga=[ga],
            batches=6,
            replay=replay,
            modes=["off", "overlap", "source", "budget"],
        )
        by = {r["mode"]: r for r in rows}
        for mode in ("off", "overlap", "source"):
            assert by[mode]["samples"] == "off", mode
            assert by[mode]["tokens"] == by["off"]["tokens"], (mode, dp, ga)
        assert by["budget"]["samples"] == "own"
        # the gain is the whole run's tokens/s over off's, on the same tokens
        ratio = by["off"]["step_ms"] * by["off"]["batches"]
        ratio /= by["source"]["step_ms"] * by["source"]["batches"]
        assert by["source"]["gain"] == pytest.approx(ratio - 1.0)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--bandwidth-gb-s", "0"),
        ("--bandwidth-gb-s", "-5"),
        ("--bandwidth-gb-s", "nan"),
        ("--seed", "-1"),
        ("--batches", "0"),
        ("--seq-len", "0"),
        ("--text-share", "1.5"),
    ],
)
def test_cli_bad_flag_values_name_the_flag(tmp_path, capsys, flag, value) -> None:
    """A bad value is refused before any work, by the flag's name (no ZeroDivisionError, no
    negative waste, no numpy message)."""
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(500))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--data", str(csv), "--no-plot", "--json", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_exchange_model_refuses_bad_settings() -> None:
    from lightning_vlmbalance.sim import ExchangeModel

    for kwargs in ({"bandwidth_gb_s": 0.0}, {"bandwidth_gb_s": -1.0}, {"latency_ms": -0.1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ExchangeModel(**kwargs)


def test_cli_bad_plot_path_fails_before_the_sweep(tmp_path, capsys) -> None:
    """A plot that cannot be written is an error before simulating (no work is lost: no
    progress bar ran, no table was printed); with a good path the table comes first."""
    csv = tmp_path / "mix.csv"
    _write_csv(csv, _mix(500))
    base = ["run", "--data", str(csv), "--dp", "4", "--ga", "1", "--batches", "2"]
    for bad in (tmp_path / "missing" / "sim.png", tmp_path / "sim.nosuchformat"):
        assert main([*base, "--plot", str(bad)]) == 2
        out, err = capsys.readouterr()
        assert "--plot" in err and str(bad) in err
        assert out == "" and "simulating" not in err
    good = tmp_path / "sim.png"
    assert main([*base, "--plot", str(good), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mode") and out.rstrip().endswith(f"plot: {good}")
    assert good.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("10,2,1\n7,3\n", r"mix\.csv:3: column 'images' is missing"),
        ("10,2,1\n7,x,1\n", r"mix\.csv:3: column 'image_tokens' is 'x', not an integer"),
        ("10,2,1\n7,3,0\n", r"mix\.csv:3: .*3 image tokens but 0 images"),
        ("10,2,1\n7,0,2\n", r"mix\.csv:3: .*0 image tokens but 2 images"),
        ("10,12,1\n", r"mix\.csv:2: .*image_tokens 12 .* total_tokens 10"),
        ("-1,0,0\n", r"mix\.csv:2: column 'total_tokens' is -1"),
    ],
)
def test_read_length_csv_names_file_line_and_column(tmp_path, body, match) -> None:
    from lightning_vlmbalance.synthetic import read_length_csv

    csv = tmp_path / "mix.csv"
    csv.write_text("total_tokens,image_tokens,images\n" + body)
    with pytest.raises(ValueError, match=match):
        read_length_csv(csv)


def test_simulate_refuses_image_tokens_without_images() -> None:
    table = _mix(500)
    images = table.images.copy()
    i = int(np.flatnonzero(table.image_tokens > 0)[3])
    images[i] = 0
    bad = LengthTable(table.total_tokens, table.image_tokens, images)
    with pytest.raises(ValueError, match=f"sample {i} has 0 images"):
        simulate(bad, seq_len=8192, dp=[2], ga=[1], batches=1, modes=["off"])


def test_step_overhead_fit_names_a_bad_record() -> None:
    from lightning_vlmbalance.sim import StepOverhead

    good = {"run": "a", "world_size": 2, "global_step": 0, "step_ms": 5.0}
    micro = {"vision_fwd_ms": 1.0, "llm_fwd_ms": 1.0, "backward_ms": 1.0}
    for bad, match in (
        ({**good, "micro": {"vision_fwd_ms": 1.0}}, 'record 1: "micro" must be a list'),
        ({**good, "micro": [1.0]}, 'record 1: "micro" must be a list'),
        ({**good, "micro": [{"vision_fwd_ms": 1.0}]}, "record 1: micro\\[0\\] has no 'llm_fwd_ms'"),
        ({k: v for k, v in good.items() if k != "step_ms"} | {"micro": [micro]}, "'step_ms'"),
    ):
        with pytest.raises(ValueError, match=match):
            StepOverhead.fit([{**good, "micro": [micro]}, bad])


def test_encoder_balancing_spreads_the_images_of_each_micro_step() -> None:
    """At one pack per rank nothing can move, yet the images can: ``encoder`` removes most of
    ``off``'s waste on the same packs (the same packing efficiency); ``encoder_overlap`` at 8
    micro-steps re-orders packs within ranks (none moves) and wastes no more than ``encoder``;
    every returned embedding and moved pixel is costed."""
    table = _mix(8000)
    modes = ["off", "encoder", "encoder_overlap", "encoder_source"]
    rows = simulate(table, seq_len=8192, dp=[16], ga=[1, 8], batches=6, modes=modes)
    by = {(r["mode"], r["ga"]): r for r in rows}
    off, enc = by[("off", 1)], by[("encoder", 1)]
    assert enc["waste_frac"] < 0.3 * off["waste_frac"] and enc["gain"] > 0
    assert enc["packing_efficiency"] == off["packing_efficiency"]
    assert enc["moved_images"] > 0 and enc["moved_packs"] == 0
    assert by[("encoder_overlap", 8)]["moved_packs"] == 0
    assert by[("encoder_overlap", 8)]["waste_frac"] <= by[("encoder", 8)]["waste_frac"] + 1e-9
    assert by[("encoder_source", 1)]["moved_images"] >= 0
    # on the source-balanced packs: none moves, and the waste is below off's
    assert by[("encoder_source", 1)]["moved_packs"] == 0
    assert by[("encoder_source", 1)]["waste_frac"] < off["waste_frac"]
    # the returns cost time: with a slow network encoder balancing gains less
    from lightning_vlmbalance.sim import ExchangeModel

    slow = simulate(
        table,
        seq_len=8192,
        dp=[16],
        ga=[1],
        batches=6,
        modes=["off", "encoder"],
        exchange=ExchangeModel(bandwidth_gb_s=0.05),
    )
    assert {r["mode"]: r for r in slow}["encoder"]["step_ms"] > enc["step_ms"]


def test_exchange_model_transfer_time_is_the_busiest_ranks() -> None:
    from lightning_vlmbalance.sim import ExchangeModel

    model = ExchangeModel(bandwidth_gb_s=1.0, latency_ms=0.5)
    src, dst = np.array([0, 0, 1]), np.array([1, 2, 2])
    nbytes = np.array([1e6, 1e6, 3e6])  # rank 2 receives 4 MB: 4 ms, and 2 messages
    assert model.transfer_ms(src, dst, nbytes, 3) == pytest.approx(4.0 + 2 * 0.5)
    assert model.transfer_ms(src[:0], dst[:0], nbytes[:0], 3) == 0.0


@pytest.mark.parametrize("sync_every", ["step", "microstep"])
def test_auto_is_at_least_as_fast_as_every_fixed_mode_on_the_same_samples(sync_every) -> None:
    """``auto`` prices each global batch's options with the functions every mode is priced by
    and forms the epoch at the source when that is faster: on the same samples it is never
    slower than the best fixed mode (``budget`` draws other samples), at 1 and 4 micro-steps;
    its row says which options it took."""
    modes = ["off", "overlap", "source", "encoder", "encoder_overlap", "encoder_source", "auto"]
    rows = simulate(
        _mix(8000),
        seq_len=8192,
        dp=[16],
        ga=[1, 4],
        batches=6,
        modes=modes,
        sync_every=sync_every,
    )
    for G in (1, 4):
        by = {r["mode"]: r for r in rows if r["ga"] == G}
        auto = by.pop("auto")
        best = max(r["tokens_per_s_per_rank"] for r in by.values())
        assert auto["tokens_per_s_per_rank"] >= best * (1 - 1e-9), (G, auto, best)
        assert sum(auto["choices"].values()) == auto["batches"]
        assert set(auto["choices"]) <= {"placed", "packs", "images", "both"}
        if auto["formed_at_source"]:
            assert auto["packing_efficiency"] == by["source"]["packing_efficiency"]
