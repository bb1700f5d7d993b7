"""The main job: a real multi-process training of the example VLM on the CPU, and the gain.

    python -m examples.train                        # 2 processes (gloo): the five modes
    python -m examples.train --balance-mode source  # one mode alone
    python -m examples.train --strategy ddp         # plain DDP, one run
    python -m examples.train --data a.csv --length-scale 0.0625 --seq-len 512

By default one invocation trains the same data (one epoch) from the same initial weights in
five modes: ``off`` (packs where the sampler put them), ``overlap`` (whole packs exchanged
between ranks in the background), ``source`` (global batches formed by cost in the sampler),
``encoder`` (every pack stays on its rank, ordered over the micro-steps for even vision work, and
each micro-step's images are encoded on the ranks the plan gives them: two-level balancing,
``RebalanceConfig(encoder=True)``) and ``auto`` (the default mode: each global batch priced with
the cost model as the ranks will meet, as placed, packs moved, images routed or both, and the
cheapest taken; ``RebalanceConfig(mode="auto", encoder=True)``). No mode needs a calibration
file: each refits the cost model online from its own StragglerMonitor timings. Each mode trains
``--rounds`` times, the rounds in ABBA order (off, overlap, source, encoder, auto, auto, encoder,
source, overlap, off), so that a change of the machine's load during the job lands on every mode
alike.

The headline is whole-run tokens/s (every mode trains the same samples: the same tokens), summed
over the rounds, and its gain over ``off``; the gain of each round against that round's ``off``
gives the spread. Every mode reads its packs ahead the same way: a thread per rank reads
``--read-ahead`` packs ahead (default 2: one global batch at accumulation 2; ``ReadAheadLoader``),
so ``overlap``'s exchange thread takes packs that are already read, as ``off`` and ``source``
do. What ``overlap``'s thread still hides is the loader's per-global-batch work (the feature
all-gather, which every mode needs for the loss weights, the plan and the exchange); the
``exposed_exchange_ms`` column shows how much of it each mode waits for.

As each run ends it prints one line (mode, round, tokens/s, seconds, median step, waiting, what
moved, and the gain over that round's ``off``: in the backward rounds ``off`` runs last, and its
line gives the round's gains). At the end it prints a side-by-side table and the headline with
its spread (each round's gain and their median), writes a PNG of every rank's step and vision
time per mode (first round) next to the TensorBoard logs, and ends with one ``SUMMARY_JSON``
line. Lightning's banners, model summaries and progress bar and the known deprecation warnings
of third-party libraries are quiet by default (``--progress-bar``: the bar; ``--verbose``: all
of Lightning's output as before); the package's own warnings always show. Lightning's DDP
launcher re-runs this module for the other ranks (each quiets itself in ``main``); the runs
follow each other in the same processes. Logs go under ``--root`` (default ``runs/``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.balance import features_from_packs
from lightning_vlmbalance.balance.choice import OPTIONS
from lightning_vlmbalance.packing import Packs
from lightning_vlmbalance.synthetic import (
    LengthTable,
    SyntheticVLMDataset,
    read_length_csv,
    synthetic_length_table,
)
from lightning_vlmbalance.timing import WAIT_PHASES

MODES = ("off", "overlap", "sync", "source", "encoder", "auto")
COMPARED = ("off", "overlap", "source", "encoder", "auto")
# the strategies that balance, by --strategy name
BALANCING = {"vlmbalance": vb.VLMBalanceStrategy, "fsdp_vlmbalance": vb.FSDPVLMBalanceStrategy}
WARMUP_STEPS = 5  # optimizer steps left out of the median step time (a secondary figure)
ROUNDS = 2  # each compared mode trains this many times, in ABBA order
_RUN_DIR_ENV = "VLMBALANCE_MAIN_JOB_DIR"  # the run folder, handed to the other ranks
# Lightning's console loggers: the banners ("GPU available", "💡 Tip"), "Initializing
# distributed", "`Trainer.fit` stopped" (INFO; its warnings stay)
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")
# (message, category, module the warning is attributed to): warnings other libraries print at
# every Trainer of this job, none about what it does. Each by its message, category and module,
# so that any other warning (the package's own above all) still shows.
QUIET_WARNINGS = (
    # torch deprecates the all_gather Lightning's all_gather calls (Fabric's utilities)
    (
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        FutureWarning,
        r"lightning\.fabric\.utilities\.distributed\Z",
    ),
    # torch deprecates the LeafSpec Lightning's pytree utilities build
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree\Z",
    ),
    # ToyVLM's on_after_batch_transfer is meant to run with this job's datamodule
    (
        r"You have overridden `on_after_batch_transfer` in `LightningModule` but have passed in a"
        r" `LightningDataModule`",
        UserWarning,
        r"lightning\.pytorch\.trainer\.connectors\.data_connector\Z",
    ),
)


class ReadAheadLoader(vb.PackedDataLoader):
    """A ``PackedDataLoader`` that reads ``read_ahead`` packs ahead in a background thread, so
    that every mode of the comparison reads the same way: ``off`` and ``source`` take ready packs
    as ``overlap``'s exchange thread does (which reads from this thread too). The first pack of a
    pass is read in the caller's thread (the loader's first-pass collective stays there). A
    thread, not DataLoader worker processes: forking workers while the package's background
    threads run (the sampler's plan-ahead, the exchange) hung a worker at fork in CPython 3.11.
    Under plain ``"ddp"`` (the loader weighs its steps with a collective) it reads in line. The
    loader's checkpoint position runs ahead by the packs read: this job saves none.
    """

    def __init__(self, *args: Any, read_ahead: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_ahead = read_ahead

    def global_batches(self, micro_steps: int | None = None) -> Iterator[Any]:
        # what the "vlmbalance" strategy's rebalancing reads (unweighed: no collective per
        # step), an optimizer step at a time: as many steps ahead as make `read_ahead` packs
        inner = super().global_batches(micro_steps)
        size = micro_steps if micro_steps is not None else self._micro_steps()
        steps = max(1, self.read_ahead // max(1, size))
        return self._ahead(inner, steps) if self.read_ahead > 0 else inner

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # plain "ddp" iterates the loader itself, which (given its trainer) weighs each step
        # with a collective that must stay on the training thread: that reads in line
        inner = super().__iter__()
        if self.read_ahead > 0 and self.trainer is None:
            return self._ahead(inner, self.read_ahead)
        return inner

    def _ahead(self, inner: Iterator[Any], size: int) -> Iterator[Any]:
        end = object()
        first = next(inner, end)  # here: Lightning calls set_epoch before the first next()
        if first is end:
            return
        ready: queue.Queue[Any] = queue.Queue(maxsize=size)
        stop = threading.Event()

        def read() -> None:
            try:
                for batch in inner:
                    while not stop.is_set():
                        try:
                            ready.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                ready.put(end)
            except BaseException as err:  # raised in the consumer
                ready.put(err)

        thread = threading.Thread(target=read, name="main-job-read-ahead", daemon=True)
        thread.start()
        try:
            yield first
            while (item := ready.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()


class VLMDataModule(L.LightningDataModule):
    """Synthetic (or CSV-shaped) multimodal data, packed by ``PackingSampler`` (balanced at the
    source when given a cost model as ``balance``)."""

    def __init__(
        self,
        table: LengthTable,
        *,
        seq_len: int,
        patch_dim: int,
        vocab_size: int,
        seed: int = 0,
        num_workers: int = 0,
        balance: vb.CostModel | None = None,
        read_ahead: int = 0,
    ) -> None:
        super().__init__()
        self.table, self.seq_len, self.seed, self.num_workers = table, seq_len, seed, num_workers
        self.balance = balance
        self.read_ahead = read_ahead  # packs read ahead in a thread (ReadAheadLoader)
        self.dataset = SyntheticVLMDataset(
            table, vocab_size=vocab_size, patch_dim=patch_dim, seed=seed
        )
        self.patch_dim = patch_dim
        self.loader: vb.PackedDataLoader | None = None

    def train_dataloader(self) -> vb.PackedDataLoader:
        # rank and world size come from the process group Lightning has initialised
        sampler = vb.PackingSampler(
            self.table.total_tokens,
            self.table.image_tokens,
            images=self.table.images,
            seq_len=self.seq_len,
            seed=self.seed,
            balance=self.balance,
        )
        collate = vb.PackCollator(self.seq_len, image_feature_shape=(self.patch_dim,))
        self.loader = ReadAheadLoader(
            self.dataset,
            sampler,
            collate,
            trainer=self.trainer,  # loss weights per optimizer step (strategy "ddp" needs it)
            read_ahead=self.read_ahead,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        return self.loader


class RunSummary(L.Callback):
    """Times the fit (every optimizer step), counts the tokens every rank computed (known from
    the shared plan) and records which samples each optimizer step trained."""

    def __init__(self, monitor: vb.StragglerMonitor | None = None, mode: str = "") -> None:
        self.monitor = monitor
        self.mode = mode
        self.start = 0.0
        self.summary: dict[str, Any] = {}
        self.step_ends: list[float] = []
        self.step_s: list[float] = []  # optimizer step times after the warm-up steps
        self.trained: dict[int, list[int]] = {}  # optimizer step -> this rank's sample ids
        self.epochs_taken: list[str] = []  # mode="auto": each epoch's plan (plain or formed)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()
        self.start_step = trainer.global_step
        self.tokens = 0
        self.step_ends = [self.start]
        self.losses: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        # the optimizer step this micro-batch belongs to (global_step counts finished ones)
        self.trained.setdefault(trainer.global_step, []).extend(batch["meta"]["sample_ids"])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step - self.start_step >= len(self.step_ends):  # a step just ended
            self.step_ends.append(time.perf_counter())
        loss = trainer.callback_metrics.get("train/loss")  # this pack's mean token loss
        if loss is not None and not batch["meta"]["padding"]:
            self.losses.append(float(loss))

    def replan(self, cost_model: vb.CostModel) -> None:
        """The planned waste of the packs as the sampler placed them, under ``cost_model``."""
        plan, sampler, accumulate = self.planned
        self.summary["planned_waste"] = round(plan_waste(plan, sampler, cost_model, accumulate), 4)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.datamodule.loader
        plan = loader.sampler.plan()
        if plan.epoch_choice is not None:
            self.epochs_taken.append(plan.epoch_choice["taken"])
        # tokens of the packs every rank trained on in this run (padding packs hold none)
        self.tokens += sum(
            int(plan.pack_tokens[[i for i in ids[loader.start : loader.consumed] if i >= 0]].sum())
            for ids in plan.rank_pack_ids
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self.start
        sampler = trainer.datamodule.loader.sampler
        plan = sampler.plan()
        steps = trainer.global_step - self.start_step
        self.step_s = [float(x) for x in np.diff(self.step_ends)[WARMUP_STEPS:]]
        self.summary = {
            "mode": self.mode,
            "ranks": trainer.world_size,
            "optimizer_steps": steps,
            "seconds": round(elapsed, 3),
            "tokens": self.tokens,  # of the samples trained: the same in every mode
            # whole run: from the first batch read to the last optimizer step, warm-up included
            "tokens_per_s": round(self.tokens / elapsed, 1),
            "steps_per_s": round(steps / elapsed, 3),
            "steps_per_s_median": (
                round(1.0 / float(np.median(self.step_s)), 3) if self.step_s else 0.0
            ),
            "packing_efficiency": round(plan.efficiency, 4),
            "packs_per_rank": plan.packs_per_rank,
            "padding_packs": plan.padding_packs,
            "source_balanced": sampler.balanced,
            "epochs_taken": self.epochs_taken,
            "final_loss": round(float(trainer.callback_metrics.get("train/loss", float("nan"))), 4),
            # every mode trains the same samples: the mean over the run compares them
            "mean_loss": _mean_over_ranks(self.losses),
            "log_dir": trainer.logger.log_dir if trainer.logger else None,
            "moved_packs": 0,
            "moved_images": 0,
            "bytes_exchanged": 0,
        }
        cost_model = sampler.cost_model or getattr(trainer.strategy, "cost_model", None)
        self.planned = (plan, sampler, trainer.accumulate_grad_batches)
        self.replan(cost_model or vb.CostModel())
        loader = getattr(trainer.strategy, "rebalancing_loader", None)
        if loader is not None:
            self.summary["balance_mode"] = loader.mode
            self.summary["moved_packs"] = loader.moved_packs_total
            self.summary["moved_images"] = loader.moved_images_total
            received = torch.tensor([loader.received_bytes_total], dtype=torch.float64)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(received)
            # packs received (summed over the ranks) and pixels sent to encode (all ranks')
            self.summary["bytes_exchanged"] = int(received.item()) + loader.encoder_bytes_total
            planned = [b for b in loader.stats if "planned_waste_frac" in b]
            if planned:  # the planner's prediction, with the cost model in use
                self.summary["planned_waste_before"] = round(
                    float(np.mean([b["baseline_waste_frac"] for b in planned])), 4
                )
                self.summary["planned_waste"] = round(
                    float(np.mean([b["planned_waste_frac"] for b in planned])), 4
                )
            if loader.stats:
                self.summary["exposed_exchange_ms"] = round(
                    float(np.median([b["exposed_exchange_ms"] for b in loader.stats])), 2
                )
            chosen = [b for b in loader.stats if "choice" in b]
            if chosen:  # mode="auto": what it took, and its prediction of the step
                taken = [OPTIONS[int(b["choice"])] for b in chosen]
                self.summary["choices"] = {o: taken.count(o) for o in OPTIONS if o in taken}
                self.summary["predicted_step_ms_median"] = round(
                    float(np.median([b["predicted_step_ms"] for b in chosen])), 2
                )
        rebalancer = getattr(trainer.strategy, "rebalancer", None)
        driver = None if rebalancer is None else rebalancer.calibration
        if rebalancer is not None:  # the model the run ended with: its own fit, online
            final = rebalancer.cost_model or vb.CostModel()
            self.summary["final_model"] = final.to_dict()
            self.summary["calibration"] = (
                None
                if driver is None
                else {
                    "adopted_at_steps": [r["adopted_at_step"] for r in driver.shipped],
                    "held_out_error": [
                        [round(r["error_current"], 4), round(r["error_candidate"], 4)]
                        for r in driver.shipped
                    ],
                }
            )
        if self.monitor is not None:  # complete on rank 0 after the monitor's last gather
            straggler = self.monitor.summary()
            self.summary["slowest_rank"] = straggler["slowest_rank"]
            self.summary["waste_frac"] = round(straggler["waste_frac"], 4)
        # every optimizer step's samples, all ranks together (the same on every rank)
        trained = [self.trained]
        if dist.is_available() and dist.is_initialized():
            trained = [None] * dist.get_world_size()
            dist.all_gather_object(trained, self.trained)
        steps_samples: dict[int, list[int]] = {}
        for part in trained:
            for step, ids in part.items():
                steps_samples.setdefault(step, []).extend(ids)
        self.steps_samples = [sorted(v) for _, v in sorted(steps_samples.items())]


class UnfreezeVision(L.Callback):
    """A stage change: the example VLM's vision tower trains from optimizer step ``at`` on (its
    backward appears). ``tell``: the documented call that tells online calibration so
    (``strategy.cost_changed()``); otherwise calibration finds the jump in its error itself."""

    def __init__(self, at: int, *, tell: bool) -> None:
        self.at, self.tell = at, tell

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if pl_module.vision_frozen and trainer.global_step >= self.at:
            pl_module.vision_frozen = False
            if self.tell and hasattr(trainer.strategy, "cost_changed"):
                trainer.strategy.cost_changed()


def _mean_over_ranks(values: list[float]) -> float:
    """The mean of every rank's values (every pack's mean loss, all ranks)."""
    total = torch.tensor([sum(values), len(values)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return round(float(total[0] / total[1]), 4) if total[1] > 0 else float("nan")


def plan_waste(plan: Any, sampler: vb.PackingSampler, model: vb.CostModel, G: int) -> float:
    """Mean over the optimizer steps of ``1 - mean rank cost / slowest rank cost`` of the packs
    where the sampler placed them, under ``model`` (what ``off`` and ``source`` train)."""
    packs = [p for rank in plan.rank_packs for p in rank]
    feats = features_from_packs(
        Packs.from_lists(packs),
        sampler.total_tokens,
        sampler.image_tokens,
        sampler.images,
    )
    cost = model.pack_cost_ms(feats)
    cost[feats["total_tokens"] == 0] = 0.0
    cost = cost.reshape(plan.num_replicas, -1)
    wastes = []
    for k in range(0, cost.shape[1], G):
        per_rank = cost[:, k : k + G].sum(axis=1)
        if per_rank.max() > 0:
            wastes.append(1.0 - per_rank.mean() / per_rank.max())
    return float(np.mean(wastes)) if wastes else 0.0


def image_sizes(args: argparse.Namespace) -> tuple[int, int] | None:
    """The synthetic images' smallest and largest token counts (``None``: tiles)."""
    if args.image_sizes is None:
        return (16, 3 * args.seq_len // 4)
    return tuple(args.image_sizes) if any(args.image_sizes) else None


def build_table(args: argparse.Namespace) -> LengthTable:
    if not args.data:
        return synthetic_length_table(
            args.num_samples,
            text_share=args.text_share,
            tile_tokens=args.tile_tokens,
            max_text_tokens=args.seq_len // 2,
            seed=args.seed,
            image_sizes=image_sizes(args),
        )
    table = read_length_csv(*args.data)
    scale = args.length_scale
    image = np.ceil(table.image_tokens * scale).astype(np.int64)
    text = np.maximum(np.ceil((table.total_tokens - table.image_tokens) * scale), 1).astype(
        np.int64
    )
    n = min(args.num_samples, len(table))
    pick = np.random.default_rng(args.seed).permutation(len(table))[:n]
    return LengthTable(
        total_tokens=(image + text)[pick], image_tokens=image[pick], images=table.images[pick]
    )


def quiet_lightning() -> None:
    """This process's Lightning banners and info messages off (its warnings stay) and the
    known third-party warnings of ``QUIET_WARNINGS`` filtered, each by message, category and
    module: every other warning still shows. Per process: each rank calls it in ``main``
    before its first Trainer (the other ranks are re-runs of this module)."""
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message, category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _is_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def run_dir(root: str) -> Path:
    """A new folder under ``root/vlm`` for this invocation; the other ranks (re-run by
    Lightning's launcher with this process's environment) take the same one."""
    if _RUN_DIR_ENV in os.environ:
        return Path(os.environ[_RUN_DIR_ENV])
    base = Path(root) / "vlm"
    base.mkdir(parents=True, exist_ok=True)
    k = 0
    while (base / f"run_{k}").exists():
        k += 1
    path = base / f"run_{k}"
    path.mkdir()
    os.environ[_RUN_DIR_ENV] = str(path)
    return path


def fit_mode(
    args: argparse.Namespace,
    table: LengthTable,
    mode: str,
    folder: Path,
    cost_model: vb.CostModel | None,
    version: str | None = None,
) -> RunSummary:
    """One training run of ``mode`` from the same initial weights and data order (TensorBoard
    version ``version``, default the mode's name)."""
    L.seed_everything(args.seed, verbose=False)
    data = VLMDataModule(
        table,
        seq_len=args.seq_len,
        patch_dim=32,
        vocab_size=256,
        seed=args.seed,
        num_workers=args.num_workers,
        # "auto" may form an epoch at the source where that is predicted faster
        balance=(cost_model or vb.CostModel())
        if mode == "source"
        else vb.SourceBalance(cost_model=cost_model or vb.CostModel(), when="auto")
        if mode == "auto"
        else None,
        read_ahead=args.read_ahead,
    )
    model = ToyVLM(
        max_positions=args.seq_len,
        moe_experts=args.moe_experts,
        patch_dim=32,
        vocab_size=256,
        vision_layers=args.vision_layers,
        vision_dim=args.vision_dim,
    )
    monitor = vb.StragglerMonitor(log_every_n_steps=10)
    summary = RunSummary(monitor, mode)
    callbacks: list[L.Callback] = [monitor, summary]
    if args.unfreeze_vision_at >= 0:
        model.vision_frozen = True
        callbacks.append(UnfreezeVision(args.unfreeze_vision_at, tell=args.tell_cost_change))
    if args.strategy in BALANCING and args.devices > 1:
        # "source": the strategy sees the balanced loader and moves nothing
        # "encoder": packs ordered over the micro-steps in the background, images balanced
        # "fsdp_vlmbalance": the example VLM shards itself (ToyVLM.configure_model)
        calibration = (
            None
            if args.no_calibration
            # the runs are short: a refit from one period's records (2 ranks x 2 micro-batches
            # x 5 steps), where the default asks for 32
            else vb.Calibration(every_n_steps=args.calibrate_every, min_records=16)
        )
        # a frozen vision tower's parameters get no gradients until it is unfrozen
        unused = {"find_unused_parameters": True} if args.unfreeze_vision_at >= 0 else {}
        strategy: Any = BALANCING[args.strategy](
            **unused,
            config=vb.RebalanceConfig(
                mode={"source": "off", "encoder": "overlap"}.get(mode, mode),
                encoder=mode in ("encoder", "auto"),
                calibration=calibration,
            ),
            cost_model=cost_model,
        )
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(folder, name="", version=version or mode),
        log_every_n_steps=5,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=args.verbose,
    )
    trainer.fit(model, datamodule=data)
    summary.jsonl_dir = monitor.jsonl_path.parent if monitor.jsonl_path else None
    return summary


