"""The main job: one invocation trains off, overlap, source and encoder on 2 CPU processes
(gloo), each mode twice in ABBA order, prints one line per run, the comparison with its spread and
a figure, and writes TensorBoard logs that we read back. No timing is asserted: only the
comparison's structure, how its figures are derived, what each run trained, and the shape of what
the job prints (quiet by default: none of Lightning's banners, no third-party deprecation
warnings)."""

from __future__ import annotations

import json
import logging
import re
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import lightning_vlmbalance as vb
from examples.train import (
    LIGHTNING_LOGGERS,
    QUIET_WARNINGS,
    ReadAheadLoader,
    _pct,
    compare,
    headline,
    quiet_lightning,
    run_line,
    schedule,
)
from lightning_vlmbalance.balance.epoch_choice import PLANS
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table
from tests.launch import run_module

SMALL = ("--num-samples", "400", "--seq-len", "256", "--vision-dim", "64", "--vision-layers", "1")


# what Lightning prints at every Trainer unless told otherwise, on stdout or stderr
BANNERS = (
    "GPU available",
    "TPU available",
    "💡 Tip",
    "LOCAL_RANK",
    "Initializing distributed",
    "distributed_backend=",
    "`Trainer.fit` stopped",
    "Trainable params",  # a model summary
)


class MainJob(NamedTuple):
    summary: dict
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> MainJob:
    """The job as a reader runs it: default output (no progress-bar flag), a small config."""
    root = tmp_path_factory.mktemp("main_job")
    proc = run_module("examples.train", "--root", str(root), *SMALL, timeout=600)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    return MainJob(json.loads(line.removeprefix("SUMMARY_JSON ")), proc.stdout, proc.stderr)


def _scalars(log_dir: str) -> EventAccumulator:
    events = list(Path(log_dir).glob("events.out.tfevents.*"))
    assert events, log_dir
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return acc


def _run(seconds: float, step_s: list[float], tokens: int = 1000, **extra) -> dict:
    return {"seconds": seconds, "tokens": tokens, "optimizer_steps": 10, "step_s": step_s, **extra}


def test_the_read_ahead_loader_yields_the_packs_of_the_plain_loader_read_in_a_thread() -> None:
    """Every mode reads ahead the same way: the same packs, in the same order, as the plain
    loader, each but the first read by the read-ahead thread; a pass stopped early joins it."""
    table = synthetic_length_table(120, tile_tokens=16, max_text_tokens=128, seed=0)
    dataset = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8, seed=0)

    def loader(cls, **kwargs):
        sampler = vb.PackingSampler(
            table.total_tokens, table.image_tokens, seq_len=256, num_replicas=1, rank=0
        )
        return cls(dataset, sampler, vb.PackCollator(256, image_feature_shape=(8,)), **kwargs)

    plain = [b["meta"]["sample_ids"] for b in loader(vb.PackedDataLoader)]
    readers: list[str] = []

    class Recording(vb.PackCollator):
        def __call__(self, items):
            readers.append(threading.current_thread().name)
            return super().__call__(items)

    sampler = vb.PackingSampler(
        table.total_tokens, table.image_tokens, seq_len=256, num_replicas=1, rank=0
    )
    ahead = ReadAheadLoader(dataset, sampler, Recording(256, image_feature_shape=(8,)))
    assert [b["meta"]["sample_ids"] for b in ahead] == plain and len(plain) > 3
    assert readers[0] == threading.main_thread().name
    assert set(readers[1:]) == {"main-job-read-ahead"}
    readers.clear()  # what a "vlmbalance" strategy's rebalancing reads: the same, read ahead
    steps = list(ahead.global_batches(2))  # optimizer steps of 2 packs, unweighed
    assert [[len(packs), lead] for packs, _, lead in steps][:2] == [[2, 0], [2, 0]]
    assert [b["meta"]["sample_ids"] for packs, _, _ in steps for b in packs] == plain
    assert readers[:2] == [threading.main_thread().name] * 2  # the first step, in the caller's
    assert set(readers[2:]) == {"main-job-read-ahead"}
    for k, _ in enumerate(ahead):  # stopped early: the thread is joined, none is left behind
        if k == 1:
            break
    assert not [t for t in threading.enumerate() if t.name == "main-job-read-ahead"]
    inline = loader(ReadAheadLoader, read_ahead=0)
    assert [b["meta"]["sample_ids"] for b in inline] == plain


