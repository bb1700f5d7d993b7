"""One prepared command for a GPU session: every GPU measurement, each in its own time limit.

    python benchmarks/gpu_check.py --json --out OUT      # one GPU, at most --budget-s (480 s)
    python benchmarks/gpu_check.py --smoke --json        # every part on the CPU in seconds (CI)

Parts, run one after the other, each as a child process with its own timeout (a part that fails
or runs out of time is reported as FAIL or TIMEOUT with the tail of its output, and the next
part runs):

- ``pytest``: ``pytest -m gpu`` over every test file that carries the ``gpu`` marker.
- ``attention``: :func:`~lightning_vlmbalance.packed_attention` at 8,192 tokens in 6 documents,
  bf16: PyTorch's varlen kernel vs flash-attn (when installed) vs the SDPA fallback; per
  document the largest difference to a float32 per-document reference, and the time of forward
  and forward + backward. Goal: every backend within ``max(2 x SDPA's error, 2e-2)``.
- ``monitor``: :class:`~lightning_vlmbalance.StragglerMonitor` in a real Lightning fit of the
  example VLM (bf16 on the GPU), switched on and off in ABBA blocks: steps/s with and without,
  host cost of the timing core per micro-batch (CUDA clock), the phases' sum vs the wall time,
  and host synchronisations counted with ``torch.cuda.set_sync_debug_mode``. Goal: no
  synchronisation added, timing core <= 1% of a step, phases not above the wall time.
- ``offload``: ``benchmarks/offload_gpu.py`` (peak activation memory and step time, none vs
  ``save_on_cpu`` vs ours). Goal: >= 40% less activation memory at <= 5% more time, and faster
  than ``save_on_cpu``.
- ``moe``: one MoE layer forward + backward, bf16, E=64, K=8, hidden 2,048, expert hidden 1,024
  (OLMoE-sized), 8,192 tokens: ``benchmarks/moe_routing.py``'s loop, sorted eager, sorted
  compiled and transformers grouped modules, timed on the GPU. Goal: compiled >= 2x the loop and
  no slower than transformers' grouped path.
- ``exchange``: the exchange's CUDA side in one process: payload staging (pinned host to
  device) and the received packs' per-pack events on a side stream, the training stream waiting
  on one pack's event only, overlap of the copies with compute, bit-exact packs. The NCCL
  transfer needs two GPUs: with two it runs the 2-GPU exchange test, with one it says so.

``--smoke`` runs every part on the CPU at tiny sizes (the pytest part is reported as skipped:
without CUDA its tests would only skip). The output is a markdown table (part, status, seconds,
key numbers, goal), then with ``--json`` one JSON object on the last line; ``--out DIR`` also
writes them (``gpu_check.md``, ``gpu_check.json``) and each part's full output, after every part.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import add_json_flag, cuda_ms, environment, median_ms, print_json, timed, wall_ms

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TAIL_CHARS = 3000


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    share: float  # of --budget-s: the part's own time limit (plus what earlier parts left)
    what: str
    goal: str


PARTS = (
    Part("pytest", 0.19, "pytest -m gpu (every gpu-marked test file)", "all pass"),
    Part(
        "attention",
        0.08,
        "packed attention, 8,192 tokens, bf16: varlen vs flash-attn vs SDPA",
        "each backend's max error <= max(2 x SDPA's, 2e-2) vs a float32 per-document reference",
    ),
    Part(
        "monitor",
        0.13,
        "StragglerMonitor in a Lightning fit on the GPU, on/off in ABBA blocks",
        "0 host syncs added; timing core <= 1% of a step; phases sum <= wall time",
    ),
    Part(
        "offload",
        0.24,
        "benchmarks/offload_gpu.py: none vs save_on_cpu vs ours",
        ">= 40% less activation memory at <= 5% time, faster than save_on_cpu",
    ),
    Part(
        "moe",
        0.21,
        "MoE fwd+bwd, bf16, E=64, K=8, H=2048, F=1024, 8,192 tokens",
        "sorted compiled >= 2x the loop and no slower than transformers grouped",
    ),
    Part(
        "exchange",
        0.08,
        "exchange CUDA side in one process: staging copies, per-pack events, side stream",
        "packs bit-exact; training stream waits on its pack's event only; copies overlap compute",
    ),
    Part(
        "encoder",
        0.04,
        "encode_images with a route on one GPU: the return all_to_all on NCCL (to itself)",
        "rows and gradients = plain encoder call (bf16 tol); 0 host syncs; return cost in ms",
    ),
    Part(
        "collectives",
        0.03,
        "FSDP2 on one GPU (NCCL) with the monitor's collective_wait: CUDA events on the stream",
        "every FSDP call timed; 0 host syncs added; phases <= the step's wall time",
    ),
)
PART_NAMES = tuple(p.name for p in PARTS)


# ---------------------------------------------------------------------------------------------
# child side: the new measurements (``--part NAME``); each returns one JSON-able dict
# ---------------------------------------------------------------------------------------------


def _emit(obj: dict) -> None:
    """Prints a (partial) result as one JSON line: on a timeout the parent keeps the last one."""
    print_json(obj)


def _median_ms(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median of ``reps`` calls after ``warmup``: CUDA events on the GPU, else the host clock."""
    return median_ms(fn, reps=reps, warmup=warmup, clock=cuda_ms if cuda else wall_ms)