def calibrate(jsonl_dir: Path, out: Path) -> tuple[vb.CostModel, str]:
    """The cost model fitted on rank 0 to the ``off`` run's monitor logs, saved and loaded on
    every rank (all ranks must plan with the same numbers)."""
    report = ""
    if not (dist.is_initialized() and dist.get_rank() > 0):
        model = vb.CostModel()
        report = str(model.fit(jsonl_dir))
        model.save(out)
    if dist.is_initialized():
        dist.barrier()
    return vb.CostModel.load(out), report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    return run_job(args)


def build_parser() -> argparse.ArgumentParser:
    """The job's command line (``benchmarks/sim_main_job.py`` reads its defaults)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-samples", type=int, default=1200)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--text-share", type=float, default=0.7)
    p.add_argument(
        "--tile-tokens", type=int, default=16, help="image tokens per tile (synthetic data)"
    )
    p.add_argument(
        "--image-sizes",
        type=int,
        nargs=2,
        metavar=("SMALLEST", "LARGEST"),
        help="synthetic images of any size between, in tokens (log-uniform, 1-3 per sample;"
        " default 16 and 3/4 of --seq-len: 16-768); 0 0: one image of 1-5 tiles of"
        " --tile-tokens per sample",
    )
    p.add_argument(
        "--data", action="append", help="length CSV(s) in the shared format (repeatable)"
    )
    p.add_argument("--length-scale", type=float, default=1.0, help="scale CSV lengths (e.g. 1/16)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--moe-experts", type=int, default=4)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--vision-dim", type=int, default=256, help="0: the decoder's width")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument(
        "--read-ahead",
        type=int,
        default=2,
        help="packs each rank reads ahead in a background thread, in every mode alike",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="runs of each compared mode, in ABBA order (the spread of the gain across rounds)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs")
    p.add_argument(
        "--progress-bar",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Lightning's progress bar (default: none; one line per run instead)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="Lightning's banners, info messages and model summaries, and the third-party"
        " deprecation warnings the job filters (default: quiet)",
    )
    p.add_argument(
        "--strategy",
        default="vlmbalance",
        choices=(*BALANCING, "ddp"),
        help="with --devices > 1; fsdp_vlmbalance: FSDP2, the ranks meet at every micro-batch",
    )
    p.add_argument(
        "--balance-mode",
        default="compare",
        choices=("compare", *MODES),
        help="compare: off, overlap, source and encoder (--rounds each, ABBA order), with a cost"
        " model fitted on the first off run's logs",
    )
    p.add_argument(
        "--cost-model", help="a saved CostModel (JSON) to start from (default: the defaults)"
    )
    p.add_argument(
        "--calibrate-every",
        type=int,
        default=5,
        help="optimizer steps between online refits of the cost model (the runs are short)",
    )
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="plan with the starting model throughout (no online calibration)",
    )
    p.add_argument(
        "--unfreeze-vision-at",
        type=int,
        default=-1,
        metavar="STEP",
        help="a stage change: the vision tower is frozen until this optimizer step (-1: never)",
    )
    p.add_argument(
        "--tell-cost-change",
        action="store_true",
        help="with --unfreeze-vision-at: call strategy.cost_changed() at the change",
    )
    p.add_argument(
        "--fit-on-off",
        action="store_true",
        help="fit a cost model offline to the first off run's monitor logs and start the"
        " balanced modes from it (the flow before online calibration)",
    )
    return p


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the modes ``args`` asks for and reports (see the module docstring)."""
    if not args.verbose:  # before the first Trainer, in every rank's process
        quiet_lightning()
    torch.set_num_threads(1)  # one core per rank: two ranks must not fight over two cores
    table = build_table(args)
    single = args.strategy not in BALANCING or args.devices == 1
    modes = (
        ["ddp" if args.strategy == "ddp" and args.devices > 1 else "off"]
        if single
        else list(COMPARED if args.balance_mode == "compare" else [args.balance_mode])
    )
    folder = run_dir(args.root)
    cost_model = vb.CostModel.load(args.cost_model) if args.cost_model else None
    order = schedule(modes, args.rounds if len(modes) > 1 else 1)
    runs: dict[str, list[RunSummary]] = {mode: [] for mode in modes}
    fit_report = None
    rounds: dict[int, dict[str, dict[str, Any]]] = {}  # round -> mode -> its run's summary
    for n, (k, mode) in enumerate(order, 1):
        run = fit_mode(args, table, mode, folder, cost_model, mode if k == 0 else f"{mode}_{k}")
        runs[mode].append(run)
        # the balanced modes calibrate themselves online; --fit-on-off gives them a model
        # fitted offline to the first off run's logs instead (for comparison)
        if mode == "off" and args.fit_on_off and len(modes) > 1 and cost_model is None:
            cost_model, fit_report = calibrate(run.jsonl_dir, folder / "cost_model.json")
            run.replan(cost_model)  # every mode's planned waste under the same model
        same_round = rounds.setdefault(k, {})
        same_round[mode] = run.summary
        if _is_zero():
            print(run_line(run.summary, k, n, len(order), same_round, "off" in modes), flush=True)
    summary = report(runs, order, folder, fit_report, args)
    return summary


