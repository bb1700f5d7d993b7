"""Overhead of StragglerMonitor: steps/s of the example VLM with and without it, interleaved.

    python benchmarks/straggler_overhead.py --json                       # --mode toggle
    python benchmarks/straggler_overhead.py --mode processes --rounds 5 --json

Both run a real 2-process CPU DDP fit (gloo) of the example VLM.

- ``toggle`` (default, paired): one long fit with the monitor attached; every ``--block`` optimizer
  steps it is switched on or off (``StragglerMonitor.enabled``, in ABBA order, identically on both
  ranks), and rank 0 times each block. Both variants share the processes, the data and the warm
  caches, so the noise of separate launches cancels out. Its comm hook and patched loop methods stay
  installed in "off" blocks (they return at once), so this measures the monitor's per-step work.
- ``processes``: separate fits with and without the monitor (ABBA order), ``--steps`` each;
  measures everything, including the comm hook's Python path, at the price of much more noise.

``overhead_frac = 1 - median(on) / median(off)`` of steps/s over the blocks; the last line of
stdout is one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import add_json_flag, print_json, stamp, timed

ROOT = Path(__file__).resolve().parents[1]


def _fit(args: argparse.Namespace, callbacks: list, max_steps: int, num_samples: int) -> None:
    """A 2-rank DDP fit of the example VLM (runs inside Lightning's DDP processes)."""
    import lightning as L
    import torch

    from examples.train import VLMDataModule
    from examples.vlm import ToyVLM
    from lightning_vlmbalance.synthetic import synthetic_length_table

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    table = synthetic_length_table(
        num_samples, text_share=0.2, tile_tokens=16, max_text_tokens=args.seq_len // 2, seed=0
    )
    data = VLMDataModule(table, seq_len=args.seq_len, patch_dim=32, vocab_size=256)
    model = ToyVLM(max_positions=args.seq_len, moe_experts=4, patch_dim=32, vocab_size=256)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data)


def _monitor(args: argparse.Namespace):
    import lightning_vlmbalance as vb

    return vb.StragglerMonitor(
        log_every_n_steps=args.log_every, jsonl_dir=Path(args.out).parent / "jsonl"
    )


def _toggle(args: argparse.Namespace) -> None:
    """One fit whose monitor is switched on and off every ``--block`` steps."""
    import lightning as L

    monitor = _monitor(args)

    class Toggle(L.Callback):
        """ABBA: on off off on on off off on ... (block 0 is warm-up and not counted)."""

        def __init__(self) -> None:
            self.blocks: list[tuple[bool, float]] = []
            self.t0 = 0.0
            self.last = 0

        def on_train_start(self, trainer, pl_module):
            monitor.enabled = True
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == self.last or step % args.block:
                return
            self.last = step
            self.blocks.append((monitor.enabled, time.perf_counter() - self.t0))
            k = step // args.block  # the block starting now
            monitor.enabled = (k % 4) in (0, 3)
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                Path(args.out).write_text(json.dumps({"blocks": self.blocks[1:]}))

    _fit(args, [monitor, Toggle()], args.block * (args.blocks + 1), num_samples=60000)


def _block(args: argparse.Namespace) -> None:
    """One fit with or without the monitor; rank 0 writes its training time."""
    import lightning as L

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                seconds = time.perf_counter() - self.t0
                Path(args.out).write_text(
                    json.dumps({"seconds": seconds, "steps": trainer.global_step})
                )

    callbacks = [Clock(), _monitor(args)] if args.child == "with" else [Clock()]
    _fit(args, callbacks, args.steps, num_samples=8000)


