"""What makes the sorted dispatch fast on a GPU, checked on the CPU (``benchmarks/moe_ops.py``):
operators per layer constant in the number of experts, no operator that makes the host wait for
device data, one graph and no graph break under ``torch.compile(fullgraph=True)``, and backward
passes that gather rather than scatter. Counts only: no test here reads a clock."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_vlmbalance.moe import combine, dispatch, gather, route

ROOT = Path(__file__).resolve().parents[2]
TOKENS, HIDDEN = 64, 16

pytestmark = pytest.mark.usefixtures("one_thread")


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("_moe_ops", ROOT / "benchmarks" / "moe_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ops = _load_benchmark()


def _counts(path: str, experts: int, *, descend: bool = True) -> tuple[dict, dict]:
    """Counter summaries of one forward and of its backward, separately."""
    module = ops.layer(path, experts, min(8, experts), HIDDEN)
    x, probe = ops.inputs(module, TOKENS, seed=0)
    with ops.OpCounter(descend=descend) as fwd:
        out = module(x)
    with ops.OpCounter(descend=descend) as bwd:
        out.backward(probe)
    return fwd.summary(), bwd.summary()


def test_the_counter_sees_each_kind_of_host_sync() -> None:
    """Every kind of host read the benchmark names is counted, and a fixed-shape gather is not
    (else a zero below would prove nothing)."""
    t = torch.tensor([3.0, -1.0, 2.0])
    cases = {
        "_local_scalar_dense": lambda: t.sum().item(),
        "nonzero": lambda: torch.where(t > 0),
        "index[bool mask]": lambda: t[t > 0],
        "masked_select": lambda: t.masked_select(t > 0),
        "_unique2": lambda: torch.unique(t, return_inverse=True),
        "bincount": lambda: torch.bincount(torch.tensor([0, 2])),
        "repeat_interleave(no output_size)": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "Tensor.tolist": lambda: t.tolist(),
    }
    for reason, fn in cases.items():
        with ops.OpCounter() as counter:
            fn()
        assert reason in counter.summary()["sync_ops"], (reason, counter.summary())
    with ops.OpCounter() as counter:
        t.index_select(0, torch.tensor([2, 0])).cumsum(0)
    assert counter.summary()["syncs"] == 0 and counter.summary()["kernels"] == 2


def test_sorted_op_count_is_constant_in_experts_and_the_loops_grows() -> None:
    """The sorted layer dispatches the same operators at E=8 and E=64 (bfloat16: everything,
    the grouped products included; float32: everything ``torch.compile`` sees, the per-expert
    custom op counted once); the loop adds the same operators for every expert."""
    bf16 = {E: _counts("sorted_bf16", E) for E in (8, 64)}
    assert bf16[8] == bf16[64]
    fp32 = {E: _counts("sorted_fp32", E, descend=False) for E in (8, 64)}
    assert fp32[8] == fp32[64]
    loop = {E: sum(s["kernels"] for s in _counts("loop", E)) for E in (8, 16, 64)}
    per_expert = (loop[16] - loop[8]) / 8
    assert per_expert > 10 and loop[64] - loop[8] == 56 * per_expert


def test_sorted_routing_has_no_host_sync_forward_or_backward() -> None:
    """route, dispatch, gather and combine (float32) and the whole bfloat16 layer, whose expert
    compute is ``torch._grouped_mm``: no host sync in the forward, none in the backward."""
    torch.manual_seed(0)
    E, K = 8, 2
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    router, scale = torch.randn(E, HIDDEN, requires_grad=True), torch.randn(E, 1, HIDDEN)
    with ops.OpCounter() as fwd:
        weights, experts, _ = route(x @ router.T, K, renormalize=True)
        d = dispatch(experts, E)
        xs = gather(x, d)
        out = combine(xs * scale.index_select(0, d.expert).squeeze(1), d, weights)
    with ops.OpCounter() as bwd:
        out.square().sum().backward()
    assert fwd.summary()["syncs"] == bwd.summary()["syncs"] == 0, (fwd.counts, bwd.counts)
    assert x.grad.abs().max() > 0 and router.grad.abs().max() > 0  # the backward did run
    for phase in _counts("sorted_bf16", 8):
        assert phase["syncs"] == 0 and phase["custom_ops"] == 0, phase


def test_host_reads_are_where_the_docs_say() -> None:
    """The loop syncs once per expert (``torch.where``); float32 sorted once per direction,
    inside ``vlmbalance::grouped_mlp`` (the offsets are read on the host) and nowhere else."""
    fwd, bwd = _counts("loop", 8)
    assert fwd["sync_ops"] == {"nonzero": 8} and bwd["syncs"] == 0
    fwd, bwd = _counts("sorted_fp32", 8)
    assert fwd["sync_ops"] == bwd["sync_ops"] == {"Tensor.tolist": 1}
    assert fwd["custom_ops"] == bwd["custom_ops"] == 1
    assert all(s["syncs"] == 0 for s in _counts("sorted_fp32", 8, descend=False))


def test_gather_and_combine_backward_gather_instead_of_scatter() -> None:
    """The backward of the two row moves is a gather (inductor's CPU scatter-add is a loop of
    atomic adds on several threads), with the gradients of ``index_select``."""
    torch.manual_seed(0)
    N, E, K, H = 32, 4, 2, 8
    _, experts, _ = route(torch.randn(N, E), K)
    d = dispatch(experts, E)
    x, y = torch.randn(N, H, requires_grad=True), torch.randn(N * K, H, requires_grad=True)
    weights, probe_x, probe_y = torch.rand(N, K), torch.randn(N * K, H), torch.randn(N, H)
    moved = (gather(x, d), combine(y, d, weights))
    with ops.OpCounter() as bwd:
        torch.autograd.backward(moved, (probe_x, probe_y))
    scatters = {"index_add", "index_put", "_index_put_impl_", "scatter_add", "scatter"}
    used = {k.split(".")[1] for k in bwd.counts if k.startswith("op:")}
    assert not used & scatters and "index_select" in used, used
    gx, gy = torch.autograd.grad(
        (x.index_select(0, d.token), combine_reference(y, d, weights)), (x, y), (probe_x, probe_y)
    )
    torch.testing.assert_close(x.grad, gx, rtol=1e-6, atol=1e-6)  # summed in another order
    assert torch.equal(y.grad, gy)  # a permutation: each row moved once, the same values


def combine_reference(y_SH: torch.Tensor, d, weights_NK: torch.Tensor) -> torch.Tensor:
    N, K = weights_NK.shape
    return (y_SH.index_select(0, d.inverse).view(N, K, -1) * weights_NK.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("path", ["sorted_fp32", "sorted_bf16"])
def test_sorted_layer_compiles_once_fullgraph_without_graph_break(path) -> None:
    """One graph for forward and backward, no graph break, and no recompilation for another
    routing (no shape depends on the data)."""
    stats = ops.compile_stats(ops.layer(path, 8, 2, HIDDEN), TOKENS)
    assert stats == {**stats, "fullgraph": True, "graphs": 1, "recompiles": 0, "graph_breaks": 0}
    assert "fullgraph_error" not in stats and stats["graph_ops"] > 0


class _BranchingRouter(nn.Module):
    """Branches on a router value mid-forward (the host must see it): ``compile_stats`` must
    report the graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(2, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x @ self.router.T).sum() > 0:
            return x * 2
        return x * 3