def part_attention(smoke: bool) -> dict:
    """packed_attention's backends vs a float32 reference computed per document."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_vlmbalance import attention as attn

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        lens, H, Hkv, Dh, dtype = [1, 4000, 1500, 700, 1967, 24], 16, 4, 128, torch.bfloat16
        warmup, reps = 3, 10
    else:
        lens, H, Hkv, Dh, dtype = [1, 120, 37, 92, 6], 4, 2, 32, torch.float32
        warmup, reps = 1, 2
    T, causal = sum(lens), True
    torch.manual_seed(0)
    q = torch.randn(T, H, Dh, device=device).to(dtype)
    k = torch.randn(T, Hkv, Dh, device=device).to(dtype)
    v = torch.randn(T, Hkv, Dh, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_dev = cu.to(device)
    max_len = max(lens)

    # reference: each document alone, float32, the math kernel, on the same rounded inputs
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference, not TF32
    ref = []
    with sdpa_kernel(SDPBackend.MATH):
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qd = q[s:e].float().transpose(0, 1)[None]
            kd = k[s:e].float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)[None]
            vd = v[s:e].float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)[None]
            ref.append(
                F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)[0].transpose(0, 1)
            )
    rows: dict[str, dict] = {}
    candidates = ["varlen", "flash_attn", "sdpa"]
    for backend in candidates:
        if backend != "sdpa" and not cuda:
            rows[backend] = {"status": "skipped", "reason": "needs CUDA fp16/bf16"}
            continue
        if backend == "flash_attn" and not attn.flash_attn_available():
            rows[backend] = {"status": "skipped", "reason": "flash-attn not installed"}
            continue
        if backend == "varlen" and attn._varlen_attn is None:
            rows[backend] = {"status": "skipped", "reason": "no torch.nn.attention.varlen"}
            continue
        try:
            with torch.no_grad():
                out = attn.packed_attention(q, k, v, cu_dev, max_len, causal, backend=backend)
            errs = [
                (out[s:e].float() - r).abs().max().item() if e > s else 0.0
                for s, e, r in zip(cu[:-1].tolist(), cu[1:].tolist(), ref)
            ]
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            grad = torch.randn_like(out)

            def fwd(qg=qg, kg=kg, vg=vg, backend=backend):
                with torch.no_grad():
                    attn.packed_attention(qg, kg, vg, cu_dev, max_len, causal, backend=backend)

            def fwd_bwd(qg=qg, kg=kg, vg=vg, backend=backend, grad=grad):
                o = attn.packed_attention(qg, kg, vg, cu_dev, max_len, causal, backend=backend)
                o.backward(grad)

            rows[backend] = {
                "status": "ok",
                "max_err": max(errs),
                "max_err_per_doc": [float(f"{x:.3g}") for x in errs],
                "fwd_ms": _median_ms(fwd, warmup, reps, cuda),
                "fwd_bwd_ms": _median_ms(fwd_bwd, warmup, reps, cuda),
            }
        except Exception as err:  # one backend failing is a result, not the end of the part
            rows[backend] = {"status": "fail", "reason": f"{type(err).__name__}: {err}"[:500]}
        _emit({"partial": True, "backends": rows})
    sdpa_err = rows["sdpa"].get("max_err")
    floor = 2e-2 if dtype != torch.float32 else 1e-4
    bound = None if sdpa_err is None else max(2 * sdpa_err, floor)
    measured = {b: r for b, r in rows.items() if r["status"] == "ok"}
    goal_met = (
        None
        if bound is None
        else all(r["max_err"] <= bound for r in measured.values())
        and all(r["status"] != "fail" for r in rows.values())
    )
    sdpa_ms = rows["sdpa"].get("fwd_bwd_ms")
    for r in measured.values():
        if sdpa_ms:
            r["fwd_bwd_speedup_vs_sdpa"] = sdpa_ms / r["fwd_bwd_ms"]
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "tokens": T,
        "doc_lens": lens,
        "heads": H,
        "kv_heads": Hkv,
        "head_dim": Dh,
        "causal": causal,
        "auto_backend": attn.attention_backend(q),
        "error_bound": bound,
        "backends": rows,
        "goal_met": goal_met,
    }


def part_monitor(smoke: bool) -> dict:
    """StragglerMonitor in a real Lightning fit, switched on and off in ABBA blocks."""
    import tempfile

    import lightning as L
    import torch

    import lightning_vlmbalance as vb
    from examples.train import VLMDataModule
    from examples.vlm import ToyVLM
    from lightning_vlmbalance.synthetic import synthetic_length_table
    from lightning_vlmbalance.timing import DEVICE_PHASES, StepTimer

    cuda = torch.cuda.is_available() and not smoke
    if cuda:
        seq_len, block, blocks, accumulate, samples = 4096, 6, 8, 2, 6000
        model_kw = dict(dim=1024, heads=16, vision_layers=4, llm_layers=8, vocab_size=32000)
        tile_tokens = 64
    else:
        seq_len, block, blocks, accumulate, samples = 128, 2, 4, 2, 600
        model_kw = dict(dim=32, heads=2, vision_layers=1, llm_layers=1, vocab_size=64)
        tile_tokens = 8
    L.seed_everything(0, verbose=False)
    table = synthetic_length_table(
        samples, text_share=0.2, tile_tokens=tile_tokens, max_text_tokens=seq_len // 2, seed=0
    )
    data = VLMDataModule(table, seq_len=seq_len, patch_dim=32, vocab_size=model_kw["vocab_size"])
    model = ToyVLM(max_positions=seq_len, patch_dim=32, **model_kw)
    tmp = tempfile.mkdtemp(prefix="gpu_check_monitor_")
    # no gather while blocks are timed: the gather every log_every_n_steps is a (documented) sync
    total_steps = block * (blocks + 1)
    monitor = vb.StragglerMonitor(log_every_n_steps=total_steps + 1, jsonl_dir=tmp)
    syncs: list[Any] = []

    class Toggle(L.Callback):
        """ABBA blocks of ``block`` optimizer steps (block 0 is warm-up, monitor on)."""

        def __init__(self) -> None:
            self.blocks: list[dict] = []
            self.t0 = 0.0
            self.n_sync = 0
            self.last = 0

        def _mark(self) -> None:
            self.n_sync = len(syncs)  # before our own synchronize: it lands in the next block
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_start(self, trainer, pl_module):
            monitor.enabled = True
            self._mark()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == self.last or step % block:
                return
            self.last = step
            n_sync = len(syncs) - self.n_sync
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.t0
            self.blocks.append(
                {"on": monitor.enabled, "seconds": seconds, "last_step": step, "syncs": n_sync}
            )
            k = step // block  # the block starting now
            monitor.enabled = (k % 4) in (0, 3)
            self._mark()

    toggle = Toggle()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=total_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, toggle],
        default_root_dir=tmp,
    )

    def count_syncs(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):  # torch's sync debug mode: a synchronizing operation
            syncs.append(lineno)

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        if cuda:
            warnings.simplefilter("always")
            warnings.showwarning = count_syncs
            torch.cuda.set_sync_debug_mode("warn")
        trainer.fit(model, datamodule=data)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    measured = toggle.blocks[1:]  # block 0: warm-up
    on = [b for b in measured if b["on"]]
    off = [b for b in measured if not b["on"]]
    steps_on = {s for b in on for s in range(b["last_step"] - block + 1, b["last_step"] + 1)}
    records = [json.loads(line) for line in Path(monitor.jsonl_path).read_text().splitlines()]
    phase_sum = [sum(r["phases_ms"].values()) for r in records if r["global_step"] in steps_on]
    # device phases are disjoint stretches of the training stream; the host phases (data,
    # lightning_sync) may overlap device work queued before them, so only these must fit
    device_sum = [
        sum(r["phases_ms"][k] for k in DEVICE_PHASES)
        for r in records
        if r["global_step"] in steps_on
    ]
    host_step = [r["step_ms"] for r in records if r["global_step"] in steps_on]
    wall_on_ms = sum(b["seconds"] for b in on) * 1e3
    rate_on = statistics.median(block / b["seconds"] for b in on) if on else None
    rate_off = statistics.median(block / b["seconds"] for b in off) if off else None
    syncs_on = sum(b["syncs"] for b in on) / max(len(on) * block, 1)
    syncs_off = sum(b["syncs"] for b in off) / max(len(off) * block, 1)

    # the timing core alone, in a tight loop: its host cost per micro-batch with this clock
    timer = StepTimer("cuda" if cuda else "cpu")
    loops = 300
    t0 = time.perf_counter()
    for s in range(loops):
        for _ in range(accumulate):
            timer.start("data", host=True)
            timer.stop("data")
            timer.set_features({"pack_id": 1, "total_tokens": seq_len})
            for phase in ("vision_fwd", "llm_fwd"):
                timer.start(phase)
                timer.stop(phase)
            timer.start("backward")
            timer.stop_backward()
            timer.end_micro()
        timer.start("optimizer")
        timer.stop("optimizer")
        timer.end_step(s, 0)
        for done in timer.drain():
            json.dumps(done.to_json(0, 1))
    timer_us = (time.perf_counter() - t0) / (loops * accumulate) * 1e6
    step_ms = 1e3 / rate_on if rate_on else None
    timer_frac = timer_us * 1e-3 * accumulate / step_ms if step_ms else None
    phase_over_wall = sum(phase_sum) / wall_on_ms if wall_on_ms and phase_sum else None
    device_over_wall = sum(device_sum) / wall_on_ms if wall_on_ms and device_sum else None
    added = syncs_on - syncs_off if cuda else None
    goal_met = None
    if cuda and timer_frac is not None and device_over_wall is not None:
        goal_met = added <= 0 and timer_frac <= 0.01 and device_over_wall <= 1.02
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "lightning": L.__version__,
        "seq_len": seq_len,
        "model": model_kw,
        "params": sum(p.numel() for p in model.parameters()),
        "accumulate": accumulate,
        "steps_per_block": block,
        "blocks_on": len(on),
        "blocks_off": len(off),
        "steps_per_s_on": rate_on,
        "steps_per_s_off": rate_off,
        "overhead_frac": 1 - rate_on / rate_off if rate_on and rate_off else None,
        "timer_us_per_micro_batch": timer_us,
        "timer_frac_of_step": timer_frac,
        "phase_sum_over_wall": phase_over_wall,
        "device_phase_sum_over_wall": device_over_wall,
        "median_phase_sum_ms": statistics.median(phase_sum) if phase_sum else None,
        "median_host_step_ms": statistics.median(host_step) if host_step else None,
        "syncs_per_step_on": syncs_on if cuda else None,
        "syncs_per_step_off": syncs_off if cuda else None,
        "syncs_added_per_step": added,
        "note": None if cuda else "no CUDA: host clock; sync counting not exercised",
        "goal_met": goal_met,
    }


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", ROOT / "benchmarks" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def part_moe(smoke: bool) -> dict:
    """benchmarks/moe_routing.py's modules, timed on the device (that script is CPU-only)."""
    import torch

    bench = _load_script("moe_routing.py")
    cuda = torch.cuda.is_available() and not smoke
    # OLMoE-1B-7B's layer (hidden 2,048, 64 experts of 1,024, top-8) on 8,192 tokens; on the CPU
    # a tiny one, compiled with the "eager" backend (the same graph capture, no inductor)
    T, E, K, H, Fh = (8192, 64, 8, 2048, 1024) if cuda else (64, 8, 2, 16, 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup, reps, backend = (3, 10, "inductor") if cuda else (1, 1, "eager")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    router_w = torch.randn(E, H) / H**0.5
    gate_up = torch.randn(E, 2 * Fh, H) / H**0.5
    down = torch.randn(E, H, Fh) / Fh**0.5
    x = torch.randn(T, H, device=device, dtype=dtype)
    probe = torch.randn(T, H, device=device, dtype=dtype)
    ours = bench.SortedExperts(router_w, gate_up, down, K).to(device, dtype)
    paths: dict[str, Any] = {
        "loop": bench.LoopExperts(router_w, gate_up, down, K).to(device, dtype),
        "sorted_eager": ours,
        "hf_grouped": bench._hf_block(router_w, gate_up, down, K),
        "sorted_compiled": torch.compile(ours, fullgraph=True, backend=backend),
    }
    if paths["hf_grouped"] is not None:
        paths["hf_grouped"] = paths["hf_grouped"].to(device, dtype)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "tokens": T,
        "experts": E,
        "topk": K,
        "hidden": H,
        "ffn": Fh,
        "dtype": str(dtype),
        "compile_backend": backend,
        "ms": {},
        "max_rel_err": {},
    }
    with torch.no_grad():
        ref = paths["loop"](x).float()
    for name, module in paths.items():
        if module is None:
            out["ms"][name] = None
            out["hf_note"] = "transformers not installed"
            continue

        def step(module=module):
            xi = x.detach().requires_grad_()
            (module(xi) * probe).sum().backward()

        t0 = time.perf_counter()
        out["ms"][name] = _median_ms(step, warmup, reps, cuda)
        out.setdefault("seconds", {})[name] = time.perf_counter() - t0  # compilation included
        if name != "loop":
            # with autograd on, as timed (no_grad would make dynamo compile a second graph)
            got = module(x.detach().requires_grad_()).detach().float()
            out["max_rel_err"][name] = ((got - ref).abs().max() / ref.abs().max()).item()
        for p in module.parameters():
            p.grad = None
        _emit({"partial": True, **out})
    ms = out["ms"]
    out["loop_over_compiled"] = ms["loop"] / ms["sorted_compiled"]
    out["loop_over_eager"] = ms["loop"] / ms["sorted_eager"]
    hf = ms["hf_grouped"]
    out["hf_grouped_over_compiled"] = hf / ms["sorted_compiled"] if hf else None
    if cuda and hf:
        out["goal_met"] = out["loop_over_compiled"] >= 2 and ms["sorted_compiled"] <= hf
    else:
        out["goal_met"] = None
    return out