def schedule(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, mode)`` in ABBA order: forward in even rounds, backward in odd ones (off,
    overlap, source, source, overlap, off), so a load that drifts linearly over the job weighs
    on every mode alike over each pair of rounds."""
    return [(k, mode) for k in range(rounds) for mode in (modes if k % 2 == 0 else modes[::-1])]


def _gain(value: float, base: float) -> float | None:
    return round(value / base - 1.0, 4) if base > 0 else None


def _rate(run: dict[str, Any]) -> float:
    """A run's whole-run tokens/s, unrounded (as ``compare`` pairs the rounds)."""
    return run["tokens"] / run["seconds"] if run["seconds"] > 0 else 0.0


def _median_gain(gains: list[float | None]) -> float | None:
    known = [g for g in gains if g is not None]
    return round(float(np.median(known)), 4) if known else None


def run_line(
    s: dict[str, Any],
    k: int,
    n: int,
    total: int,
    same_round: dict[str, dict[str, Any]],
    with_off: bool = True,
) -> str:
    """The line printed as run ``n`` of ``total`` ends (rank 0): its mode ``s["mode"]``, round
    ``k``, whole-run tokens/s and its gain over the same round's ``off`` (both as ``compare``
    reckons its per-round figures), seconds, median step after the warm-up, waiting, what moved.
    ``same_round``: the round's runs so far by mode, this one included. In a backward round
    ``off`` runs last: the others' gains come on its line. ``with_off``: an ``off`` is run."""
    step = f"{1000 / s['steps_per_s_median']:,.0f} ms" if s["steps_per_s_median"] > 0 else "-"
    waiting = f"{s['waste_frac']:.1%}" if "waste_frac" in s else "-"
    line = (
        f"run {n}/{total}: {s['mode']:<8} round {k}  {_rate(s):>8,.0f} tokens/s"
        f"  {s['seconds']:7.1f} s  median step {step:>8}  waiting {waiting:>5}"
        f"  moved {s['moved_packs']} packs, {s['moved_images']} images"
    )
    off = same_round.get("off")
    others = [m for m in same_round if m != "off"]
    if not with_off:
        return line
    if s["mode"] != "off":
        if off is None:
            return f"{line}  | vs off: on round {k}'s off line (it runs last)"
        return f"{line}  | {_pct(_gain(_rate(s), _rate(off)))} vs round {k}'s off"
    if others:  # the round's off came last: the gains of the runs before it
        gains = ", ".join(f"{m} {_pct(_gain(_rate(same_round[m]), _rate(s)))}" for m in others)
        return f"{line}  | round {k} vs this off: {gains}"
    return line


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode, from its runs' summaries (in round order; each with ``seconds``, ``tokens``,
    ``optimizer_steps``, ``step_s``): the headline ``tokens_per_s`` = all its runs' tokens over
    all their seconds (whole runs, warm-up included), ``gain_vs_off`` on that figure, and
    ``gain_by_round`` / ``gain_spread``: each round's tokens/s against the same round's ``off``.
    ``steps_per_s_median`` (median step time after the warm-up steps) is kept for reference: it
    leaves out the warm-up and weighs a drifting step time differently, so it is no headline."""
    modes: dict[str, dict[str, Any]] = {}
    rate: dict[str, tuple[float, list[float], float]] = {}  # unrounded: whole, per round, median
    for mode, rs in runs.items():
        seconds = sum(r["seconds"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        steps = sum(r["optimizer_steps"] for r in rs)
        step_s = [x for r in rs for x in r.get("step_s", [])]
        per_round = [r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0 for r in rs]
        median = 1.0 / float(np.median(step_s)) if step_s else 0.0
        rate[mode] = (tokens / seconds if seconds > 0 else 0.0, per_round, median)
        waits = [r["waste_frac"] for r in rs if "waste_frac" in r]
        s = {k: v for k, v in rs[0].items() if k != "step_s"}  # per epoch: the first round's
        s.update(
            rounds=len(rs),
            seconds=round(seconds, 3),
            tokens=tokens,
            tokens_per_s=round(rate[mode][0], 1),
            steps_per_s=round(steps / seconds, 3) if seconds > 0 else 0.0,
            steps_per_s_median=round(median, 3),
            by_round=[
                {
                    "round": k,
                    "seconds": round(r["seconds"], 3),
                    "tokens_per_s": round(per_round[k], 1),
                    **({"waste_frac": r["waste_frac"]} if "waste_frac" in r else {}),
                    "moved_packs": r.get("moved_packs", 0),
                    "moved_images": r.get("moved_images", 0),
                    "log_dir": r.get("log_dir"),
                }
                for k, r in enumerate(rs)
            ],
            gain_vs_off=None,
            median_gain_vs_off=None,
            gain_by_round=[],
            gain_spread=None,
            gain_median_over_rounds=None,
        )
        if waits:
            s["waste_frac"] = round(float(np.mean(waits)), 4)
        modes[mode] = s
    if "off" in rate:
        base, base_rounds, base_median = rate["off"]
        for mode, s in modes.items():
            whole, per_round, median = rate[mode]
            s["gain_vs_off"] = _gain(whole, base)
            s["median_gain_vs_off"] = _gain(median, base_median)
            s["gain_by_round"] = [_gain(x, b) for x, b in zip(per_round, base_rounds)]
            for r, g in zip(s["by_round"], s["gain_by_round"]):
                r["gain_vs_off"] = g
            known = [g for g in s["gain_by_round"] if g is not None]
            if known:
                s["gain_spread"] = [min(known), max(known)]
            s["gain_median_over_rounds"] = _median_gain(s["gain_by_round"])
    return modes


def report(
    runs: dict[str, list[RunSummary]],
    order: list[tuple[int, str]],
    folder: Path,
    fit_report: str | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The comparison (printed by rank 0, returned on every rank)."""
    modes = compare(
        {mode: [{**r.summary, "step_s": r.step_s} for r in rs] for mode, rs in runs.items()}
    )
    every = [r for rs in runs.values() for r in rs]
    samples = [sorted(x for step in r.steps_samples for x in step) for r in every]
    exchanged = [
        r.steps_samples
        for m, rs in runs.items()
        if m in ("off", "overlap", "sync", "encoder")
        for r in rs
    ]
    summary: dict[str, Any] = {
        "ranks": every[0].summary["ranks"],
        "log_dir": str(folder),
        "rounds": max(len(rs) for rs in runs.values()),
        "order": [mode for _, mode in order],  # the runs, in the order they trained
        "read_ahead": args.read_ahead,  # packs read ahead in a thread, the same in every mode
        "modes": modes,
        # the same samples, each as often, in every run; off and the exchanges: the same
        # global batch at every optimizer step (only the ranks that compute a pack differ)
        "same_samples": all(v == samples[0] for v in samples),
        "same_global_batches": all(v == exchanged[0] for v in exchanged),
    }
    if fit_report is not None:
        summary["cost_model_fit"] = fit_report
    if "off" in modes and len(modes) > 1:
        best = max((m for m in modes if m != "off"), key=lambda m: modes[m]["tokens_per_s"])
        summary["best_mode"] = best
        summary["gain_vs_off"] = modes[best]["gain_vs_off"]
        summary["gain_spread"] = modes[best]["gain_spread"]
        summary["gain_by_round"] = modes[best]["gain_by_round"]
        summary["gain_median_over_rounds"] = modes[best]["gain_median_over_rounds"]
    if _is_zero():
        summary["figure"] = str(plot_modes({m: rs[0] for m, rs in runs.items()}, folder))
        _print(summary, args)
    return summary