def test_the_modes_run_in_abba_order() -> None:
    """Each mode runs once per round, forward in even rounds and backward in odd ones, so a load
    that drifts linearly over the job weighs on every mode alike; off runs first."""
    modes = ["off", "overlap", "source"]
    order = schedule(modes, 2)
    assert [m for _, m in order] == ["off", "overlap", "source", "source", "overlap", "off"]
    assert [k for k, _ in order] == [0, 0, 0, 1, 1, 1]
    assert [m for _, m in schedule(modes, 3)][6:] == modes
    assert schedule(["off"], 1) == [(0, "off")]


def test_the_headline_gain_is_whole_run_tokens_per_s_over_every_round() -> None:
    """The gain is tokens over seconds of whole runs summed over the rounds, not one over the
    median step: a mode whose median step is short but whose run is long (skewed step times,
    a slow start) gains nothing; the per-round gains pair each round with that round's off."""
    runs = {
        # off: 10 s and 12 s for the same 1,000 tokens; steady 1 s steps
        "off": [_run(10.0, [1.0] * 9), _run(12.0, [1.0] * 9)],
        # overlap: most steps short (median 0.5 s) but a long tail: 11 s and 13 s
        "overlap": [_run(11.0, [0.5] * 6 + [3.0] * 3), _run(13.0, [0.5] * 6 + [3.0] * 3)],
        # source: median 0.9 s and 8 s / 12 s runs
        "source": [_run(8.0, [0.9] * 9), _run(12.0, [0.9] * 9)],
    }
    modes = compare(runs)
    assert modes["off"]["tokens_per_s"] == round(2000 / 22, 1)
    assert modes["overlap"]["tokens_per_s"] == round(2000 / 24, 1)
    assert modes["overlap"]["gain_vs_off"] == round((2000 / 24) / (2000 / 22) - 1, 4) < 0
    assert modes["overlap"]["median_gain_vs_off"] == 1.0  # what the old headline said: +100%
    assert modes["source"]["gain_vs_off"] == round(22 / 20 - 1, 4)
    assert modes["source"]["gain_by_round"] == [round(10 / 8 - 1, 4), 0.0]
    assert modes["source"]["gain_spread"] == [0.0, round(10 / 8 - 1, 4)]
    assert [r["gain_vs_off"] for r in modes["overlap"]["by_round"]] == [
        round(10 / 11 - 1, 4),
        round(12 / 13 - 1, 4),
    ]
    assert modes["off"]["gain_vs_off"] == 0.0 and modes["off"]["rounds"] == 2
    assert modes["off"]["seconds"] == 22.0 and modes["off"]["tokens"] == 2000
    # without an off run there is nothing to compare with
    alone = compare({"ddp": [_run(10.0, [1.0])]})
    assert alone["ddp"]["gain_vs_off"] is None and alone["ddp"]["gain_spread"] is None


