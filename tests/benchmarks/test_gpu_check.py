"""benchmarks/gpu_check.py: its --smoke run goes through every part on the CPU, and (with
``pytest -m suite``; the CI's smoke run checks every part's report) a part that fails or runs out
of time is reported while the others still run.

Times are printed, never judged: what is checked is that every part is reported, with the
status, the numbers and the structure the GPU session will rely on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.jobs import result_of
from tests.benchmarks.scripts import load

PARTS = ["pytest", "attention", "monitor", "offload", "moe", "exchange", "encoder", "collectives"]


def _smoke_argv(out: Path) -> list[str]:
    return ["benchmarks/gpu_check.py", "--smoke", "--json", "--out", str(out / "report")]


def _failing_argv(out: Path) -> list[str]:
    # one at a time: after a failed part and a timed-out part, the next one still runs
    return ["benchmarks/gpu_check.py", "--smoke", "--json", "--jobs", "1",
            "--parts", "attention,monitor,exchange", "--fail-part", "attention",
            "--timeout-part", "monitor=0.5"]  # fmt: skip


def _report(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.smoke_run("gpu_check", argv=_smoke_argv, check=True, seconds=25)
def test_smoke_run_reports_every_part(smoke_runs) -> None:
    """Every part runs on the CPU and is ok, except ``pytest -m gpu``, which is skipped with its
    reason (without CUDA its tests would only skip); the table and the JSON say so."""
    run = result_of(smoke_runs, "gpu_check")
    report = _report(run.proc)
    assert report["benchmark"] == "gpu_check" and report["smoke"] is True and report["ok"]
    assert [p["part"] for p in report["parts"]] == PARTS
    parts = {p["part"]: p for p in report["parts"]}
    for name, part in parts.items():
        assert {"status", "seconds", "key", "goal", "goal_met", "result"} <= part.keys(), name
        assert part["goal_met"] in (True, False, None), name
        if name == "pytest":
            assert part["status"] == "skipped" and "--smoke" in part["reason"]
            assert part["files"] and all(f.startswith("tests/") for f in part["files"])
            assert "tests/test_attention.py" in part["files"]
            assert part["command"][1:5] == ["-m", "pytest", "-m", "gpu"]
            continue
        assert part["status"] == "ok", (name, part.get("output_tail"))
        assert part["returncode"] == 0 and part["timeout_s"] > 0, name
        assert isinstance(part["result"], dict) and part["key"], name

    attention = parts["attention"]["result"]
    assert attention["auto_backend"] == "sdpa"  # the only backend on the CPU
    sdpa = attention["backends"]["sdpa"]
    assert sdpa["status"] == "ok" and len(sdpa["max_err_per_doc"]) == len(attention["doc_lens"])
    assert 0 <= sdpa["max_err"] <= attention["error_bound"]  # float32 vs a float32 reference
    for backend in ("varlen", "flash_attn"):
        assert attention["backends"][backend]["status"] == "skipped"
        assert attention["backends"][backend]["reason"]

    monitor = parts["monitor"]["result"]
    assert monitor["blocks_on"] > 0 and monitor["blocks_off"] > 0
    assert monitor["syncs_added_per_step"] is None and "no CUDA" in monitor["note"]
    assert math.isfinite(monitor["timer_us_per_micro_batch"])

    offload = parts["offload"]["result"]
    assert "none" in offload["results"] and offload["device"].startswith("cpu")

    moe = parts["moe"]["result"]
    assert set(moe["ms"]) >= {"loop", "sorted_eager", "sorted_compiled", "hf_grouped"}
    for path, err in moe["max_rel_err"].items():
        assert 0 <= err < 1e-5, (path, err)  # every path computes what the loop computes

    exchange = parts["exchange"]["result"]
    assert exchange["bit_exact"] is True
    assert "no CUDA: stream/event path not exercised" in exchange["note"]

    encoder = parts["encoder"]["result"]  # the return's all_to_all on a 1-rank gloo group
    assert encoder["backend"] == "gloo" and encoder["images"] == 3
    assert encoder["max_abs_err"] <= 1e-5 and encoder["grad_rel_err"] <= 1e-5

    collectives = parts["collectives"]["result"]  # FSDP2 on a 1-rank gloo mesh, host clock
    assert collectives["registered"] and collectives["steps_resolved"] == 6
    assert min(collectives["calls_per_step"]) > 0  # every unshard / reduce-scatter is timed
    assert all(x <= 1.05 for x in collectives["phase_sum_over_step"])

    # the table comes before the JSON, one row per part; --out holds the same report
    lines = run.proc.stdout.splitlines()
    header = lines.index("| part | status | s | key numbers | goal |")
    assert [
        line.split("|")[1].strip() for line in lines[header + 2 : header + 2 + len(PARTS)]
    ] == PARTS
    out = run.out / "report"
    written = json.loads((out / "gpu_check.json").read_text())
    assert [p["status"] for p in written["parts"]] == [p["status"] for p in report["parts"]]
    assert (out / "gpu_check.md").read_text().startswith("| part | status |")
    assert all((out / f"part_{name}.log").exists() for name in PARTS if name != "pytest")


@pytest.mark.suite
@pytest.mark.smoke_run("gpu_check_failures", argv=_failing_argv, seconds=15)
def test_a_failed_or_timed_out_part_does_not_stop_the_others(smoke_runs) -> None:
    """A part that fails is FAIL with the tail of its output, one past its limit is TIMEOUT,
    and the part after them still runs; the run as a whole is not ok (exit status 1)."""
    proc = result_of(smoke_runs, "gpu_check_failures").proc
    report = _report(proc)
    assert proc.returncode == 1 and report["ok"] is False
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == ["attention", "monitor", "exchange"]
    assert parts["attention"]["status"] == "FAIL"
    assert "forced failure" in parts["attention"]["output_tail"]
    assert parts["monitor"]["status"] == "TIMEOUT" and parts["monitor"]["timeout_s"] == 0.5
    assert parts["exchange"]["status"] == "ok" and parts["exchange"]["result"]["bit_exact"]
    for name in ("attention", "monitor"):
        assert parts[name]["goal_met"] is None
        assert f"| {name} | {parts[name]['status']} |" in proc.stdout


def test_last_json_reads_one_line_and_indented_objects() -> None:
    """Children print one-line JSON (gpu_check) or an indented object (offload_gpu.py); after a
    timeout the last complete one counts."""
    bench = load("gpu_check")
    indented = "log line\n" + json.dumps({"a": {"b": [1, 2]}}, indent=2)
    assert bench._last_json(indented) == {"a": {"b": [1, 2]}}
    partial = '{"partial": true, "n": 1}\n{"partial": true, "n": 2}\n{"trunc'
    assert bench._last_json(partial) == {"partial": True, "n": 2}
    assert bench._last_json("no json here") is None


def test_unknown_part_is_an_error_naming_the_known_ones(capsys) -> None:
    bench = load("gpu_check")
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--parts", "attention,nope"])
    assert "['nope']" in capsys.readouterr().err
