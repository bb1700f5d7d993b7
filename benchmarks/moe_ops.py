"""What makes the sorted MoE dispatch faster on a GPU, counted on the CPU: operators dispatched per
layer, operators that make the host wait for device data, and graph breaks under ``torch.compile``.

    python benchmarks/moe_ops.py --experts 8,16,32,64,128 --topk 8 --json

One Mixtral-style MoE layer (the ``LoopExperts`` and ``SortedExperts`` of
``benchmarks/moe_routing.py``: router, top-k, SwiGLU experts), forward and backward
(``out.backward(probe)``), counted with a ``TorchDispatchMode`` for each number of experts E:

- ``loop``: per expert ``torch.where(expert_ids == e)``, a gather, the expert MLP, ``index_add``
  (Mixtral in transformers 4, the example VLM's ``MoEFeedForward``), float32.
- ``sorted_fp32``: :func:`lightning_vlmbalance.moe.fused_experts_moe` in float32: the routing
  around one custom op per direction (``vlmbalance::grouped_mlp``) that runs each expert's MLP on
  its slice and reads the offsets on the host.
- ``sorted_bf16``: the same in bfloat16, where the expert compute is two ``torch._grouped_mm``
  (what a CUDA device of compute capability 9.0+, an H100 or H200, runs).

Columns (forward + backward of one layer call):

- ``ops``: aten operators dispatched, inside the package's custom ops included (their Python
  implementation is run under the counter), views and allocations included.
- ``kernels``: ``ops`` less views and uninitialised allocations (``empty*``), the operators that
  launch a kernel on a GPU: each costs a launch (~5 us) however little work it does.
- ``syncs``: operators after which the host must read device data (a blocking device-to-host
  copy on a GPU): ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``), ``nonzero``
  (``torch.where(cond)``), ``masked_select``, boolean-mask ``index``/``index_put``, the
  ``unique`` family, ``bincount``, ``repeat_interleave`` without ``output_size``, ``is_nonzero``,
  ``equal``, copies to the CPU; and ``Tensor.tolist()``/``.numpy()``, which read the data without
  dispatching an operator (seen with a ``TorchFunctionMode``). ``sync_ops`` names them.
- ``custom_ops``: calls of the package's custom ops (opaque to ``torch.compile``).

And, once per E, ``torch.compile`` with a counting ``aot_eager`` backend
(``CompileCounterWithBackend``: the same graph capture and autograd split as inductor, without
code generation), called twice with different routings: ``fullgraph`` (whether
``fullgraph=True`` compiles), ``graphs`` (graphs compiled by the first call; ``fullgraph=False``
when ``fullgraph=True`` fails), ``recompiles`` (graphs added by the second call), ``graph_breaks``
(dynamo's counters ``graph_break`` and ``unimplemented``; torch 2.13 files them under the
latter) and ``graph_ops`` (operators in the captured graphs); for the loop only up to
``--loop-compile-max`` experts (its graph grows with E, and so does the tracing time).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# its siblings when loaded by its path (tests/moe/test_moe_ops.py) rather than run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_json_flag, print_json, stamp
from moe_routing import LoopExperts, SortedExperts  # the timed layers

PATHS = ("loop", "sorted_fp32", "sorted_bf16")

# aten operators (overload packets) whose result the host must read before it can go on
_SYNC_PACKETS = frozenset(
    {
        "_local_scalar_dense",  # .item(), bool(t), int(t)
        "nonzero",  # torch.where(cond), data-dependent shape
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",  # output length = max id + 1
        "is_nonzero",
        "equal",
    }
)
_MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_HOST_READS = frozenset({"tolist", "numpy", "__array__"})  # no operator dispatched for these


def _sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why the host has to wait for device data after ``func(*args, **kwargs)``, or ``None``."""
    name = func.overloadpacket.__name__
    if name in _SYNC_PACKETS:
        return name
    if name in _MASK_INDEXED and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    ):
        return f"{name}[bool mask]"
    if name == "repeat_interleave" and func._overloadname == "Tensor":
        if kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
            return "repeat_interleave(no output_size)"
    if name in ("_to_copy", "copy_"):  # a device-to-host copy
        src, dst = (args[0], kwargs.get("device")) if name == "_to_copy" else (args[1], args[0])
        if isinstance(dst, torch.Tensor):
            dst = dst.device
        if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
            return f"{name}(to host)"
    return None