def test_compile_stats_reports_a_graph_break() -> None:
    stats = ops.compile_stats(_BranchingRouter(), TOKENS)
    assert stats["fullgraph"] is False and stats["fullgraph_error"]
    assert stats["graph_breaks"] >= 1 and stats["graphs"] >= 1


def test_benchmark_json(capsys) -> None:
    """``--json`` prints the table, then one JSON object last with a row per path and E."""
    ops.main(["--smoke", "--no-compile", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert lines[0].split()[:3] == ["path", "experts", "topk"]
    assert {k: report[k] for k in ("tokens", "hidden", "compile")} == {
        "tokens": 64,
        "hidden": 16,
        "compile": False,
    }
    rows = {(r["path"], r["experts"]): r for r in report["rows"]}
    assert set(rows) == {(p, E) for p in ops.PATHS for E in (4, 8)}
    for r in rows.values():
        assert {"ops", "kernels", "syncs", "sync_ops", "custom_ops"} <= set(r)
        assert 0 < r["kernels"] < r["ops"] and r["syncs"] == sum(r["sync_ops"].values())
    assert rows["sorted_bf16", 4]["ops"] == rows["sorted_bf16", 8]["ops"]
    assert rows["loop", 8]["syncs"] == 8 and rows["sorted_bf16", 8]["syncs"] == 0
