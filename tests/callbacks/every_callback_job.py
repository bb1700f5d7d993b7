"""A 2-process CPU fit with ``strategy="vlmbalance"`` and every callback of the package at once.

    python -m tests.callbacks.every_callback_job --out DIR [--resume CKPT]

Float64, seeded, 2 micro-batches per step, a checkpoint every 2 optimizer steps in ``DIR/ckpt``.
Every rank writes ``DIR/report{r}.json`` (what each callback did, the state it held when
training started, after a checkpoint was restored, and what was left behind after fit),
``DIR/params{r}.pt`` (its final parameters) and ``DIR/rank{r}.json`` (the packs it trained on);
the StragglerMonitor's JSON lines go to ``DIR/straggler``. Run as a subprocess
(Lightning's DDP launcher re-executes it), from ``tests/callbacks/test_every_callback.py``.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_vlmbalance as vb
from lightning_vlmbalance.synthetic import synthetic_length_table
from tests.packing.lightning_job import SMALL_VLM, Data, RecordingVLM

# threads that are not the package's: torch.compile's tqdm monitor, and Lightning's DDP launcher
# watching the other ranks (rank 0)
FOREIGN_THREADS = frozenset({"tqdm_monitor", "child-process-observer"})
# the training loop's methods that a callback may shadow with instance attributes
LOOP_POINTS = ("_broadcast_sigterm_tensor", "_on_before_fetch", "_on_after_fetch")


def patched_forward(module: torch.nn.Module) -> bool:
    """Whether an instance attribute replaces ``module.forward`` (Lightning's DDP forward
    redirection leaves the module's own bound method there: that is not a patch)."""
    forward = vars(module).get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(module).forward


def leftovers(
    trainer: L.Trainer, model: torch.nn.Module, threads_before: set[threading.Thread]
) -> dict[str, Any]:
    """What a callback could leave behind once fit is over (all empty when nothing is)."""
    modules = list(model.named_modules())
    return {
        "module_hooks": [n for n, m in modules if m._forward_hooks or m._forward_pre_hooks],
        "patched_forwards": [n for n, m in modules if patched_forward(m)],
        "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False)
        is not None,
        "loop_patches": [k for k in LOOP_POINTS if k in vars(trainer.fit_loop.epoch_loop)],
        "optimizer_hooks": sum(
            len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks)
            for o in trainer.optimizers
        ),
        "threads": sorted(
            t.name
            for t in set(threading.enumerate()) - threads_before
            if t.name not in FOREIGN_THREADS
        ),
    }


NOTHING_LEFT = {
    "module_hooks": [],
    "patched_forwards": [],
    "saved_tensor_hooks": False,
    "loop_patches": [],
    "optimizer_hooks": 0,
    "threads": [],
}


# every callback of the package, set up to have work to do on the CPU (``out``: a log folder)
CALLBACKS: dict[str, Callable[[Path], Callback]] = {
    "StragglerMonitor": lambda out: vb.StragglerMonitor(
        log_every_n_steps=1, jsonl_dir=out / "straggler"
    ),
    "ActivationOffload": lambda out: vb.ActivationOffload(
        min_bytes=0, test_mode=True, log_every_n_steps=1
    ),
    "CompiledMoERouting": lambda out: vb.CompiledMoERouting(
        backend="aot_eager", log_every_n_steps=1
    ),
}


class Float64RecordingVLM(RecordingVLM):
    """The example VLM in float64 (the loader yields float32 pixels)."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        batch["pixel_values"] = batch["pixel_values"].double()
        return super().training_step(batch, batch_idx)


def _jsonable(state: Any) -> Any:
    return json.loads(json.dumps(state, default=lambda x: x.tolist()))


class Observer(Callback):
    """Records what the package's callbacks did (placed after them in the callback list)."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = {type(cb).__name__: cb for cb in callbacks}
        self.report: dict[str, Any] = {"micro_batches": 0, "patched": 0, "offloading": 0}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a restored checkpoint has been loaded by now: the state each callback resumes from
        self.report["start_step"] = trainer.global_step
        self.report["state_at_start"] = {
            name: _jsonable(cb.state_dict()) for name, cb in self.callbacks.items()
        }

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any
    ) -> None:
        # per micro-batch: are the MoE forwards patched, is the offloader active
        self.report["micro_batches"] += 1
        self.report["patched"] += any(patched_forward(m) for m in pl_module.modules())
        offload = self.callbacks.get("ActivationOffload")
        self.report["offloading"] += bool(
            offload and offload.offloader and offload.offloader.active
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report["logged"] = sorted(trainer.logged_metrics)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--resume")
    p.add_argument("--max-steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    out = Path(args.out)
    threads_before = set(threading.enumerate())
    table = synthetic_length_table(200, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1)
    callbacks = [make(out) for make in CALLBACKS.values()]
    observer = Observer(callbacks)
    checkpoint = ModelCheckpoint(
        dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="vlmbalance",
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[*callbacks, observer, checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Float64RecordingVLM(str(out), **SMALL_VLM, max_positions=128).double()
    trainer.fit(model, datamodule=Data(table, 128, 0), ckpt_path=args.resume)

    rank = trainer.global_rank
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"params{rank}.pt"
    )
    monitor, offload, routing = callbacks
    report = {
        **observer.report,
        "rank": rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "summary": monitor.summary(),
        "jsonl": [json.loads(x) for x in monitor.jsonl_path.read_text().splitlines()],
        "offload_stats": offload.last_stats,
        "offloader_left": offload.offloader is not None,
        "patched_left": len(routing.patched),
        "leftovers": leftovers(trainer, model, threads_before),
    }
    (out / f"report{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