def _launch(out: Path, *extra: str) -> dict:
    """Runs this script as a child job (Lightning re-executes it per rank); returns its JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"child run failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=["toggle", "processes"], default="toggle")
    p.add_argument("--blocks", type=int, default=40, help="toggle: timed blocks (after warm-up)")
    p.add_argument("--block", type=int, default=10, help="toggle: optimizer steps per block")
    p.add_argument("--rounds", type=int, default=5, help="processes: ABBA rounds")
    p.add_argument("--steps", type=int, default=120, help="processes: steps per fit")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--log-every", type=int, default=10)
    add_json_flag(p)
    p.add_argument("--child", choices=["with", "without", "toggle"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))
        (_toggle if args.child == "toggle" else _block)(args)
        return
    common = ["--accumulate", str(args.accumulate), "--seq-len", str(args.seq_len),
              "--log-every", str(args.log_every)]  # fmt: skip
    rates: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode == "toggle":
            res = _launch(Path(tmp) / "toggle.json", "--child", "toggle", "--block",
                          str(args.block), "--blocks", str(args.blocks), *common)  # fmt: skip
            for on, seconds in res["blocks"]:
                rates["with" if on else "without"].append(args.block / seconds)
            _report(args, rates, steps_per_block=args.block)
            return
        for r in range(args.rounds):
            abba = ("with", "without", "without", "with")
            baab = ("without", "with", "with", "without")
            for k, variant in enumerate(baab if r % 2 else abba):
                res = _launch(Path(tmp) / f"{r}-{k}.json", "--child", variant,
                              "--steps", str(args.steps), *common)  # fmt: skip
                rates[variant].append(res["steps"] / res["seconds"])
                print(f"round {r} {variant:8s} {rates[variant][-1]:.3f} steps/s", flush=True)
    _report(args, rates, steps_per_block=args.steps)


def _timer_cost_us(micro_batches: int, steps: int = 2000) -> float:
    """Host microseconds the timing core spends per micro-batch, in a tight loop (the monitor's
    direct per-step work: the marks of every phase, the features, closing and draining a step)."""
    sys.path.insert(0, str(ROOT))
    from lightning_vlmbalance.timing import StepTimer

    timer = StepTimer()
    features = {"pack_id": 1, "total_tokens": 512, "image_tokens": 256, "images": 2}

    def run() -> None:
        for s in range(steps):
            for _ in range(micro_batches):
                timer.start("lightning_sync", host=True)
                timer.stop("lightning_sync")
                timer.start("data", host=True)
                timer.stop("data")
                timer.set_features(features)
                for phase in ("vision_fwd", "llm_fwd"):
                    timer.start(phase)
                    timer.stop(phase)
                timer.start("backward")
                timer.mark_sync_entry()
                timer.stop_backward()
                timer.end_micro()
            timer.start("optimizer")
            timer.stop("optimizer")
            timer.end_step(s, 0)
            for step in timer.drain():
                json.dumps(step.to_json(0, 2))

    return timed(run)[1] / (steps * micro_batches) * 1e6


def _report(args: argparse.Namespace, rates: dict[str, list[float]], steps_per_block: int) -> None:
    med = {k: float(np.median(v)) for k, v in rates.items()}
    timer_us = _timer_cost_us(args.accumulate)
    result = {
        "benchmark": "straggler_overhead",
        "mode": args.mode,
        "steps_per_s_with": round(med["with"], 4),
        "steps_per_s_without": round(med["without"], 4),
        "overhead_frac": round(1 - med["with"] / med["without"], 4),
        # the spread of single blocks bounds what the medians can resolve
        "block_spread_frac": round(float(np.std(rates["without"]) / med["without"]), 4),
        "timer_us_per_micro_batch": round(timer_us, 2),
        "timer_frac_of_step": round(timer_us * 1e-6 * args.accumulate * med["with"], 5),
        "blocks_per_variant": len(rates["with"]),
        "all_with": [round(x, 4) for x in rates["with"]],
        "all_without": [round(x, 4) for x in rates["without"]],
        "steps_per_block": steps_per_block,
        "accumulate": args.accumulate,
        "ranks": 2,
        "log_every_n_steps": args.log_every,
        **stamp("torch", "lightning", "numpy"),
    }
    print(
        f"overhead {result['overhead_frac']:+.2%} (with {med['with']:.3f},"
        f" without {med['without']:.3f} steps/s)"
    )
    if args.json:
        print_json(result)


if __name__ == "__main__":
    main()