def test_the_main_job_compares_the_modes_on_the_same_samples(main_job) -> None:
    summary, stdout, _ = main_job
    modes = summary["modes"]
    assert list(modes) == ["off", "overlap", "source", "encoder", "auto"]
    assert summary["ranks"] == 2 and summary["rounds"] == 2
    forward = ["off", "overlap", "source", "encoder", "auto"]
    assert summary["order"] == forward + forward[::-1]
    assert summary["read_ahead"] == 2  # every mode reads 2 packs ahead in a thread per rank
    # every run trains every sample once; off and overlap the same global batch at every step
    assert summary["same_samples"] and summary["same_global_batches"]
    for s in modes.values():
        assert s["optimizer_steps"] > 5 and s["steps_per_s"] > 0 and s["tokens_per_s"] > 0
        assert 0 <= s["waste_frac"] < 1 and 0 <= s["planned_waste"] < 1
        assert s["packing_efficiency"] > 0.9 and s["mean_loss"] > 0
        assert Path(s["log_dir"]).parent == Path(summary["log_dir"])
        assert s["rounds"] == len(s["by_round"]) == len(s["gain_by_round"]) == 2
        # the headline is whole-run tokens/s over both rounds, the same tokens in every mode
        assert s["tokens"] == modes["off"]["tokens"] > 0
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"], rel=1e-3)
        gain = s["tokens_per_s"] / modes["off"]["tokens_per_s"] - 1
        assert s["gain_vs_off"] == pytest.approx(gain, abs=2e-3)
        assert s["gain_spread"] == [min(s["gain_by_round"]), max(s["gain_by_round"])]
    assert modes["off"]["gain_vs_off"] == 0.0 and modes["off"]["moved_packs"] == 0
    # packs moved in each run (the loader's count over every global batch, not TensorBoard's
    # samples of it: a logged step may be one whose batch needed no move)
    overlap = modes["overlap"]
    assert overlap["moved_packs"] == overlap["by_round"][0]["moved_packs"]
    assert sum(r["moved_packs"] for r in overlap["by_round"]) > 0
    assert (overlap["bytes_exchanged"] > 0) == (overlap["moved_packs"] > 0)
    assert modes["source"]["source_balanced"] and modes["source"]["moved_packs"] == 0
    assert modes["source"]["bytes_exchanged"] == 0
    # encoder balancing: no pack changes rank, images are encoded on other ranks
    encoder = modes["encoder"]
    assert encoder["moved_packs"] == 0
    assert sum(r["moved_images"] for r in encoder["by_round"]) > 0
    assert all(m["moved_images"] == 0 for k, m in modes.items() if k not in ("encoder", "auto"))
    # auto: every global batch had a choice and a predicted step, printed against the measured
    auto = modes["auto"]
    assert sum(auto["choices"].values()) > 0 and set(auto["choices"]) <= {
        "placed",
        "packs",
        "images",
        "both",
    }
    assert auto["predicted_step_ms_median"] > 0
    # ... and per epoch whether to form it at the source (the plain plan or a formed one)
    assert auto["epochs_taken"] and set(auto["epochs_taken"]) <= set(PLANS)
    line = r"^auto formed \d+ of \d+ epochs at the source \(.*\) and took \{.*\} \(first round\);"
    assert re.search(line + " its predicted step", stdout, re.M)
    # "best" is chosen on the headline figure
    best = max(("overlap", "source", "encoder", "auto"), key=lambda m: modes[m]["tokens_per_s"])
    assert summary["best_mode"] == best and summary["gain_vs_off"] == modes[best]["gain_vs_off"]
    assert summary["gain_spread"] == modes[best]["gain_spread"]
    # no offline fit: every mode starts from the default model and calibrates itself online
    # (refits every 5 steps); the defaults describe a large GPU model, off by far more than
    # the 5% a refit must gain, so every mode adopts refits, and prints the model it ended with
    assert "cost_model_fit" not in summary
    assert "Each mode's final cost model" in stdout
    for mode, s in modes.items():
        calibration = s["calibration"]
        assert calibration["adopted_at_steps"], mode
        assert calibration["adopted_at_steps"][0] % 5 == 0
        first_current, first_candidate = calibration["held_out_error"][0]
        assert first_candidate < 0.95 * first_current
        assert s["final_model"]["coefficients"] != vb.CostModel().to_dict()["coefficients"]
        assert re.search(rf"^  {mode}: vision fwd .* \(refits adopted at steps ", stdout, re.M)
    for mode in modes:
        assert re.search(rf"^\| {mode} \| \d+ \| ", stdout, re.M), mode
    assert f"\nBest: {best}, " in stdout
    figure = Path(summary["figure"])
    assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Figure (busy and vision time per rank, per mode): {figure}" in stdout