def print_run(s: dict[str, Any]) -> None:
    """One run's summary (rank 0), for jobs that train one mode (``examples.hf_vlm``)."""
    lines = [
        f"\nSummary: {s['ranks']} ranks, {s['optimizer_steps']} optimizer steps in"
        f" {s['seconds']} s, {s['steps_per_s']} steps/s and {s['tokens_per_s']} tokens/s (whole"
        f" run, all ranks; median step: {s['steps_per_s_median']} steps/s), packing efficiency"
        f" {s['packing_efficiency']:.2%}, final loss {s['final_loss']}."
    ]
    if "waste_frac" in s:
        lines.append(
            f"Stragglers: slowest rank {s['slowest_rank']}; {s['waste_frac']:.1%} of rank-time"
            " was spent waiting at synchronisation points."
        )
    if "balance_mode" in s:
        lines.append(
            f"Rebalancing ({s['balance_mode']}): {s['moved_packs']} packs moved,"
            f" {s['moved_images']} images encoded on another rank,"
            f" {s['bytes_exchanged']:,} bytes; planned waste {s['planned_waste']:.1%}."
        )
    lines.append(f"TensorBoard logs: {s['log_dir']}  (tensorboard --logdir {s['log_dir']})")
    print("\n".join(lines))
    print("SUMMARY_JSON " + json.dumps(s))


