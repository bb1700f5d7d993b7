"""benchmarks/peers.py runs its tiny configuration end to end and its rows keep their promises:
every peer and every mode of ours on every configuration, on the same samples as ``off``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = {
    "veomni",
    "omnibal",
    "omnibal@mixcaps",
    "megatron",
    "nemo_automodel",
    "nemo_automodel@shuffle",
    "wlb_llm",
    "wlb_llm+vision",
}
OURS = {"off", "overlap", "source", "encoder", "encoder_overlap", "encoder_source"}
# formed at the source (no exchange) / moved at run time
SOURCE_SIDE = PEERS - {"veomni", "megatron"}
MOVERS = {"veomni", "megatron"}
KEY = ("mix", "text_share", "dp", "ga", "strategy")


@pytest.fixture(scope="module")
def result() -> dict:
    proc = subprocess.run(
        [sys.executable, "benchmarks/peers.py", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _groups(result: dict) -> dict[tuple, dict[str, dict]]:
    groups: dict[tuple, dict[str, dict]] = {}
    for row in result["rows"]:
        groups.setdefault(tuple(row[k] for k in KEY), {})[row["algorithm"]] = row
    return groups


def test_every_peer_and_mode_on_every_configuration(result: dict) -> None:
    groups = _groups(result)
    # --quick: one mix, one share, dp 8, ga 1 and 2, both strategies
    assert {(k[2], k[3], k[4]) for k in groups} == {
        (8, ga, s) for ga in (1, 2) for s in ("vlmbalance", "fsdp_vlmbalance")
    }
    ours = {f"ours:{m}" for m in result["our_modes"]}
    assert {f"ours:{m}" for m in OURS} <= ours
    for key, rows in groups.items():
        assert set(rows) == PEERS | ours, key
    assert len(result["summary"]) == len(groups)


def test_rows_are_in_range(result: dict) -> None:
    for row in result["rows"]:
        name = (row["algorithm"], *(row[k] for k in KEY))
        assert 0.0 <= row["waste_frac"] < 1.0, name
        assert 0.0 < row["packing_efficiency"] <= 1.0, name
        assert row["tokens_per_s_per_rank"] > 0.0, name
        assert row["step_ms"] >= row["ideal_step_ms"] > 0.0, name
        assert row["moved_bytes"] == pytest.approx(row["payload_bytes"] + row["gather_bytes"])
        assert row["moved_bytes"] >= 0.0, name


def test_peers_train_the_samples_of_off_exactly_once(result: dict) -> None:
    for key, rows in _groups(result).items():
        off_tokens = rows["ours:off"]["tokens"]
        assert rows["ours:source"]["tokens"] == off_tokens, key  # the simulator's own promise
        for peer in PEERS:
            row = rows[peer]
            # each sample occurrence of off's batches in exactly one priced pack (counted on
            # the packs the script priced), and the tokens those packs hold are off's
            assert row["trained_once"] is True, (peer, key)
            assert row["tokens"] == off_tokens, (peer, key)
            assert row["max_pack_tokens"] <= result["seq_len"], (peer, key)


def test_what_moves(result: dict) -> None:
    for key, rows in _groups(result).items():
        assert rows["ours:off"]["moved_bytes"] == 0.0
        for peer in SOURCE_SIDE:
            assert rows[peer]["moved_bytes"] == 0.0, (peer, key)
        for peer in MOVERS:  # dp 8: images and samples leave home
            assert rows[peer]["payload_bytes"] > 0.0 and rows[peer]["gather_bytes"] > 0.0
            assert rows[peer]["step_path_transfer_ms"] > 0.0


def test_the_script_prices_as_the_simulator(result: dict) -> None:
    assert result["checks"]
    for check in result["checks"]:
        # the same draws as simulate's off, and off priced here as simulate prices it
        assert check["same_draws"] is True, check
        assert check["off_reproduced"] is True, check


def test_summary_ratios(result: dict) -> None:
    groups = _groups(result)
    for s in result["summary"]:
        rows = groups[tuple(s[k] for k in KEY)]
        peer = max((rows[p] for p in PEERS), key=lambda r: r["tokens_per_s_per_rank"])
        assert s["best_peer"] == peer["algorithm"]
        assert s["ours_over_peer"] == pytest.approx(
            s["best_ours_tokens_per_s"] / peer["tokens_per_s_per_rank"]
        )
        assert s["best_ours"] != "ours:auto"