def _example_pack(i: int, big: bool) -> dict:
    """A pack shaped like PackCollator's output (pixel patches as bf16)."""
    import torch

    g = torch.Generator().manual_seed(i)
    tokens, patches, patch_dim = (8192, 4096, 1176) if big else (64, 16, 8)
    return {
        "input_ids": torch.randint(0, 32000, (tokens,), generator=g),
        "position_ids": torch.arange(tokens),
        "labels": torch.randint(-100, 32000, (tokens,), generator=g),
        "pixel_values": torch.randn(patches, patch_dim, generator=g).to(torch.bfloat16),
        "image_positions": torch.arange(patches) * 2,
        "image_cu_seqlens": torch.tensor([0, patches // 2, patches], dtype=torch.int32),
        "image_max_seqlen": patches // 2,
        "meta": {"pack_id": i, "total_tokens": tokens, "image_tokens": patches, "kind": "check"},
    }


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def part_exchange(smoke: bool) -> dict:
    """The exchange's device side: staging copies on the side stream, per-pack ready events.

    The module's own code runs for encoding (``encode_pack``), the side-stream context
    (``on_stream``), the per-pack events and decoding (``_decode_received``, with no NCCL work
    to wait for) and the training stream's wait (``wait_pack_ready``). The staging copy and the
    receive buffer are written here as ``_send_specs`` / ``_recv_specs`` do them (they post
    point-to-point messages, which need a second rank); a device-to-device copy stands in for
    the NCCL transfer."""
    import torch

    from lightning_vlmbalance.balance import exchange as ex

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    n_packs = 8 if cuda else 3
    packs = {p: _example_pack(p, big=cuda) for p in range(n_packs)}
    encoded, encode_s = timed(lambda: {p: ex.encode_pack(pack) for p, pack in packs.items()})
    encode_ms = encode_s * 1e3 / n_packs
    payload_mib = sum(pl.numel() for _, pl in encoded.values()) / n_packs / (1 << 20)
    pinned, pin_s = timed(
        lambda: {p: pl.pin_memory() if cuda else pl for p, (_, pl) in encoded.items()}
    )
    pin_ms = pin_s * 1e3 / n_packs
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "packs": n_packs,
        "payload_mib_per_pack": payload_mib,
        "encode_ms_per_pack": encode_ms,
        "pin_ms_per_pack": pin_ms if cuda else None,
    }
    side = torch.cuda.Stream(device) if cuda else None
    events: dict[int, Any] = {}
    incoming = [(p, 1) for p in packs]
    with ex.on_stream(device, side):
        buffers = {}
        for p, (spec, _) in encoded.items():
            staged = pinned[p].to(device, non_blocking=True)  # as _send_specs stages a payload
            buf = torch.empty(staged.numel(), dtype=torch.uint8, device=device)  # _recv_specs
            buf.copy_(staged, non_blocking=True)  # stands in for the NCCL transfer
            buffers[p] = (spec, buf)
        # no host wait (as exchange_packs on CUDA): each pack's event is recorded on the side
        # stream after its own transfer
        received = ex._decode_received(incoming, buffers, {}, cuda, side, events)
    out["bit_exact"] = all(_same(received[p], packs[p]) for p in packs)
    out["events_per_pack"] = sorted(events) == sorted(packs) if cuda else None
    if not cuda:
        out["note"] = "no CUDA: stream/event path not exercised (encode, decode on the CPU only)"
        out["goal_met"] = None
        return out

    # the training stream waits on one pack's event, not on what the side stream does next
    main = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the next global batch's transfer, ~0.1 s of work
        side_later = torch.cuda.Event()
        side_later.record(side)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex.wait_pack_ready(received[0], events[0])
        checksum = received[0]["pixel_values"].float().sum()
        main_done = torch.cuda.Event()
        main_done.record(main)
    torch.cuda.set_sync_debug_mode(0)
    main_done.synchronize()
    out["waits_on_pack_event_only"] = not side_later.query()
    out["syncs_in_wait_pack_ready"] = sum("synchroniz" in str(w.message) for w in caught)
    out["checksum_finite"] = bool(torch.isfinite(checksum).item())
    torch.cuda.synchronize()

    # staging copies on the side stream vs compute on the training stream: overlap
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    reps = 6  # copies of the whole pack set

    def compute(n: int = 30) -> None:
        for _ in range(n):
            a @ a

    def copies() -> None:
        with torch.cuda.stream(side):
            for _ in range(reps):
                for p in packs:
                    buffers[p][1].copy_(pinned[p], non_blocking=True)

    def synced_ms(*fns) -> float:
        """Host milliseconds from an idle device to an idle device again, ``fns`` in between."""
        torch.cuda.synchronize()
        t = time.perf_counter()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    synced_ms(compute, copies)  # warm-up
    c_ms = statistics.median(synced_ms(compute) for _ in range(3))
    x_ms = statistics.median(synced_ms(copies) for _ in range(3))
    w_ms = statistics.median(synced_ms(copies, compute) for _ in range(3))
    out["h2d_gib_per_s"] = reps * n_packs * payload_mib / 1024 / (x_ms / 1e3)
    out["compute_ms"], out["copies_ms"], out["together_ms"] = c_ms, x_ms, w_ms
    out["overlap_frac"] = max(0.0, min(1.0, (c_ms + x_ms - w_ms) / min(c_ms, x_ms)))
    if out["gpus"] >= 2:
        test = "tests/balance/test_exchange.py::test_packs_arrive_intact_over_nccl_on_a_side_stream"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out["nccl_test"] = "pass" if proc.returncode == 0 else proc.stdout[-1500:]
    else:
        out["nccl_test"] = None
        out["note"] = (
            f"NCCL needs two GPUs ({out['gpus']} present): the payload transfer between ranks"
            " is not exercised here (tests/balance/test_exchange.py::"
            "test_packs_arrive_intact_over_nccl_on_a_side_stream on a 2-GPU machine)"
        )
    out["goal_met"] = bool(
        out["bit_exact"]
        and out["events_per_pack"]
        and out["waits_on_pack_event_only"]
        and out["syncs_in_wait_pack_ready"] == 0
        and out["overlap_frac"] >= 0.8
        and out["nccl_test"] in (None, "pass")
    )
    return out


def part_encoder(smoke: bool) -> dict:
    """Encoder balancing's step-path code on one device: ``encode_images`` with a route that
    keeps some images and "sends" the last one to rank 0 of a 1-rank group (itself), so the
    return's ``all_to_all`` and its backward run for real (NCCL on the GPU, gloo on the CPU).
    The embeddings and the encoder's gradients must equal the plain call; the routed call must
    add no host synchronisation; the cost of the route over the plain call is timed. The pixel
    transfer between ranks is the pack exchange's (part ``exchange``); returns between two GPUs
    are not checked here (one GPU)."""
    import os

    import torch
    import torch.distributed as dist

    import lightning_vlmbalance as vb
    from lightning_vlmbalance.balance.encoder import ImageRoute, ReturnChannel

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_000 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    channel = ReturnChannel()  # the world group
    sizes = [1280, 768, 1280, 768, 1280] if cuda else [12, 8, 12]
    width = 1176 if cuda else 16  # Qwen-VL's patch row: 3 x 2 x 14 x 14
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(
        torch.nn.Linear(width, 1024 if cuda else 32), torch.nn.GELU(), torch.nn.Linear(
            1024 if cuda else 32, 1024 if cuda else 32)
    ).to(device, dtype)  # fmt: skip

    def run(pixels: torch.Tensor, cu: torch.Tensor, mx: int) -> torch.Tensor:
        return encoder(pixels)

    rows = sum(sizes)
    pixels = torch.randn(rows, width, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    plain = {
        "pixel_values": pixels,
        "image_cu_seqlens": cu.to(device),
        "image_max_seqlen": max(sizes),
    }
    last = len(sizes) - 1
    routed = {
        **plain,
        "encoder_route": ImageRoute(
            group=channel,
            rank=0,
            world=1,
            own_sizes=sizes,
            keep=list(range(last)),
            send=[[last]],
            recv_sizes=[[sizes[last]]],
        ),
        "encoder_fields": {"pixel_values": pixels[rows - sizes[last] :]},
    }

    def step(batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        encoder.zero_grad(set_to_none=True)
        out = vb.encode_images(run, batch)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.detach().clone() for p in encoder.parameters()]

    want, want_grads = step(plain)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_grads = step(routed)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    tol = 2e-2 if cuda else 1e-5
    out_err = float((got.float() - want.float()).abs().max())
    grad_err = max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
        for a, b in zip(got_grads, want_grads)
    )
    reps, warmup = (20, 5) if cuda else (3, 1)
    plain_ms = _median_ms(lambda: step(plain), warmup, reps, cuda)
    routed_ms = _median_ms(lambda: step(routed), warmup, reps, cuda)
    dist.destroy_process_group()
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": "nccl" if cuda else "gloo",
        "images": len(sizes),
        "image_tokens": rows,
        "max_abs_err": out_err,
        "grad_rel_err": grad_err,
        "host_syncs": sum("synchroniz" in str(w.message) for w in caught) if cuda else None,
        "plain_ms": plain_ms,
        "routed_ms": routed_ms,
        "route_cost_ms": routed_ms - plain_ms,
    }
    out["goal_met"] = (
        bool(out_err <= tol and grad_err <= tol and out["host_syncs"] == 0) if cuda else None
    )
    return out


