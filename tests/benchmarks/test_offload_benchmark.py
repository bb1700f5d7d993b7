"""benchmarks/offload_gpu.py: its --tiny CPU run goes through the same code and prints JSON that
describes what it measured.

On the CPU (test mode) peak memory is not measured and times are printed, never judged (a
timing does not decide a test). What is checked: the configuration, the relations between the
printed numbers, and that the offloaded bytes per step are exactly the activations autograd
saves in one forward of the benchmarked stack (``--min-mib 0``: everything but the parameters).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.jobs import result_of
from tests.benchmarks.scripts import load

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "benchmarks/offload_gpu.py", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def _saved_activation_bytes(report: dict, heads: int, device: str, dtype: torch.dtype) -> int:
    """Bytes of what autograd saves in one forward of the benchmark's stack, parameters (and
    views of them) left out, counted with plain saved-tensor hooks (no offloader involved)."""
    bench = load("offload_gpu")
    torch.manual_seed(0)
    layers = (bench.Block(report["dim"], heads) for _ in range(report["layers"]))
    model = nn.Sequential(*layers).to(device, dtype)
    assert sum(p.numel() for p in model.parameters()) == report["params"]
    x = torch.randn(1, report["tokens"], report["dim"], device=device, dtype=dtype)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:  # nor a view of one (weight.T)
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    loss.backward()
    return sum(saved)


def _tiny_argv(out: Path) -> list[str]:
    return ["benchmarks/offload_gpu.py", "--tiny", "--json"]


@pytest.mark.smoke_run("offload_tiny", argv=_tiny_argv, timeout=300, check=True, seconds=5)
def test_offload_benchmark_tiny_run(smoke_runs) -> None:
    # a smoke run (tests/smoke_runs.py), as _run("--tiny")
    report = json.loads(result_of(smoke_runs, "offload_tiny").proc.stdout)
    assert report["device"].startswith("cpu") and report["dtype"] == "torch.float32"
    assert (report["tokens"], report["dim"], report["layers"], report["steps"]) == (64, 32, 2, 2)
    rows = report["results"]
    assert set(rows) == {"none", "ours_min0mib"}
    none, ours = rows["none"], rows["ours_min0mib"]
    for row in rows.values():
        assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0
    assert none["time_vs_none"] == 1.0
    assert ours["time_vs_none"] == pytest.approx(ours["step_ms"] / none["step_ms"])
    # no CUDA: peak memory is not measured, so no ratio is made up
    assert none["peak_activation_mib"] == ours["peak_activation_mib"] == 0
    assert none["activation_mem_vs_none"] is ours["activation_mem_vs_none"] is None
    expected = _saved_activation_bytes(report, heads=2, device="cpu", dtype=torch.float32)
    assert expected > 0
    assert ours["offloaded_mib_per_step"] * (1 << 20) == pytest.approx(expected, rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_lowers_peak_activation_memory_on_a_gpu() -> None:
    """A small bfloat16 stack: offloading every activation (``--min-mib 0``) keeps the peak
    activation memory at or below no offload; ``save_on_cpu`` is measured alongside."""
    report = _run(
        *("--tokens", "2048", "--dim", "256", "--heads", "4", "--layers", "4"),
        *("--steps", "2", "--warmup", "1", "--min-mib", "0"),
    )
    rows = report["results"]
    assert set(rows) == {"none", "save_on_cpu", "ours_min0mib"}
    none, ours = rows["none"], rows["ours_min0mib"]
    assert none["peak_activation_mib"] > 0
    assert ours["peak_activation_mib"] <= none["peak_activation_mib"]
    assert ours["activation_mem_vs_none"] == pytest.approx(
        ours["peak_activation_mib"] / none["peak_activation_mib"]
    )
    expected = _saved_activation_bytes(report, heads=4, device="cuda", dtype=torch.bfloat16)
    assert ours["offloaded_mib_per_step"] * (1 << 20) == pytest.approx(expected, rel=1e-12)