def _pct(gain: float | None) -> str:
    return "-" if gain is None else f"{gain:+.1%}"


def _print(summary: dict[str, Any], args: argparse.Namespace) -> None:
    modes = summary["modes"]
    lines = []
    if "cost_model_fit" in summary:
        lines.append(
            "\nCost model fitted on the off run's StragglerMonitor logs:"
            f" {summary['cost_model_fit']}"
        )
    rounds = summary["rounds"]
    lines.append(
        f"\nSummary: {summary['ranks']} ranks, accumulation {args.accumulate}, the same"
        f" {'samples' if summary['same_samples'] else 'SAMPLES DIFFER'} in every run;"
        f" {rounds} round(s) per mode in the order {', '.join(summary['order'])};"
        f" every mode reads {summary['read_ahead']} packs ahead in a thread. tokens/s: whole"
        " runs (warm-up included) over all rounds; per round: against that round's off; steps/s"
        f" (median): after the first {WARMUP_STEPS} steps, for reference:\n"
    )
    head = (
        "| mode | steps | tokens/s | gain vs off | per round | steps/s (median) | waiting"
        " (measured) | planned waste | exposed ms | packs moved | images moved | bytes exchanged"
        " | packing | mean loss |"
    )
    lines += [head, "|" + "---|" * 14]
    for mode, s in modes.items():
        per_round = ", ".join(_pct(g) for g in s["gain_by_round"]) or "-"
        lines.append(
            f"| {mode} | {s['optimizer_steps']} | {s['tokens_per_s']:,.0f} |"
            f" {_pct(s['gain_vs_off'])} | {per_round} |"
            f" {s['steps_per_s_median']:.2f} ({_pct(s['median_gain_vs_off'])}) |"
            f" {s.get('waste_frac', float('nan')):.1%} | {s['planned_waste']:.1%} |"
            f" {s.get('exposed_exchange_ms', '-')} |"
            f" {s['moved_packs']} | {s['moved_images']} | {s['bytes_exchanged']:,} |"
            f" {s['packing_efficiency']:.2%} |"
            f" {s['mean_loss']} |"
        )
    if "best_mode" in summary:
        best = summary["best_mode"]
        lines.append(
            f"\n{headline(summary)}; waiting {modes['off'].get('waste_frac', 0):.1%} ->"
            f" {modes[best].get('waste_frac', 0):.1%} of rank-time."
        )
    for mode, s in modes.items():
        if "choices" in s and s["steps_per_s_median"] > 0:  # mode="auto" (first round)
            measured = 1000.0 / s["steps_per_s_median"]
            epochs = s.get("epochs_taken") or []
            formed = sum(t != "plain" for t in epochs)
            lines.append(
                f"\n{mode} formed {formed} of {len(epochs)} epochs at the source ({epochs}) and"
                f" took {s['choices']} (first round); its predicted step (median)"
                f" {s['predicted_step_ms_median']:,.0f} ms against {measured:,.0f} ms measured"
                f" (median, all rounds): {s['predicted_step_ms_median'] / measured:.2f}x."
            )
    fits = [(mode, s) for mode, s in modes.items() if "final_model" in s]
    if fits:
        lines.append(
            "\nEach mode's final cost model (first round; ms per pack, per image, per image token,"
            " per squared image token, per token, per squared document token):"
        )
        for mode, s in fits:
            lines.append(f"  {mode}: {_fit_line(s['final_model'], s.get('calibration'))}")
    lines.append(f"Figure (busy and vision time per rank, per mode): {summary['figure']}")
    lines.append(
        f"TensorBoard logs: {summary['log_dir']}  (tensorboard --logdir {summary['log_dir']})"
    )
    print("\n".join(lines))
    print("SUMMARY_JSON " + json.dumps(summary))