class _HostReads(TorchFunctionMode):
    """Counts the ``Tensor`` methods in ``_HOST_READS`` into ``owner.counts``."""

    def __init__(self, owner: OpCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _HOST_READS or self.owner._reading:
            return func(*args, **(kwargs or {}))
        # the watchers of nested entries see the same call: count it once
        self.owner.counts[f"sync:Tensor.{name}"] += 1
        self.owner._reading = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner._reading = False


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while active (``counts``: ``"op:<overload>"``,
    ``"sync:<reason>"``, ``"custom:<op>"``). Custom ops defined with ``torch.library.custom_op``
    are counted and then run as their Python implementation under the counter, so the operators
    they run (and host reads such as ``offsets.tolist()``) are counted too; ``descend=False``
    counts the custom op alone (what ``torch.compile`` sees)."""

    def __init__(self, *, descend: bool = True) -> None:
        super().__init__()
        self.descend = descend
        self.counts: Counter = Counter()
        self._reads: list[_HostReads] = []
        self._reading = False

    def __enter__(self):
        # also watch for host reads that dispatch no operator (torch functions are off below the
        # dispatcher, so each re-entry for a custom op pushes a watcher of its own)
        self._reads.append(_HostReads(self))
        self._reads[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.pop().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = _maybe_get_opdef(func._schema.name) if func.namespace != "aten" else None
        if opdef is not None:
            self.counts[f"custom:{func._schema.name}"] += 1
            if not self.descend:
                return func(*args, **kwargs)
            with self:
                return opdef._init_fn(*args, **kwargs)
        self.counts[f"op:{func}"] += 1
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.counts[f"sync:{reason}"] += 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, Any]:
        ops = {k[3:]: v for k, v in self.counts.items() if k.startswith("op:")}
        kernels = sum(
            v
            for k, v in ops.items()
            if not _op(k).is_view and _op(k).overloadpacket.__name__ not in _ALLOCATIONS
        )
        syncs = {k[5:]: v for k, v in self.counts.items() if k.startswith("sync:")}
        return {
            "ops": sum(ops.values()),
            "kernels": kernels,
            "syncs": sum(syncs.values()),
            "sync_ops": dict(sorted(syncs.items())),
            "custom_ops": sum(v for k, v in self.counts.items() if k.startswith("custom:")),
        }


def _op(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def layer(path: str, experts: int, topk: int, hidden: int, seed: int = 0) -> torch.nn.Module:
    """The ``path`` layer with E experts (SwiGLU, F = 2 x hidden), seeded weights."""
    g = torch.Generator().manual_seed(seed)
    ffn = 2 * hidden
    router_w = torch.randn(experts, hidden, generator=g) / hidden**0.5
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, ffn, generator=g) / ffn**0.5
    cls = LoopExperts if path == "loop" else SortedExperts
    module = cls(router_w, gate_up, down, topk)
    return module.to(torch.bfloat16) if path == "sorted_bf16" else module


def inputs(module: torch.nn.Module, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = module.router.shape[1]
    dtype = module.router.dtype
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    return x.requires_grad_(), torch.randn(tokens, hidden, generator=g).to(dtype)


def count_ops(module: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> dict[str, Any]:
    """The operator counts of one forward and backward of ``module`` (see the module docstring)."""
    with OpCounter() as counter:
        module(x).backward(probe)
    return counter.summary()


def compile_stats(module: torch.nn.Module, tokens: int) -> dict[str, Any]:
    """Graphs, recompiles and graph breaks of ``module`` compiled with a counting ``aot_eager``
    backend, forward and backward on two inputs that route differently."""
    result: dict[str, Any] = {}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        counters.clear()
        backend = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(module, fullgraph=fullgraph, backend=backend)
        try:
            for call, seed in enumerate((1, 2)):
                x, probe = inputs(module, tokens, seed)
                compiled(x).backward(probe)
                if call == 0:
                    graphs = backend.frame_count
        except Exception as e:  # dynamo's Unsupported and its relatives
            if not fullgraph:
                raise
            result["fullgraph_error"] = str(e).strip().splitlines()[0][:160]
            continue
        result.update(
            fullgraph=fullgraph,
            graphs=graphs,
            recompiles=backend.frame_count - graphs,
            # torch 2.13 files graph breaks under "unimplemented" ("graph_break" stays empty)
            graph_breaks=sum(counters["graph_break"].values())
            + sum(counters["unimplemented"].values()),
            graph_ops=backend.op_count,
        )
        break
    torch._dynamo.reset()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rows = []
    for E in args.experts:
        K = min(args.topk, E)
        for path in PATHS:
            module = layer(path, E, K, args.hidden)
            x, probe = inputs(module, args.tokens, seed=0)
            row = {"path": path, "experts": E, "topk": K, **count_ops(module, x, probe)}
            if args.compile and (path != "loop" or E <= args.loop_compile_max):
                row.update(compile_stats(module, args.tokens))
            rows.append(row)
    return {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ffn": 2 * args.hidden,
        **stamp("torch"),
        "compile": args.compile,
        "rows": rows,
    }


def _table(report: dict[str, Any]) -> str:
    cols = ["path", "experts", "topk", "ops", "kernels", "syncs", "custom_ops"]
    if report["compile"]:
        cols += ["fullgraph", "graphs", "recompiles", "graph_breaks", "graph_ops"]
    lines = [" ".join(f"{c:>12}" for c in cols)]
    for row in report["rows"]:
        lines.append(" ".join(f"{row.get(c, '')!s:>12}" for c in cols))
    syncs = {
        f"{r['path']}@E={r['experts']}": r["sync_ops"] for r in report["rows"] if r["sync_ops"]
    }
    lines += [f"syncs {k}: {v}" for k, v in syncs.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experts", default="8,16,32,64,128", help="comma-separated expert counts")
    p.add_argument("--topk", type=int, default=8, help="experts per token (at most E)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64, help="a multiple of 8 (bfloat16 _grouped_mm)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="counts only")
    p.add_argument(
        "--loop-compile-max",
        type=int,
        default=32,
        help="compile the loop only up to this E (tracing E experts takes seconds each)",
    )
    p.add_argument("--smoke", action="store_true", help="E = 4, 8; 64 tokens; hidden 16")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.experts, args.tokens, args.hidden = "4,8", 64, 16
    args.experts = [int(e) for e in args.experts.split(",")]
    if args.hidden % 8:
        p.error(f"--hidden={args.hidden}: a multiple of 8 (torch._grouped_mm in bfloat16)")
    report = run(args)
    print(_table(report))
    if args.json:
        print_json(report)


if __name__ == "__main__":
    main()
