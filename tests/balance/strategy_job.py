"""A 2-process CPU fit with ``strategy="vlmbalance"``, ``"ddp"``, ``"fsdp_vlmbalance"`` or
``"fsdp"`` (plain FSDP2), for the strategy tests.

    python -m tests.balance.strategy_job --out DIR --strategy vlmbalance --mode sync

Float64, seeded: rank 0 writes ``DIR/params.pt`` (the final parameters); every rank writes
``DIR/rank{r}.json`` with the ``(epoch, pack_id, sample_ids)`` it trained on and the balance
metrics it saw. With ``--strategy ddp`` the ``PackedDataLoader`` (given the trainer) weighs each
optimizer step's loss itself; ``--global-tokens`` wraps it in a user-made
``RebalancingLoader(mode="off")``.
``--record-grads``: rank 0 writes ``DIR/grads.pt``, per optimizer step the parameters before it
and the gradients before and after clipping.

Several fits in one launch: argument lists separated by ``--then`` run one after the other in
the same processes (Lightning starts the ranks for the first fit; the later Trainers find
them started and the process group up, as in any script that fits twice). Each fit seeds
everything again and counts its own broadcasts, and writes to its own ``--out``. The tests put
a reference fit (plain DDP / FSDP2) first, so it runs before any code of the strategy under test
in that process; a fit that is to fail (``--fail-rank``) runs alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

import lightning_vlmbalance as vb
from lightning_vlmbalance.loaders.rebalancing import RebalancingLoader
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table
from tests.launch import THEN, fit_arg_lists
from tests.packing.lightning_job import SMALL_VLM, Data, RecordingVLM, step_checkpoints


class GlobalTokenData(Data):
    def __init__(self, *args: Any, micro_steps: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.micro_steps = micro_steps

    def train_dataloader(self) -> Any:
        return RebalancingLoader(
            super().train_dataloader(),
            micro_steps=self.micro_steps,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            rank=dist.get_rank() if dist.is_initialized() else 0,
            mode="off",
        )


class SourceBalancedData(Data):
    """The same samples, with ``PackingSampler(balance=True)``: global batches balanced at the
    source (micro-steps and objective from the Trainer through the loader)."""

    exact = False
    objective = "auto"
    when = "auto"
    llm_only: bool | None = None
    cost_model: str | None = None

    def train_dataloader(self) -> Any:
        ds = SyntheticVLMDataset(self.table, vocab_size=64, patch_dim=8)
        sampler = vb.PackingSampler(
            self.table.total_tokens,
            self.table.image_tokens,
            seq_len=self.seq_len,
            seed=3,
            window=64,  # Data's: exact=True keeps its unbalanced plan's global batches
            balance=vb.SourceBalance(
                exact=self.exact,
                objective=self.objective,
                when=self.when,
                llm_only=self.llm_only,
                cost_model=self.cost_model,
            ),
        )
        return vb.PackedDataLoader(
            ds,
            sampler,
            vb.PackCollator(self.seq_len, image_feature_shape=(8,)),
            trainer=self.trainer,
        )


BROADCASTS = [0]
SYNC_SKIPS = [0]  # FSDP modules told to skip their gradient reduce-scatter


def _count_sync_skips() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_requires_gradient_sync

    def counted(self: Any, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        SYNC_SKIPS[0] += int(not requires_gradient_sync)
        original(self, requires_gradient_sync, recurse=recurse)

    FSDPModule.set_requires_gradient_sync = counted


def _fail_exchange(rank: int, at: int) -> None:
    """On ``rank``, the n-th exchange raises (as a bug or a lost device would)."""
    import os

    import lightning_vlmbalance.loaders.global_batch as loader_mod

    if int(os.environ.get("LOCAL_RANK", "0")) != rank:
        return
    original, calls = loader_mod.exchange_packs, [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(f"rank {rank} failed on purpose in its exchange")
        return original(*args, **kwargs)

    loader_mod.exchange_packs = failing


def _count_broadcasts() -> None:
    """Counts the per-micro-batch sync points of the training loop: Lightning's SIGTERM-flag
    broadcasts (a class-level wrap, under any instance gate) and the strategy's SIGTERM agreement
    (its MAX all-reduce, which replaces that broadcast)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    original = _TrainingEpochLoop._broadcast_sigterm_tensor
    all_reduce = dist.all_reduce

    def counted(self: Any) -> None:
        BROADCASTS[0] += 1
        original(self)

    def counted_all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, **kw: Any) -> Any:
        if op == dist.ReduceOp.MAX:
            BROADCASTS[0] += 1
        return all_reduce(tensor, op=op, **kw)

    _TrainingEpochLoop._broadcast_sigterm_tensor = counted
    dist.all_reduce = counted_all_reduce


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps, for every step, the parameters before it and the gradients it applies
    (after Lightning's clipping, which runs inside the closure)."""

    records: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.records.append(
            {
                "grads_post": [p.grad.detach().clone() for p in self.param_groups[0]["params"]],
            }
        )
        super().step()
        return loss


def _preprocess(pixels: torch.Tensor) -> torch.Tensor:
    """The jobs' pixel preprocessing (a normalisation, as a model would do)."""
    return (pixels - 0.1) * 2.0


class Job(RecordingVLM):
    record_grads = False
    float64 = False  # set under FSDP for --precision 64-true
    preprocess = "none"  # --preprocess: "batch" (on_after_batch_transfer) or "encoder"
    images_only_when_tokens = False  # --images-only-when-tokens

    def setup(self, stage: str) -> None:
        if self.preprocess == "encoder":  # inside the encoder: a forward pre-hook on it
            self.vision.register_forward_pre_hook(lambda m, args: (_preprocess(args[0]), *args[1:]))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        if self.preprocess == "batch":
            batch["pixel_values"] = _preprocess(batch["pixel_values"])
        return batch

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        if not self.images_only_when_tokens:
            return super().forward(batch)
        # the embeddings enter the model only when the pack has image tokens (DDP needs
        # find_unused_parameters=True for this model)
        input_ids_T = batch["input_ids"].reshape(-1)
        image_ID = vb.encode_images(self.vision, batch)
        x_TD = self.llm.embed(input_ids_T) + self.llm.pos(batch["position_ids"].reshape(-1))
        if batch["image_positions"].numel():
            image_ID = self.projector(image_ID).to(x_TD.dtype)
            x_TD = x_TD.index_put((batch["image_positions"],), image_ID)
        return self.llm(x_TD, batch["cu_seqlens"], batch["max_seqlen"])

    def configure_model(self) -> None:
        """Under FSDP2 (``--strategy fsdp`` / ``fsdp_vlmbalance``): every block and embedding is
        an FSDP unit over the data-parallel mesh, the rest of the model the root unit."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return

        if self.float64:
            self.double()
        if self.device_mesh["tensor_parallel"].size() > 1:  # the language model's MLPs
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            plan = {"ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()}
            for block in self.llm.blocks:
                parallelize_module(block, self.device_mesh["tensor_parallel"], plan)
        self.shard(self.device_mesh["data_parallel"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank (a collective under FSDP)."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return {k: v.detach().clone() for k, v in self.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self, options=options)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.float64:
            batch["pixel_values"] = batch["pixel_values"].double()
        self.weights.append(
            (
                self.trainer.global_step,
                batch["meta"]["sample_ids"],
                int(batch["loss_tokens"]),
                int(batch["global_loss_tokens"]),
                float(batch["loss_weight"]),
            )
        )
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        self.weights: list[tuple] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.record_grads:  # before clipping; the parameters are those before the step
            optimizer.records.append(
                {
                    "step": self.trainer.global_step,
                    "params": {k: v.detach().clone() for k, v in self.named_parameters()},
                    "grads_pre": {k: v.grad.detach().clone() for k, v in self.named_parameters()},
                }
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.record_grads:
            return super().configure_optimizers()
        optimizer = RecordingAdamW(self.parameters(), lr=self.cfg.lr)
        optimizer.records = []
        return optimizer

    def on_train_end(self) -> None:
        super().on_train_end()
        strategy = self.trainer.strategy
        loader = getattr(strategy, "rebalancing_loader", None)
        stats = list(loader.stats) if loader is not None else []
        path = Path(self.out) / f"stats{self.global_rank}.json"
        path.write_text(
            json.dumps(
                {
                    "stats": stats,
                    "broadcasts": BROADCASTS[0],
                    "gradient_sync_skips": SYNC_SKIPS[0],
                    "optimizer_steps": self.trainer.global_step,
                    "logged": sorted(k for k in self.trainer.callback_metrics if "balance" in k),
                    "weights": self.weights,
                    "dtensor_params": _dtensor_params(self),
                    "objective": getattr(strategy, "resolved_objective", None),
                    "step_scale": _scale(strategy),
                    "epoch_choice": _epoch_choice(loader),
                }
            )
        )
        if self.record_grads and self.global_rank == 0:
            records, merged = self.trainer.optimizers[0].records, []
            for pre, post in zip(records[0::2], records[1::2]):  # hook record, then step record
                names = list(pre["grads_pre"])
                merged.append({**pre, "grads_post": dict(zip(names, post["grads_post"]))})
            torch.save(merged, Path(self.out) / "grads.pt")
        params = self.full_state_dict()
        if self.global_rank == 0:
            torch.save(params, Path(self.out) / "params.pt")


def _epoch_choice(loader: Any) -> Any:
    """The per-epoch decision of the trained epoch's plan (a source-balanced sampler's)."""
    sampler = getattr(getattr(loader, "loader", None), "sampler", None)
    if sampler is None or not getattr(sampler, "balanced", False):
        return None
    plan = sampler.plan()
    return {"formed_at_source": plan.formed_at_source, "choice": plan.epoch_choice}


def _dtensor_params(module: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in module.parameters())


def _scale(strategy: Any) -> dict[str, float] | None:
    """mode="auto": measured step over price, learned from the monitor, and over how many."""
    scale = getattr(getattr(strategy, "rebalancer", None), "scale", None)
    return None if scale is None else {"factor": scale.factor, "timed": scale.timed}


def _strategy(args: argparse.Namespace) -> Any:
    timeout = args.exchange_timeout_s
    config = vb.RebalanceConfig(
        mode=args.mode,
        exchange_timeout_s=timeout,
        encoder=args.encoder,
        options=tuple(args.options.split(",")) if args.options else None,
        # the default Calibration refits every 50 steps; these fits are short
        **(
            {"calibration": vb.Calibration(every_n_steps=args.calibrate_every, min_records=16)}
            if args.calibrate_every
            else {}
        ),
    )
    if args.strategy == "vlmbalance":
        return vb.VLMBalanceStrategy(config=config, find_unused_parameters=args.find_unused)
    if args.strategy == "ddp" and args.find_unused:
        return DDPStrategy(find_unused_parameters=True)
    if args.strategy == "fsdp_vlmbalance":
        return vb.FSDPVLMBalanceStrategy(
            config=config,
            gradient_sync_every_micro_batch=not args.no_sync_accumulation,
            tensor_parallel_size=args.tp,
        )
    if args.strategy == "fsdp":  # plain FSDP2, every rank data-parallel
        world = args.devices * args.num_nodes
        return ModelParallelStrategy(
            data_parallel_size=world // args.tp, tensor_parallel_size=args.tp
        )
    return args.strategy


def run_fits(
    jobs: dict[str, tuple[str, ...]],
    launches: list[tuple[str, ...]],
    *,
    after: dict[str, list[str]] | None = None,
    timeouts: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Runs the fits ``jobs`` (``name: tests.balance.fits.job(...)``) with
    :func:`harness.jobs.run_jobs`, two launches at a time in the order of ``launches``: the
    fits named in one entry of ``launches`` run in one launch, one after the other in that
    order (a fit in no entry: a launch of its own). ``after`` and ``timeouts`` name fits.
    Returns every fit's launch's ``JobResult``: a fit's test checks the exit of its launch."""
    from harness.jobs import run_jobs

    groups = [[n for n in group if n in jobs] for group in launches]
    grouped = {n for group in groups for n in group}
    groups = [g for g in groups if g] + [[n] for n in jobs if n not in grouped]
    launch_of = {n: "+".join(g) for g in groups for n in g}
    entries = {}
    for g in groups:
        entry = list(jobs[g[0]])
        for n in g[1:]:
            assert jobs[n][0] == entry[0], "one job module per launch"
            entry += [THEN, *jobs[n][1:]]
        entries[launch_of[g[0]]] = tuple(entry)
    needs: dict[str, list[str]] = {}
    for n, ms in (after or {}).items():
        if n in jobs:
            assert not {launch_of[m] for m in ms if m in jobs} & {launch_of[n]}, (
                "a resume runs in a launch after its fit's"
            )
            needs.setdefault(launch_of[n], [])
            needs[launch_of[n]] += [launch_of[m] for m in ms if m in jobs]
    limits = {launch_of[n]: t for n, t in (timeouts or {}).items() if n in jobs}
    procs = run_jobs(entries, after=needs, timeouts=limits)
    return {n: procs[launch_of[n]] for n in jobs}


