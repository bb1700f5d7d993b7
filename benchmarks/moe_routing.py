"""MoE layer forward+backward: per-expert ``torch.where`` loop vs sorted dispatch (eager, compiled)
vs Hugging Face transformers' own grouped implementation.

    python benchmarks/moe_routing.py --tokens 2048 --experts 64 --topk 8 --hidden 256 --json

One Mixtral-style MoE layer (softmax router, top-k, renormalised weights, SwiGLU experts with
``--ffn`` hidden units, float32, CPU): router + dispatch + experts + combine, forward and
backward of a weighted sum of the output. All four paths share the same weights and their outputs
are checked against the loop before timing (``max_rel_err``). Times are medians over ``--reps``
runs after ``--warmup`` (compilation is in the warm-up, not in the times).

- ``loop_ms``: ``nn.ModuleList`` of experts; per expert ``torch.where(expert_ids == e)``, a
  gather of its tokens, the expert MLP, ``index_add`` into the output (Mixtral in transformers 4,
  and this project's example VLM).
- ``sorted_eager_ms`` / ``sorted_compiled_ms``: :func:`lightning_vlmbalance.moe.fused_experts_moe`
  on (E, 2F, H) / (E, H, F) weights, eager and ``torch.compile(fullgraph=True)`` (inductor).
- ``hf_grouped_ms``: ``MixtralSparseMoeBlock`` with ``experts_implementation="grouped_mm"``
  (null when transformers is not installed).
- ``hf_eager_ms``: the same block with ``experts_implementation="eager"`` (a loop over the
  experts that were hit, indexing the fused 3-D weights per expert), for reference.
- ``speedup_vs_loop`` = ``loop_ms / sorted_compiled_ms``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import add_json_flag, median_ms, print_json, stamp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_vlmbalance.moe import fused_experts_moe, route


class LoopExperts(nn.Module):
    """The common eager MoE: one ``torch.where`` and one gather per expert."""

    def __init__(self, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int):
        super().__init__()
        self.k = k
        E, F2, _ = gate_up.shape
        f = F2 // 2
        self.router = nn.Parameter(router_w.clone())
        self.w_gate = nn.ParameterList(nn.Parameter(gate_up[e, :f].clone()) for e in range(E))
        self.w_up = nn.ParameterList(nn.Parameter(gate_up[e, f:].clone()) for e in range(E))
        self.w_down = nn.ParameterList(nn.Parameter(down[e].clone()) for e in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts, _ = route(F.linear(x, self.router), self.k, renormalize=True)
        out = torch.zeros_like(x)
        for e in range(len(self.w_gate)):
            token, slot = torch.where(experts == e)
            h = x[token]
            y = F.linear(
                F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e]
            )
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


class SortedExperts(nn.Module):
    def __init__(self, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Parameter(router_w.clone())
        self.gate_up = nn.Parameter(gate_up.clone())
        self.down = nn.Parameter(down.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts, _ = route(F.linear(x, self.router), self.k, renormalize=True)
        out, _ = fused_experts_moe(x, experts, weights, self.gate_up, self.down, "silu", False)
        return out


def _hf_block(router_w, gate_up, down, k: int, impl: str = "grouped_mm") -> nn.Module | None:
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    E, F2, H = gate_up.shape
    cfg = MixtralConfig(
        hidden_size=H,
        intermediate_size=F2 // 2,
        num_local_experts=E,
        num_experts_per_tok=k,
        experts_implementation=impl,
    )
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(router_w)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)

    class Flat(nn.Module):  # (N, H) in and out, as the others
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.block(x.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out).squeeze(0)

    return Flat()


def _time(fn, x: torch.Tensor, probe: torch.Tensor, warmup: int, reps: int) -> float:
    """Median milliseconds of forward + backward of a weighted sum of ``fn``'s output."""

    def step() -> None:
        (fn(x.detach().requires_grad_()) * probe).sum().backward()

    return median_ms(step, reps=reps, warmup=warmup)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    E, K, H, Fh, T = args.experts, args.topk, args.hidden, args.ffn or 2 * args.hidden, args.tokens
    router_w = torch.randn(E, H) / H**0.5
    gate_up = torch.randn(E, 2 * Fh, H) / H**0.5
    down = torch.randn(E, H, Fh) / Fh**0.5
    x = torch.randn(T, H)
    probe = torch.randn(T, H)
    loop = LoopExperts(router_w, gate_up, down, K)
    ours = SortedExperts(router_w, gate_up, down, K)
    compiled = torch.compile(ours, fullgraph=True, backend=args.backend)
    hf = _hf_block(router_w, gate_up, down, K)
    paths = {"loop": loop, "sorted_eager": ours, "sorted_compiled": compiled}
    if hf is not None:
        paths["hf_grouped"] = hf
        paths["hf_eager"] = _hf_block(router_w, gate_up, down, K, "eager")
    with torch.no_grad():
        ref = loop(x)
        errs = {
            name: ((fn(x) - ref).abs().max() / ref.abs().max()).item()
            for name, fn in paths.items()
            if name != "loop"
        }
    times = {name: _time(fn, x, probe, args.warmup, args.reps) for name, fn in paths.items()}
    return {
        "tokens": T,
        "experts": E,
        "topk": K,
        "hidden": H,
        "ffn": Fh,
        "threads": args.threads,
        "backend": args.backend,
        **stamp("torch", "transformers"),
        "loop_ms": times["loop"],
        "sorted_eager_ms": times["sorted_eager"],
        "sorted_compiled_ms": times["sorted_compiled"],
        "hf_grouped_ms": times.get("hf_grouped"),
        "hf_eager_ms": times.get("hf_eager"),
        "speedup_vs_loop": times["loop"] / times["sorted_compiled"],
        "max_rel_err": errs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=0, help="expert hidden units (default 2 x hidden)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of sorted_compiled")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    add_json_flag(p)
    args = p.parse_args()
    out = run(args)
    if args.json:
        print_json(out)
        return
    for key in ("loop_ms", "sorted_eager_ms", "sorted_compiled_ms", "hf_grouped_ms", "hf_eager_ms"):
        value = out[key]
        print(f"{key:>20}: {'n/a' if value is None else f'{value:9.1f}'}")
    print(f"{'speedup_vs_loop':>20}: {out['speedup_vs_loop']:9.2f}x")


if __name__ == "__main__":
    main()
