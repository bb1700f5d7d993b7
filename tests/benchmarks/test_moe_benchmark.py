"""benchmarks/moe_routing.py: every timed path computes what the loop computes, and the JSON it
prints describes the run that was asked for.

Times are printed, never judged (a timing does not decide a test): what is checked is that they
exist, are finite and positive, and that the derived numbers follow from them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.jobs import result_of
from tests.benchmarks.scripts import load

TINY = {"tokens": 64, "experts": 4, "topk": 2, "hidden": 16, "threads": 1}


def _has_transformers() -> bool:
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: F401
    except ImportError:
        return False
    return True


def _tiny_argv(out: Path) -> list[str]:
    args = [f"--{k}={v}" for k, v in TINY.items()]
    args += ["--warmup", "1", "--reps", "1"]
    args += ["--backend", "aot_eager", "--json"]  # the same graph capture, without inductor
    return ["benchmarks/moe_routing.py", *args]


@pytest.mark.smoke_run("moe_routing", argv=_tiny_argv, check=True, seconds=7)
def test_moe_benchmark_tiny_run(smoke_runs) -> None:
    out = result_of(smoke_runs, "moe_routing").proc  # a smoke run (tests/smoke_runs.py)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # the run is the one configured (the expert hidden size defaults to 2 x hidden)
    assert {k: report[k] for k in TINY} == TINY
    assert report["ffn"] == 2 * TINY["hidden"] and report["backend"] == "aot_eager"
    # every path was checked against the loop before it was timed, and agrees with it
    hf = _has_transformers()
    compared = {"sorted_eager", "sorted_compiled"} | ({"hf_grouped", "hf_eager"} if hf else set())
    assert set(report["max_rel_err"]) == compared
    for path, err in report["max_rel_err"].items():
        assert 0 <= err < 1e-5, (path, err)  # NaN fails here too
    timed = ["loop_ms", "sorted_eager_ms", "sorted_compiled_ms"]
    timed += ["hf_grouped_ms", "hf_eager_ms"] if hf else []
    for key in timed:
        assert math.isfinite(report[key]) and report[key] > 0, (key, report[key])
    if not hf:
        assert report["hf_grouped_ms"] is None and report["hf_eager_ms"] is None
    assert report["speedup_vs_loop"] == pytest.approx(
        report["loop_ms"] / report["sorted_compiled_ms"]
    )


def test_loop_and_sorted_paths_have_the_same_forward_and_backward(one_thread) -> None:
    """The benchmark times forward + backward: the sorted path must compute the loop's output
    and every gradient (input, router, each expert's gate, up and down weights), else the
    speed-up compares different work."""
    bench = load("moe_routing")
    torch.manual_seed(0)
    E, K, H, F, T = 4, 2, 16, 32, 64
    router_w = torch.randn(E, H) / H**0.5
    gate_up = torch.randn(E, 2 * F, H) / H**0.5
    down = torch.randn(E, H, F) / F**0.5
    x, probe = torch.randn(T, H), torch.randn(T, H)
    loop = bench.LoopExperts(router_w, gate_up, down, K)
    ours = bench.SortedExperts(router_w, gate_up, down, K)
    grads = {}
    for name, module in (("loop", loop), ("sorted", ours)):
        xi = x.clone().requires_grad_()
        out = module(xi)
        (out * probe).sum().backward()
        grads[name] = (out.detach(), xi.grad, module.router.grad)
    for a, b in zip(grads["sorted"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads["loop"][0].abs().max() > 0  # a zero output would agree with anything
    for e in range(E):
        torch.testing.assert_close(ours.gate_up.grad[e, :F], loop.w_gate[e].grad)
        torch.testing.assert_close(ours.gate_up.grad[e, F:], loop.w_up[e].grad)
        torch.testing.assert_close(ours.down.grad[e], loop.w_down[e].grad)