def part_collectives(smoke: bool) -> dict:
    """The waits inside FSDP2's collectives on the GPU (``timing/collectives.py``): a small
    model fully sharded over a 1-rank mesh (NCCL), timed by a CUDA ``StepTimer`` with
    ``time_collectives``. One GPU cannot make a rank wait for another: this checks the code
    path (every unshard / wait / reduce-scatter call becomes a ``collective_wait`` interval of
    CUDA events on the compute stream, excluded from the phase around it) and that it adds no
    host synchronisation; the waits themselves need 2 GPUs (``benchmarks/fsdp_waits.py``)."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_vlmbalance.timing import StepTimer, time_collectives

    cuda = torch.cuda.is_available() and not smoke
    device = "cuda" if cuda else "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    width, layers = (2048, 8) if cuda else (32, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model.to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    timer = StepTimer(device_clock="cuda" if cuda else "cpu")
    timed = time_collectives(timer, model)
    registered = timed is not None
    x = torch.randn(4096 if cuda else 16, width, device=device)
    steps = 6
    walls = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            t0 = time.perf_counter()
            timer.start("llm_fwd")
            loss = model(x).square().mean()
            timer.stop("llm_fwd")
            timer.start("backward")
            loss.backward()
            timer.stop_backward()
            timer.end_micro()
            timer.end_step(step + 1, 0)
            walls.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    resolved = timer.drain()
    if timed is not None:
        timed.remove()
    dist.destroy_process_group()
    calls = [len(r.collective_calls_ms) for r in resolved]
    waits = [r.phases_ms["collective_wait"] for r in resolved]
    phase_sum = [sum(r.phases_ms.values()) for r in resolved]
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "registered": registered,
        "steps_resolved": len(resolved),
        "calls_per_step": calls,
        "collective_wait_ms": [round(w, 3) for w in waits],
        "phase_sum_over_step": [
            round(a / max(r.step_ms, 1e-9), 3) for a, r in zip(phase_sum, resolved)
        ],
        "host_syncs": sum("synchroniz" in str(w.message) for w in caught) if cuda else None,
    }
    out["goal_met"] = (
        bool(
            registered
            and len(resolved) == steps
            and min(calls) > 0
            and out["host_syncs"] == 0
            and max(out["phase_sum_over_step"]) <= 1.05
        )
        if cuda
        else None
    )
    return out


CHILD_PARTS = {"attention": part_attention, "monitor": part_monitor, "moe": part_moe,
               "exchange": part_exchange, "encoder": part_encoder,
               "collectives": part_collectives}  # fmt: skip


def _child(name: str, smoke: bool) -> None:
    import torch

    if smoke:
        torch.set_num_threads(1)
    if name == "_fail":
        print("forced failure (--fail-part)", flush=True)
        raise SystemExit(3)
    _emit(CHILD_PARTS[name](smoke))


# ---------------------------------------------------------------------------------------------
# parent side: the parts as child processes, the table, the JSON
# ---------------------------------------------------------------------------------------------


def _last_json(text: str) -> dict | None:
    """The last JSON object in ``text``: a one-line object, or one spread over the lines from
    a line that starts with ``{`` to the end (``json.dumps(indent=2)``)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith("{"):
            continue
        for candidate in (lines[i], "\n".join(lines[i:])):
            try:
                obj = json.loads(candidate)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def _gpu_test_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    )