def main() -> None:
    fits = fit_arg_lists(sys.argv[1:])
    torch.set_num_threads(1)
    _count_broadcasts()
    _count_sync_skips()
    parsed = [_parser().parse_args(f) for f in fits]
    if len(parsed) > 1:  # the ranks are started once: every fit has the same world
        assert len({(a.devices, a.num_nodes) for a in parsed}) == 1, "one world per launch"
        assert all(a.fail_rank is None for a in parsed), "a failing fit runs alone"
    for args in parsed:
        BROADCASTS[0] = SYNC_SKIPS[0] = 0
        _fit(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="vlmbalance")
    p.add_argument("--mode", default="overlap")
    p.add_argument("--options", default=None, help='mode="auto": the options, comma-separated')
    p.add_argument("--monitor", action="store_true", help="a StragglerMonitor")
    p.add_argument(
        "--calibrate-every", type=int, default=0, help="online refits every N steps (0: default)"
    )
    p.add_argument("--global-tokens", action="store_true")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--data-micro-steps", type=int, default=None, help="for --global-tokens")
    p.add_argument("--fail-rank", type=int, default=None, help="this rank's exchange raises")
    p.add_argument("--fail-at", type=int, default=2, help="...at its n-th global batch")
    p.add_argument("--exchange-timeout-s", type=float, default=60.0)
    p.add_argument("--limit-train-batches", type=int, default=None)
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    p.add_argument("--record-grads", action="store_true", help="rank 0 writes DIR/grads.pt")
    p.add_argument("--precision", default="64-true")
    p.add_argument("--overfit-batches", type=float, default=0.0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (fsdp strategies)")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--dense", action="store_true", help="MLPs instead of the MoE feed-forward")
    p.add_argument("--balance", action="store_true", help="PackingSampler(balance=True)")
    p.add_argument("--encoder", action="store_true", help="encoder balancing (encoder=True)")
    p.add_argument("--preprocess", default="none", choices=("none", "batch", "encoder"))
    p.add_argument(
        "--images-only-when-tokens",
        action="store_true",
        help="the model uses the image embeddings only in packs with image tokens",
    )
    p.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, 'aot_eager')")
    p.add_argument("--text-share", type=float, default=0.2, help="text-only samples' share")
    p.add_argument("--balance-exact", action="store_true", help="... and exact=True")
    p.add_argument("--balance-objective", default="auto", help="... and this objective")
    p.add_argument("--balance-when", default="auto", choices=("auto", "always"))
    p.add_argument("--balance-llm-only", default="none", choices=("none", "true", "false"))
    p.add_argument("--balance-cost-model", default=None, help="... planned with this JSON model")
    p.add_argument(
        "--no-sync-accumulation",
        action="store_true",
        help="fsdp_vlmbalance: no gradient reduce-scatter in accumulating micro-batches",
    )
    p.add_argument(
        "--all-callbacks",
        action="store_true",
        help="StragglerMonitor, ActivationOffload(test_mode) and CompiledMoERouting too",
    )
    return p