def test_every_mode_logs_to_tensorboard(main_job) -> None:
    summary, _, _ = main_job
    for mode, s in summary["modes"].items():
        assert [Path(r["log_dir"]).name for r in s["by_round"]] == [mode, f"{mode}_1"]
        for r in s["by_round"]:
            acc = _scalars(r["log_dir"])
            tags = set(acc.Tags()["scalars"])
            assert {"train/loss", "packing/efficiency"} <= tags
            assert {f"straggler/step_ms/rank_{k}" for k in (0, 1)} <= tags
            if mode == "overlap":  # logged every 5 steps for the global batch just planned
                moved = [e.value for e in acc.Scalars("balance/moved_packs")]
                assert moved and all(v >= 0 and v == int(v) for v in moved)
            if mode == "source":
                assert "balance/source_balanced" in tags
            if mode == "encoder":  # its metrics, and the returns' phase per rank
                assert {"balance/encoder_moved_images", "balance/encoder_bytes"} <= tags
                assert {f"straggler/encoder_return_ms/rank_{k}" for k in (0, 1)} <= tags
                # timed: the strategy's return channel carries the monitor's timer
                returns = [
                    e.value
                    for k in (0, 1)
                    for e in acc.Scalars(f"straggler/encoder_return_ms/rank_{k}")
                ]
                assert max(returns) > 0
    acc = _scalars(summary["modes"]["off"]["log_dir"])
    loss = [e.value for e in acc.Scalars("train/loss")]
    assert len(loss) >= 3 and loss[-1] < loss[0]  # it learns
    # the monitor's custom-scalars layout has its "rebalancing" category, every chart matching
    # (auto logs every balance/* metric, and its predicted step next to the measured ones)
    acc = _scalars(summary["modes"]["auto"]["log_dir"])
    tags = acc.Tags()["scalars"]
    assert {"balance/choice", "balance/predicted_step_ms"} <= set(tags)
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(config)
    (category,) = [c for c in layout.category if c.title == "rebalancing"]
    for chart in category.chart:
        for regex in chart.multiline.tag:
            assert any(re.fullmatch(regex, t) for t in tags), regex


def _summary(mode: str, seconds: float, tokens: int = 1000, **extra) -> dict:
    """A run's summary as ``RunSummary`` writes it (the keys ``run_line`` reads)."""
    return {
        "mode": mode,
        "seconds": seconds,
        "tokens": tokens,
        "optimizer_steps": 10,
        "tokens_per_s": round(tokens / seconds, 1),
        "steps_per_s_median": 2.0,
        "waste_frac": 0.125,
        "moved_packs": 0,
        "moved_images": 0,
        **extra,
    }


def test_each_run_prints_one_line_with_the_gain_over_its_rounds_off() -> None:
    """As each run ends: one line, and its gain over the same round's off (the pairing of the
    headline's per-round gains); in a backward round off runs last, and its line gives them."""
    modes = ["off", "overlap", "source"]
    order = schedule(modes, 2)
    seconds = {(0, "off"): 10.0, (0, "overlap"): 8.0, (0, "source"): 12.5}
    seconds |= {(1, "source"): 9.0, (1, "overlap"): 11.0, (1, "off"): 10.0}
    rounds: dict[int, dict] = {}
    lines = []
    for n, (k, mode) in enumerate(order, 1):
        s = _summary(mode, seconds[k, mode], moved_packs=3 if mode == "overlap" else 0)
        rounds.setdefault(k, {})[mode] = s
        lines.append(run_line(s, k, n, len(order), rounds[k]))
    assert [line.split(":")[0] for line in lines] == [f"run {n}/6" for n in range(1, 7)]
    assert lines[0].startswith("run 1/6: off      round 0       100 tokens/s     10.0 s")
    assert "median step   500 ms  waiting 12.5%  moved 0 packs, 0 images" in lines[0]
    assert "|" not in lines[0]  # the first off: nothing to compare with yet
    assert lines[1].endswith("moved 3 packs, 0 images  | +25.0% vs round 0's off")
    assert lines[2].endswith("| -20.0% vs round 0's off")
    # round 1 runs backward: off comes last, and its line carries the round's gains
    assert lines[3].endswith("| vs off: on round 1's off line (it runs last)")
    assert lines[4].endswith("| vs off: on round 1's off line (it runs last)")
    assert lines[5].endswith("| round 1 vs this off: source +11.1%, overlap -9.1%")
    # the same figures as the comparison's per-round gains
    gains = compare({m: [rounds[0][m], rounds[1][m]] for m in modes})
    assert gains["source"]["gain_by_round"] == [-0.2, 0.1111]
    assert gains["overlap"]["gain_by_round"] == [0.25, -0.0909]
    # one mode alone (no off): no gain column
    assert "|" not in run_line(_summary("source", 9.0), 0, 1, 1, {}, with_off=False)


