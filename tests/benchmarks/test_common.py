"""benchmarks/common.py: the ``--json`` output parses and carries the machine's metadata, and the
timers measure what they time (a known sleep: never less than it; no upper bound is judged)."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness.jobs import result_of
from tests.benchmarks.scripts import BENCHMARKS, load, mix_csv

common = load("common")
META = {"date", "machine", "python", "platform", "cpus"}


def test_the_json_flag_and_the_printed_object_parse(capsys) -> None:
    parser = argparse.ArgumentParser()
    common.add_json_flag(parser)
    assert parser.parse_args(["--json"]).json is True
    assert parser.parse_args([]).json is False
    result = {"rows": [{"a": 1.5}], **common.stamp("numpy")}
    common.print_json(result)
    common.print_json(result, indent=2)
    one_line, indented = capsys.readouterr().out.split("\n", 1)
    assert json.loads(one_line) == result == json.loads(indented)


def test_the_stamp_names_the_date_the_machine_and_the_versions() -> None:
    meta = common.stamp("numpy", "pytest", "no_such_package_here")
    assert set(meta) == META | {"numpy", "pytest", "no_such_package_here"}
    assert meta["date"] == datetime.date.today().isoformat()
    assert meta["python"] == platform.python_version() and meta["cpus"] == os.cpu_count()
    assert meta["machine"] == f"{platform.machine()}, {os.cpu_count()} cpus"
    assert meta["numpy"] == np.__version__ and meta["pytest"] == pytest.__version__
    assert meta["no_such_package_here"] is None
    assert common.environment().keys() == {"python", "platform", "cpus"}


def test_versions_are_read_without_importing_the_packages() -> None:
    """gpu_check reads the versions in a process that must not import torch (nor touch CUDA)
    before its parts run: in a fresh interpreter, the stamp names torch's version from its
    metadata and leaves torch unimported."""
    code = (
        "import json, sys; import common;"
        " print(json.dumps([common.stamp('torch', 'numpy'), 'torch' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=BENCHMARKS,  # as a script there sees its siblings
        capture_output=True,
        text=True,
        check=True,
    )
    meta, imported = json.loads(out.stdout)
    assert meta["torch"] == importlib.metadata.version("torch") and not imported
    assert meta["numpy"] == np.__version__


def test_the_timers_measure_a_known_sleep() -> None:
    calls = []

    def nap() -> str:
        calls.append(time.perf_counter())
        time.sleep(0.02)
        return "done"

    result, seconds = common.timed(nap)
    assert result == "done" and seconds >= 0.02
    assert common.wall_ms(nap) >= 20.0
    calls.clear()
    assert common.median_ms(nap, reps=3, warmup=2) >= 20.0
    assert len(calls) == 5  # the warm-up calls run, untimed
    with pytest.raises(ValueError, match="reps=0"):
        common.median_ms(nap, reps=0)


def _packing_argv(tmp: Path) -> list[str]:
    return [
        "benchmarks/packing.py",
        *("--data", str(mix_csv(tmp, 2000)), "--text-share", "0.2"),
        *("--seq-len", "2048", "--repeat", "2", "--json"),
    ]


@pytest.mark.smoke_run("packing", argv=_packing_argv, timeout=300, check=True, seconds=5)
def test_a_script_prints_its_result_with_the_stamp(smoke_runs) -> None:
    """``benchmarks/packing.py --json``, run as a script: its own keys and the metadata, on the
    last line; its timings come from the common timer (one per repetition)."""
    out = result_of(smoke_runs, "packing").proc  # a smoke run (tests/smoke_runs.py)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert META | {"numpy", "efficiency", "samples_per_s", "median_s"} <= set(result)
    assert result["valid"] and result["date"] == datetime.date.today().isoformat()
    assert len(result["times_s"]) == 2 and min(result["times_s"]) > 0