def headline(summary: dict[str, Any]) -> str:
    """The best mode's whole-run gain qualified by its spread: every round's gain against that
    round's ``off``, their median, and whether the rounds agree."""
    gains = [g for g in summary["gain_by_round"] if g is not None]
    rounds = ", ".join(_pct(g) for g in summary["gain_by_round"]) or "-"
    if len(gains) < 2:
        verdict = "one round: no spread"
    elif min(gains) > 0:
        verdict = "a gain in every round"
    elif max(gains) <= 0:
        verdict = "no round gains"
    else:
        verdict = "the rounds disagree: not a stable gain"
    return (
        f"Best: {summary['best_mode']}, {_pct(summary['gain_vs_off'])} tokens/s over off"
        f" (whole runs; rounds: {rounds}; median {_pct(summary['gain_median_over_rounds'])};"
        f" {verdict})"
    )


def _fit_line(model: dict[str, Any], calibration: dict[str, Any] | None) -> str:
    """A cost model's coefficients on one line, and when online calibration adopted it."""
    c = model["coefficients"]
    vision = " + ".join(
        f"{c[phase]['image_pack']:.3g} + {c[phase]['images']:.3g}/img"
        f" + {c[phase]['image_tokens']:.3g}/tok + {c[phase]['image_sq_tokens']:.3g}/tok²"
        for phase in ("vision_fwd",)
    )
    llm = (
        f"{c['llm_fwd']['pack']:.3g} + {c['llm_fwd']['total_tokens']:.3g}/tok"
        f" + {c['llm_fwd']['doc_sq_tokens']:.3g}/doc tok²"
    )
    text = f"vision fwd {vision}; LLM fwd {llm}"
    if calibration is None:
        return text + " (calibration off: the starting model)"
    steps = calibration["adopted_at_steps"]
    if not steps:
        return text + " (no refit adopted: the starting model)"
    first, last = calibration["held_out_error"][0], calibration["held_out_error"][-1]
    return (
        f"{text} (refits adopted at steps {', '.join(map(str, steps))}; held-out error"
        f" {first[0]:.0%} -> {first[1]:.0%} at the first, {last[1]:.0%} at the last)"
    )