def test_the_headline_carries_every_rounds_gain_and_their_median() -> None:
    """The headline is not one figure alone: each round's gain, their median, and whether the
    rounds agree in sign."""
    runs = {
        "off": [_run(10.0, [1.0]), _run(10.0, [1.0])],
        "source": [_run(10.0 / 1.394, [1.0]), _run(10.0 / 0.998, [1.0])],
    }
    modes = compare(runs)
    s = modes["source"]
    assert s["gain_by_round"] == [0.394, -0.002] and s["gain_median_over_rounds"] == 0.196
    summary = {
        "best_mode": "source",
        "gain_vs_off": s["gain_vs_off"],
        "gain_by_round": s["gain_by_round"],
        "gain_median_over_rounds": s["gain_median_over_rounds"],
    }
    assert headline(summary) == (
        f"Best: source, {_pct(s['gain_vs_off'])} tokens/s over off (whole runs; rounds: +39.4%,"
        " -0.2%; median +19.6%; the rounds disagree: not a stable gain)"
    )
    steady = {**summary, "gain_by_round": [0.1, 0.2, 0.15], "gain_median_over_rounds": 0.15}
    assert headline(steady).endswith(
        "rounds: +10.0%, +20.0%, +15.0%; median +15.0%; a gain in every round)"
    )
    losing = {**summary, "gain_by_round": [-0.1, 0.0], "gain_median_over_rounds": -0.05}
    assert headline(losing).endswith("; no round gains)")
    one = {**summary, "gain_by_round": [0.1], "gain_median_over_rounds": 0.1}
    assert headline(one).endswith("rounds: +10.0%; median +10.0%; one round: no spread)")
    assert modes["off"]["gain_median_over_rounds"] == 0.0
    assert compare({"ddp": [_run(10.0, [1.0])]})["ddp"]["gain_median_over_rounds"] is None


def test_the_job_filters_only_the_known_third_party_warnings() -> None:
    """``quiet_lightning`` drops the warnings Lightning's code draws from torch (and Lightning's
    note about the example's hook) by message, category and module: the same message from
    another module, another warning from those modules, and the package's own warnings show."""
    # the messages as torch and Lightning word them, from the modules they are attributed to
    known = [
        (
            "torch.distributed.nn.functional.all_gather is deprecated, use"
            " torch.distributed._functional_collectives.all_gather_single instead.",
            FutureWarning,
            "lightning.fabric.utilities.distributed",
        ),
        (
            "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)"
            " and treespec.is_leaf()` instead.",
            FutureWarning,
            "lightning.pytorch.utilities._pytree",
        ),
        (
            "You have overridden `on_after_batch_transfer` in `LightningModule` but have passed"
            " in a `LightningDataModule`. It will use the implementation from `LightningModule`"
            " instance.",
            UserWarning,
            "lightning.pytorch.trainer.connectors.data_connector",
        ),
    ]
    assert len(known) == len(QUIET_WARNINGS)
    shown = [
        (message, category, "lightning_vlmbalance.loaders.rebalancing")
        for message, category, _ in known
    ] + [
        ("a rank's plan is late", UserWarning, "lightning_vlmbalance.loaders.rebalancing"),
        ("something else is deprecated", FutureWarning, "lightning.fabric.utilities.distributed"),
        (known[0][0], DeprecationWarning, "lightning.fabric.utilities.distributed"),
    ]
    levels = {name: logging.getLogger(name).level for name in LIGHTNING_LOGGERS}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_lightning()
            for message, category, module in known + shown:
                warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
            assert all(
                logging.getLogger(name).getEffectiveLevel() == logging.WARNING
                for name in LIGHTNING_LOGGERS
            )
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    assert [(str(w.message), w.category) for w in caught] == [(m, c) for m, c, _ in shown]