def _command(part: str, smoke: bool, fail_part: str | None) -> list[str]:
    py = sys.executable
    if part == fail_part:
        return [py, str(Path(__file__).resolve()), "--part", "_fail"]
    if part == "pytest":
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                *_gpu_test_files()]  # fmt: skip
    if part == "offload":
        args = ["--tiny"] if smoke else ["--steps", "5", "--warmup", "2"]
        return [py, "benchmarks/offload_gpu.py", *args, "--json"]
    return [py, str(Path(__file__).resolve()), "--part", part, *(["--smoke"] if smoke else [])]


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _summarize(part: str, result: dict | None, smoke: bool) -> tuple[str, bool | None]:
    """Key numbers (one table cell) and whether the goal is met (None: not measured)."""
    if not result:
        return "", None
    if part == "pytest":
        return result.get("summary", ""), result.get("goal_met")
    if part == "attention":
        cells = []
        for b, r in result["backends"].items():
            if r["status"] == "ok":
                cells.append(f"{b} err {_fmt(r['max_err'])}, {_fmt(r['fwd_bwd_ms'])} ms f+b")
            else:
                cells.append(f"{b} {r['status']} ({r.get('reason', '')[:60]})")
        return f"{result['tokens']} tok {result['dtype']}: " + "; ".join(cells), result.get(
            "goal_met"
        )
    if part == "monitor":
        cells = [
            f"{_fmt(result['steps_per_s_on'])} vs {_fmt(result['steps_per_s_off'])} steps/s"
            f" (overhead {_fmt(result['overhead_frac'], '+.1%')})",
            f"timer {_fmt(result['timer_us_per_micro_batch'], '.0f')} us/micro-batch"
            f" ({_fmt(result['timer_frac_of_step'], '.2%')} of a step)",
            f"phases/wall {_fmt(result['phase_sum_over_wall'], '.2f')}"
            f" (device {_fmt(result.get('device_phase_sum_over_wall'), '.2f')})",
            f"syncs added/step {_fmt(result['syncs_added_per_step'])}",
        ]
        return "; ".join(cells), result.get("goal_met")
    if part == "offload":
        rows = result["results"]
        cells = []
        for name, r in rows.items():
            mem = r.get("activation_mem_vs_none")
            cells.append(
                f"{name} {r['step_ms']:.1f} ms ({r['time_vs_none']:.2f}x)"
                + ("" if smoke else f" {r['peak_activation_mib']:.0f} MiB ({_fmt(mem, '.2f')}x)")
            )
        goal = None
        if not smoke and "save_on_cpu" in rows:
            soc = rows["save_on_cpu"]["step_ms"]
            goal = any(
                r["activation_mem_vs_none"] is not None
                and r["activation_mem_vs_none"] <= 0.60
                and r["time_vs_none"] <= 1.05
                and r["step_ms"] < soc
                for name, r in rows.items()
                if name.startswith("ours")
            )
        return "; ".join(cells), goal
    if part == "moe":
        ms = result["ms"]
        cells = [f"E={result['experts']} K={result['topk']} H={result['hidden']} {result['dtype']}"]
        cells += [f"{k} {_fmt(v, '.1f')} ms" for k, v in ms.items()]
        if "loop_over_compiled" in result:
            cells.append(f"loop/compiled {_fmt(result['loop_over_compiled'], '.2f')}x")
        return "; ".join(cells), result.get("goal_met")
    if part == "exchange":
        if result.get("h2d_gib_per_s") is None:
            return (
                f"{result['packs']} packs bit-exact={result['bit_exact']}; {result.get('note', '')}"
            ), result.get("goal_met")
        cells = [
            f"bit-exact {result['bit_exact']}",
            f"waits on pack event only {result['waits_on_pack_event_only']}",
            f"H2D {result['h2d_gib_per_s']:.1f} GiB/s",
            f"overlap {result['overlap_frac']:.0%}",
            "NCCL: " + (f"test {result['nccl_test']}" if result["nccl_test"] else "needs 2 GPUs"),
        ]
        return "; ".join(cells), result.get("goal_met")
    if part == "encoder":
        cells = [
            f"{result['images']} images {result['backend']}",
            f"err {_fmt(result['max_abs_err'])} (grads {_fmt(result['grad_rel_err'])})",
            f"host syncs {_fmt(result['host_syncs'])}",
            f"plain {_fmt(result['plain_ms'])} ms, routed {_fmt(result['routed_ms'])} ms",
        ]
        return "; ".join(cells), result.get("goal_met")
    if part == "collectives":
        waits = result["collective_wait_ms"]
        cells = [
            f"registered {result['registered']}",
            f"calls/step {result['calls_per_step'][-1] if result['calls_per_step'] else 0}",
            f"wait {_fmt(waits[-1] if waits else None)} ms",
            f"host syncs {_fmt(result['host_syncs'])}",
        ]
        return "; ".join(cells), result.get("goal_met")
    return "", None