def _fit(args: argparse.Namespace) -> None:
    L.seed_everything(0, verbose=False)
    seq_len = 128
    table = synthetic_length_table(
        args.samples, text_share=args.text_share, tile_tokens=8, max_text_tokens=64, seed=1
    )
    strategy = _strategy(args)
    if args.fail_rank is not None:
        _fail_exchange(args.fail_rank, args.fail_at)
    data = (
        GlobalTokenData(table, seq_len, 0, micro_steps=args.data_micro_steps or args.accumulate)
        if args.global_tokens
        else SourceBalancedData(table, seq_len, 0)
        if args.balance or args.balance_exact
        else Data(table, seq_len, 0)
    )
    if args.balance_exact:
        data.exact = True
    if isinstance(data, SourceBalancedData):
        data.objective = args.balance_objective
        data.when = args.balance_when
        data.llm_only = {"none": None, "true": True, "false": False}[args.balance_llm_only]
        data.cost_model = args.balance_cost_model
    callbacks: list[Any] = []
    if args.checkpoint_every:
        callbacks.append(step_checkpoints(args.out, args.checkpoint_every, "{step}"))
    if args.monitor and not args.all_callbacks:
        callbacks.append(
            vb.StragglerMonitor(log_every_n_steps=1, jsonl_dir=Path(args.out) / "straggler")
        )
    if args.all_callbacks:
        callbacks += [
            vb.StragglerMonitor(log_every_n_steps=1, jsonl_dir=Path(args.out) / "straggler"),
            vb.ActivationOffload(test_mode=True, min_bytes=0),  # offloads every saved tensor
            vb.CompiledMoERouting(backend="aot_eager", log_every_n_steps=1),
        ]
    # ModelParallelStrategy refuses precision="64-true": under FSDP the model itself is made
    # float64 in configure_model and Lightning's "32-true" leaves it alone
    fsdp64 = args.strategy.startswith("fsdp") and args.precision == "64-true"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        precision="32-true" if fsdp64 else args.precision,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=args.limit_train_batches,
        overfit_batches=int(args.overfit_batches)
        if args.overfit_batches >= 1
        else args.overfit_batches,
        gradient_clip_val=args.clip,
    )
    dense = args.dense or args.tp > 1  # tensor parallelism splits dense MLPs
    shape = {**SMALL_VLM, "moe_experts": 0} if dense else SMALL_VLM
    model = Job(args.out, **shape, max_positions=seq_len)
    model.record_grads = args.record_grads
    model.float64 = fsdp64
    model.preprocess = args.preprocess
    model.images_only_when_tokens = args.images_only_when_tokens
    fitted = torch.compile(model, backend="aot_eager") if args.compile else model
    trainer.fit(fitted, datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