def test_the_main_job_prints_one_line_per_run_and_no_banners(main_job) -> None:
    """What the default job prints: one line per mode and round as each run ends (rank 0
    only), none of Lightning's banners, summaries or progress bars, no third-party warnings,
    and the headline with every round's gain."""
    summary, stdout, stderr = main_job
    modes = summary["modes"]
    order = schedule(list(modes), summary["rounds"])
    pattern = re.compile(r"^run (\d+)/(\d+): (\S+) +round (\d+) +([\d,]+) tokens/s  .*$", re.M)
    lines = list(pattern.finditer(stdout))
    assert [(m[3], int(m[4])) for m in lines] == [(mode, k) for k, mode in order]
    assert [(int(m[1]), int(m[2])) for m in lines] == [(n, 10) for n in range(1, 11)]
    for m in lines:
        mode, k = m[3], int(m[4])
        run = modes[mode]["by_round"][k]
        assert abs(int(m[5].replace(",", "")) - run["tokens_per_s"]) <= 0.6  # the same figure
        text = m[0]
        if mode != "off" and k == 0:  # off ran first in this round: the gain is there
            assert text.endswith(f"| {_pct(run['gain_vs_off'])} vs round 0's off"), text
        elif mode != "off":  # backward round: off runs last and gives the gains
            assert text.endswith("| vs off: on round 1's off line (it runs last)"), text
        elif k == 1:
            gains = ", ".join(
                f"{other} {_pct(modes[other]['by_round'][1]['gain_vs_off'])}"
                for other in ("auto", "encoder", "source", "overlap")
            )
            assert text.endswith(f"| round 1 vs this off: {gains}"), text
    # quiet: no banner, summary, progress bar or third-party warning, on either stream
    for banner in BANNERS:
        assert banner not in stdout and banner not in stderr, banner
    assert "Epoch 0" not in stdout and "it/s" not in stdout  # no progress bar
    # stderr keeps the package's own warnings (a refit not adopted), none of other libraries'
    assert "is deprecated" not in stderr, stderr
    assert not re.search(r"site-packages/\S+\.py:\d+: ", stderr), stderr
    assert len(stdout.splitlines()) < 44, stdout  # 10 run lines, the table, the headline, ...
    # the headline: the whole-run gain with each round's, their median and the verdict
    best = modes[summary["best_mode"]]
    assert summary["gain_by_round"] == best["gain_by_round"] and len(best["gain_by_round"]) == 2
    gains = [g for g in best["gain_by_round"] if g is not None]
    median = sum(gains) / len(gains)
    assert summary["gain_median_over_rounds"] == pytest.approx(median, abs=1e-4)
    rounds = ", ".join(_pct(g) for g in best["gain_by_round"])
    head = re.search(r"^Best: .*$", stdout, re.M)
    assert head and head[0].startswith(
        f"Best: {summary['best_mode']}, {_pct(summary['gain_vs_off'])} tokens/s over off (whole"
        f" runs; rounds: {rounds}; median {_pct(summary['gain_median_over_rounds'])}; "
    ), head
    assert headline(summary) in head[0]
