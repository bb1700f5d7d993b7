"""Overhead of StragglerMonitor: steps/s of the example VLM with and without it, interleaved.

    python benchmarks/straggler_overhead.py --rounds 5 --steps 120 --json

Each block is a real 2-process CPU DDP fit (gloo) of the example VLM for ``--steps`` optimizer
steps, launched as its own job; blocks with and without the monitor alternate (ABBA order) so slow
drifts of the machine hit both alike. Only the training time is measured (``on_train_start`` to
``on_train_end`` on rank 0, after start-up). ``overhead_frac = 1 - median(with) / median(without)``
of steps/s; the last line of stdout is one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _block(args: argparse.Namespace) -> None:
    """One fit (runs inside Lightning's DDP processes); rank 0 writes its training time."""
    sys.path.insert(0, str(ROOT))
    import lightning as L
    import torch

    import lightning_vlmbalance as vb
    from examples.train import VLMDataModule
    from examples.vlm import ToyVLM

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                Path(args.out).write_text(
                    json.dumps(
                        {
                            "seconds": time.perf_counter() - self.t0,
                            "steps": trainer.global_step,
                        }
                    )
                )

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    table = vb.synthetic_length_table(
        8000, text_share=0.2, tile_tokens=16, max_text_tokens=args.seq_len // 2, seed=0
    )
    data = VLMDataModule(table, seq_len=args.seq_len, patch_dim=32, vocab_size=256)
    model = ToyVLM(max_positions=args.seq_len, moe_experts=4, patch_dim=32, vocab_size=256)
    callbacks: list[L.Callback] = [Clock()]
    if args.block == "with":
        callbacks.append(
            vb.StragglerMonitor(
                log_every_n_steps=args.log_every, jsonl_dir=Path(args.out).parent / "jsonl"
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5, help="ABBA rounds (2 blocks per variant)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--block", choices=["with", "without"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.block:
        _block(args)
        return

    rates: dict[str, list[float]] = {"with": [], "without": []}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (
                ("without", "with", "with", "without")
                if r % 2
                else ("with", "without", "without", "with")
            )
            for k, variant in enumerate(order):
                out = Path(tmp) / f"{r}-{k}-{variant}.json"
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--block",
                    variant,
                    "--out",
                    str(out),
                    "--steps",
                    str(args.steps),
                    "--accumulate",
                    str(args.accumulate),
                    "--seq-len",
                    str(args.seq_len),
                    "--log-every",
                    str(args.log_every),
                ]
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"block failed:\n{proc.stderr[-4000:]}")
                res = json.loads(out.read_text())
                rates[variant].append(res["steps"] / res["seconds"])
                print(f"round {r} {variant:8s} {rates[variant][-1]:.3f} steps/s", flush=True)
    med = {k: float(np.median(v)) for k, v in rates.items()}
    result = {
        "benchmark": "straggler_overhead",
        "steps_per_s_with": round(med["with"], 4),
        "steps_per_s_without": round(med["without"], 4),
        "overhead_frac": round(1 - med["with"] / med["without"], 4),
        "blocks_per_variant": len(rates["with"]),
        "all_with": [round(x, 4) for x in rates["with"]],
        "all_without": [round(x, 4) for x in rates["without"]],
        "steps_per_block": args.steps,
        "accumulate": args.accumulate,
        "ranks": 2,
        "log_every_n_steps": args.log_every,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "python": platform.python_version(),
    }
    print(
        f"overhead {result['overhead_frac']:+.2%} (with {med['with']:.3f},"
        f" without {med['without']:.3f} steps/s)"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