def _pytest_result(text: str) -> dict:
    counts = {
        kind: int(n)
        for n, kind in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", text[-2000:]
        )
    }
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no summary line"
    return {"counts": counts, "summary": summary}


def _run_part(
    part: Part, timeout_s: float, smoke: bool, fail_part: str | None, out_dir: Path | None
) -> dict:
    cmd = _command(part.name, smoke, fail_part)
    row: dict[str, Any] = {"part": part.name, "what": part.what, "goal": part.goal,
                           "timeout_s": round(timeout_s, 1), "command": cmd}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    if smoke:
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends its children too
    )
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout_s, 0.01))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["returncode"] = proc.returncode
    if out_dir is not None:
        (out_dir / f"part_{part.name}.log").write_text(
            f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    if part.name == "pytest" and part.name != fail_part:
        result = _pytest_result(stdout)
        result["goal_met"] = (
            proc.returncode == 0 and not timed_out and result["counts"].get("passed", 0) > 0
        )
    else:
        result = _last_json(stdout)
    row["result"] = result
    if timed_out:
        row["status"] = "TIMEOUT"
    elif proc.returncode != 0 or result is None or result.get("partial"):
        row["status"] = "FAIL"
    else:
        row["status"] = "ok"
    if row["status"] != "ok":
        row["output_tail"] = (stdout + "\n--- stderr\n" + stderr)[-TAIL_CHARS:]
    try:
        row["key"], row["goal_met"] = _summarize(part.name, result, smoke)
    except Exception as err:  # a partial result may lack what a summary needs
        row["key"], row["goal_met"] = f"(partial: {type(err).__name__}: {err})", None
    if row["status"] != "ok":
        row["goal_met"] = None if row["goal_met"] is not True else row["goal_met"]
    return row


def _skipped(part: Part, reason: str, **extra: Any) -> dict:
    return {"part": part.name, "what": part.what, "goal": part.goal, "status": "skipped",
            "reason": reason, "seconds": 0.0, "key": reason, "goal_met": None,
            "result": None, **extra}  # fmt: skip


def _table(rows: list[dict]) -> str:
    lines = ["| part | status | s | key numbers | goal |", "| --- | --- | ---: | --- | --- |"]
    for r in rows:
        goal = {True: "met", False: "NOT met", None: "-"}[r.get("goal_met")]
        key = str(r.get("key", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['part']} | {r['status']} | {r['seconds']:.1f} | {key} | {goal} |")
    return "\n".join(lines)


def _machine() -> dict:
    """Python, platform, CPUs, the packages the parts use, and the GPUs torch sees."""
    gpus: dict[str, Any] = {"gpus": 0}
    try:
        import torch  # first: its own __version__ is the version reported

        # device_count does not create a CUDA context in this process (children measure)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = {"cuda": torch.version.cuda, "gpus": count}
    except ImportError:
        pass
    return {**environment("torch", "lightning", "transformers", "flash_attn", "pytest"), **gpus}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every part on the CPU, tiny sizes")
    add_json_flag(p)
    p.add_argument("--out", type=Path, help="also write gpu_check.md/.json and part logs here")
    p.add_argument("--budget-s", type=float, default=480.0, help="all parts together")
    p.add_argument("--parts", default=",".join(PART_NAMES), help="comma list, in run order")
    p.add_argument(
        "--jobs", type=int, default=2, help="--smoke only: parts run at once (GPU: one at a time)"
    )
    p.add_argument("--part", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--fail-part", help=argparse.SUPPRESS)  # testing: this part fails
    p.add_argument("--timeout-part", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        _child(args.part, args.smoke)
        return 0
    chosen = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(PART_NAMES))
    if unknown:
        p.error(f"`--parts` names unknown parts {unknown}; known: {', '.join(PART_NAMES)}")
    forced = {k: float(v) for k, v in (t.split("=", 1) for t in args.timeout_part)}
    parts = [next(q for q in PARTS if q.name == name) for name in chosen]
    machine = _machine()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict] = []
    report: dict[str, Any] = {}

    def write() -> None:
        report.update(
            benchmark="gpu_check",
            smoke=args.smoke,
            date=datetime.date.today().isoformat(),
            machine=machine,
            budget_s=args.budget_s,
            total_s=round(time.perf_counter() - start, 2),
            parts=rows,
            ok=all(r["status"] in ("ok", "skipped") for r in rows),
        )
        if args.out is not None:
            (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
            (args.out / "gpu_check.md").write_text(_table(rows) + "\n")

    total_share = sum(q.share for q in parts)

    def skip_reason(part: Part, timeout_s: float) -> dict | None:
        if part.name == "pytest" and args.smoke and part.name != args.fail_part:
            files = _gpu_test_files()
            return _skipped(
                part,
                f"--smoke: no CUDA here, its {len(files)} gpu-marked files would only skip"
                " (not collected, to keep the smoke run short)",
                files=files,
                command=_command("pytest", False, None),
            )
        if part.name == "pytest" and importlib.util.find_spec("pytest") is None:
            return _skipped(part, "pytest is not installed")
        if not args.smoke and not machine.get("gpus"):
            return _skipped(part, "no CUDA device (use --smoke for a CPU run of every part)")
        if timeout_s < 1.0 and part.name not in forced:
            return _skipped(part, "--budget-s spent before this part")
        return None

    def done(row: dict) -> None:
        rows.append(row)
        print(f"[gpu_check] {row['part']}: {row['status']} in {row['seconds']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        write()

    if args.smoke and args.jobs > 1:
        # CPU smoke run: parts at once (each spends most of its time importing); each keeps
        # its own share of the budget as its limit
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = []
            for part in parts:
                timeout_s = forced.get(part.name, part.share / total_share * args.budget_s)
                row = skip_reason(part, timeout_s)
                futures.append(
                    row
                    if row is not None
                    else pool.submit(
                        _run_part, part, timeout_s, args.smoke, args.fail_part, args.out
                    )
                )
            for future in futures:
                done(future if isinstance(future, dict) else future.result())
    else:
        for i, part in enumerate(parts):
            left = args.budget_s - (time.perf_counter() - start)
            later = sum(q.share for q in parts[i + 1 :]) / total_share * args.budget_s
            # its own share, plus whatever earlier parts left; later parts always keep theirs
            timeout_s = forced.get(part.name, max(left - later, 0.0))
            row = skip_reason(part, timeout_s)
            done(row if row is not None else _run_part(
                part, timeout_s, args.smoke, args.fail_part, args.out))  # fmt: skip
    table = _table(rows)
    print(table)
    for r in rows:
        if r.get("output_tail"):
            print(f"\n{r['part']} ({r['status']}), last output:\n{r['output_tail'][-1500:]}")
    if args.json:
        print_json(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