def _busy_ms(record: dict[str, Any]) -> float:
    """A rank's step less its waits at synchronisation points."""
    phases = record["phases_ms"]
    return record["step_ms"] - sum(phases.get(phase, 0.0) for phase in WAIT_PHASES)


def plot_modes(runs: dict[str, RunSummary], folder: Path) -> Path:
    """One panel per mode on the same axes: every rank's busy time (its step less the waits at
    synchronisation points: solid) and vision forward time (dashed) per optimizer step, from
    the StragglerMonitor's JSON lines. Where the solid lines part, the faster rank waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(runs), figsize=(4.2 * len(runs), 3.4), sharey=True, squeeze=False
    )
    for ax, (mode, run) in zip(axes[0], runs.items()):
        for path in sorted(Path(run.jsonl_dir).glob("rank_*.jsonl")) if run.jsonl_dir else []:
            recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            steps = [r["global_step"] for r in recs]
            (line,) = ax.plot(
                steps, [_busy_ms(r) for r in recs], lw=1, label=f"rank {recs[0]['rank']} busy"
            )
            ax.plot(
                steps,
                [r["phases_ms"].get("vision_fwd", 0.0) for r in recs],
                lw=1,
                ls="--",
                color=line.get_color(),
                label=f"rank {recs[0]['rank']} vision fwd",
            )
        s = run.summary
        ax.set_title(
            f"{mode}: {s['tokens_per_s']:,.0f} tokens/s, waiting {s.get('waste_frac', 0):.0%}"
        )
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = folder / "modes.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
