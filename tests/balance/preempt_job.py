"""Preemption of a 2-process CPU fit: the job, and the harness that stops it with SIGTERM.

The job (Lightning's DDP launcher re-executes it for rank 1, a child process of rank 0)::

    python -m tests.balance.preempt_job --out DIR --strategy vlmbalance --mode overlap

trains the example VLM for far longer than a trial lasts and writes, per rank ``r``:

==========================  ===============================================================
``DIR/pid{r}.json``         ``{"pid", "time"}`` at ``on_train_start``
``DIR/step{r}``             ``"{micro-batches done} {optimizer steps}"`` after every micro-batch
``DIR/exception{r}.json``   from ``Callback.on_exception``: the exception's type and where it
                            was raised
``DIR/exit{r}.json``        at interpreter exit (``atexit``): the threads still alive, what
                            ``trainer.fit`` raised; rank 0's also the exit status of each rank
                            its launcher started (it waits for them, at most 30 s)
``DIR/stacks{r}.txt``       every thread's stack, written by ``faulthandler`` on ``SIGUSR1``
``DIR/stdout``, ``stderr``  both ranks' output (rank 1 inherits rank 0's files)
==========================  ===============================================================

The harness, :func:`run_trial`, shared by ``tests/balance/test_preemption.py`` and
``tests/suites/preemption.py``: it launches the job in a session of its own, waits until both
ranks train, waits ``delay_s``, sends SIGTERM to both ranks (back to back, as SLURM and
Kubernetes stop a job), to rank 0 only (the ranks agree on it), or to the job's whole process
group (``"group"``: as SLURM at the time limit or ``kill -TERM -PGID`` do, DataLoader workers
included), and measures when each rank's process is gone and with which exit status. A rank
still alive after ``cap_s`` is hung: its stacks are dumped, then the whole session is killed with
SIGKILL, as it is in every case when the trial ends.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_vlmbalance as vb
from examples.train import ReadAheadLoader
from examples.vlm import ToyVLM
from lightning_vlmbalance.synthetic import synthetic_length_table
from tests.packing.lightning_job import SMALL_VLM, Data

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.balance.preempt_job"
EXCHANGE_THREAD = "vlmbalance-exchange"
TARGETS = ("both", "rank0", "group", "end")  # "end": no signal, the fit ends (--max-steps)
SIGTERM_EXIT = 128 + signal.SIGTERM  # the status a scheduler reads as "terminated" (143)
CHILD_WAIT_S = 30.0
RANKS = (0, 1)
# what a launched job must not inherit: it is a fresh 2-process job of its own
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")


# -- the job ------------------------------------------------------------------------------------


class PreemptRecorder(L.Callback):
    """Writes the pid, heartbeat and exception files of the module docstring."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.batches = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"pid": os.getpid(), "time": time.time()}
        (self.out / f"pid{trainer.global_rank}.json").write_text(json.dumps(record))

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.batches += 1
        # written aside and renamed: the harness never reads a half-written heartbeat
        tmp = self.out / f".step{trainer.global_rank}"
        tmp.write_text(f"{self.batches} {trainer.global_step}")
        tmp.replace(self.out / f"step{trainer.global_rank}")

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        frames = traceback.extract_tb(exception.__traceback__)[-4:]
        record = {
            "type": type(exception).__name__,
            "sigterm": isinstance(exception, SIGTERMException),
            "time": time.time(),
            "batches": self.batches,
            "global_step": trainer.global_step,
            "raised_at": [f"{f.filename}:{f.lineno} {f.name}" for f in frames],
        }
        (self.out / f"exception{trainer.global_rank}.json").write_text(json.dumps(record))


class WorkerData(Data):
    """The job's data: ``Data`` with persistent workers or the main job's read-ahead thread
    (``examples.train.ReadAheadLoader``) when asked."""

    def __init__(self, table: Any, seq_len: int, num_workers: int, persistent: bool) -> None:
        super().__init__(table, seq_len, num_workers)
        self.persistent, self.read_ahead = persistent, 0

    @override
    def train_dataloader(self) -> vb.PackedDataLoader:
        loader = super().train_dataloader()
        kwargs = dict(loader.dataloader_kwargs)
        if self.persistent:
            kwargs["persistent_workers"] = True
        if not (self.persistent or self.read_ahead):
            return loader
        cls = ReadAheadLoader if self.read_ahead else vb.PackedDataLoader
        extra = {"read_ahead": self.read_ahead} if self.read_ahead else {}
        return cls(
            loader.dataset,
            loader.sampler,
            loader.collate_fn,
            trainer=self.trainer,
            **extra,
            **kwargs,
        )


def _write_exit(path: Path, fit: dict[str, Any], launched: list[subprocess.Popen]) -> None:
    """At interpreter exit (non-daemon threads already joined): which threads are still alive,
    and (rank 0) the exit status of the ranks its launcher started, once they are gone."""
    now = time.time()
    threads = [
        {"name": t.name, "daemon": t.daemon}
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ]
    statuses = {}
    for rank, child in enumerate(launched, start=1):
        try:
            statuses[rank] = child.wait(CHILD_WAIT_S)
        except subprocess.TimeoutExpired:
            statuses[rank] = None
    record = {"time": now, "threads": threads, "launched_exit_status": statuses, **fit}
    path.write_text(json.dumps(record))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--strategy", default="vlmbalance", choices=("vlmbalance", "fsdp_vlmbalance", "ddp")
    )
    p.add_argument("--mode", default="overlap", choices=("overlap", "sync", "off"))
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--epochs", type=int, default=1000, help="never reached in a trial")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument(
        "--read-ahead", type=int, default=0, help="the main job's read-ahead thread (packs)"
    )
    p.add_argument("--max-steps", type=int, default=-1, help="a fit that ends (target 'end')")
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    # rank 0 runs this before its launcher starts rank 1, which gets LOCAL_RANK in its env
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    stacks = (out / f"stacks{rank}.txt").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    fit: dict[str, Any] = {"raised": None}
    launched: list[subprocess.Popen] = []  # rank 0: the ranks Lightning's launcher started
    atexit.register(_write_exit, out / f"exit{rank}.json", fit, launched)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    seq_len = 128
    table = synthetic_length_table(
        args.samples, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1
    )
    strategy: Any = "ddp"
    if args.strategy == "vlmbalance":
        strategy = vb.VLMBalanceStrategy(mode=args.mode)
    elif args.strategy == "fsdp_vlmbalance":
        strategy = vb.FSDPVLMBalanceStrategy(config=vb.RebalanceConfig(mode=args.mode))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        callbacks=[PreemptRecorder(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ToyVLM(**SMALL_VLM, max_positions=seq_len)
    try:
        data = WorkerData(table, seq_len, args.num_workers, args.persistent_workers)
        data.read_ahead = args.read_ahead
        trainer.fit(model, datamodule=data)
        # the fit returned (target "end"): from here every process must be gone within a bound
        (out / f"fitend{rank}.json").write_text(json.dumps({"time": time.time()}))
    except BaseException as err:
        fit["raised"] = type(err).__name__
        fit["exit_code"] = err.code if isinstance(err, SystemExit) else 1
        raise
    finally:
        launched.extend(getattr(trainer.strategy.launcher, "procs", None) or [])


# -- the harness --------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """Whether a process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _wait_training(out: Path, proc: subprocess.Popen, timeout_s: float) -> dict[int, int]:
    """Waits until both ranks have written their pid and done a micro-batch; returns the pids."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the job exited with {proc.returncode} before training:\n{_tail(out / 'stderr')}"
            )
        pids = {r: _read_json(out / f"pid{r}.json") for r in RANKS}
        if all(pids.values()) and all((out / f"step{r}").exists() for r in RANKS):
            return {r: int(pids[r]["pid"]) for r in RANKS}  # type: ignore[index]
        time.sleep(0.05)
    raise TimeoutError(
        f"the job did not start training within {timeout_s} s:\n{_tail(out / 'stderr')}"
    )


def _wait_fit_end(out: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    """Waits until every rank's ``trainer.fit`` has returned (its ``fitend`` file)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((out / f"fitend{r}.json").exists() for r in RANKS):
            return
        if proc.poll() is not None and not (out / "fitend0.json").exists():
            raise RuntimeError(
                f"the job exited with {proc.returncode} before its fit ended:\n"
                f"{_tail(out / 'stderr')}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"the fit did not end within {timeout_s} s:\n{_tail(out / 'stderr')}")


def main_thread_stack(stacks: str, lines: int = 30) -> str:
    """The innermost ``lines`` frames of the main thread in a ``faulthandler`` dump (which lists
    threads newest first, each frame innermost first)."""
    blocks = [b for b in stacks.split("\n\n") if b.strip()]
    return "\n".join(blocks[-1].splitlines()[: lines + 1]) if blocks else ""


def _since(record: dict[str, Any] | None, start: float) -> float | None:
    return None if record is None else round(record["time"] - start, 3)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def run_trial(
    out: Path,
    *,
    strategy: str = "vlmbalance",
    mode: str = "overlap",
    target: str = "both",
    delay_s: float = 0.0,
    accumulate: int = 4,
    num_workers: int = 0,
    persistent_workers: bool = False,
    read_ahead: int = 0,
    max_steps: int = 8,
    cap_s: float = 40.0,
    startup_timeout_s: float = 180.0,
) -> dict[str, Any]:
    """Launches the job, stops it with SIGTERM ``delay_s`` after both ranks train, and measures.
    With ``target="end"`` no signal is sent: the fit ends after ``max_steps`` optimizer steps,
    and the times count from when the last rank's ``fit`` returned.

    Returns a JSON-able dict: ``stop_s`` (per rank, seconds from the signal until its process
    was gone; ``None`` if still alive at ``cap_s``), ``exit_status`` (per rank: rank 0's as the
    harness sees it, negative when killed by a signal; rank 1's as its launcher, rank 0, saw
    it; ``None`` if unknown), ``left_in_group`` (pids of the job's process group, DataLoader
    workers included, still alive once every rank was gone), ``to_exception_s`` and ``to_atexit_s``
    (seconds from the signal to ``on_exception`` and to ``atexit``), ``hung``, ``exceptions``
    and ``exits`` (the ranks' files, ``None`` where none was written), ``rank0_returncode`` (of
    the job's process: ``-9`` when killed, by the harness or by Lightning's child-process
    observer), ``batches_at_signal`` (each rank's heartbeat) and, for a hung trial, the
    ``stacks`` of the ranks still alive (``main_stacks``: their main thread's innermost frames)
    and the tail of the job's ``stderr``.

    Raises:
        ValueError: for an unknown ``target``.
        RuntimeError, TimeoutError: if the job fails or is too slow to start training.
    """
    if target not in TARGETS:
        raise ValueError(f"`run_trial(target={target!r})`: expected one of {TARGETS}")
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONPATH"] = str(ROOT)
    args = ["--out", str(out), "--strategy", strategy, "--mode", mode]
    args += ["--accumulate", str(accumulate), "--num-workers", str(num_workers)]
    args += ["--read-ahead", str(read_ahead)] + ["--persistent-workers"] * persistent_workers
    if target == "end":
        args += ["--max-steps", str(max_steps)]
    with (out / "stdout").open("w") as stdout, (out / "stderr").open("w") as stderr:
        # a session of its own: rank 1 is in it too, so one killpg cleans up whatever happens
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, *args],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        pids = _wait_training(out, proc, startup_timeout_s)
        time.sleep(delay_s)
        batches_at_signal = {r: _tail(out / f"step{r}", 100) for r in RANKS}
        if target == "end":  # the clock starts when the last rank's fit has returned
            _wait_fit_end(out, proc, startup_timeout_s)
        sent, sent_wall = time.monotonic(), time.time()
        if target == "group":  # every process of the job, DataLoader workers included
            os.killpg(proc.pid, signal.SIGTERM)
        for r in RANKS if target == "both" else (0,) if target == "rank0" else ():
            os.kill(pids[r], signal.SIGTERM)
        stop_s: dict[int, float | None] = dict.fromkeys(RANKS)
        while time.monotonic() - sent < cap_s:
            proc.poll()  # reaps rank 0 (our child) as soon as it exits
            for r in RANKS:
                if stop_s[r] is None and _gone(pids[r]):
                    stop_s[r] = time.monotonic() - sent
            if all(s is not None for s in stop_s.values()):
                break
            time.sleep(0.02)
        hung = [r for r in RANKS if stop_s[r] is None]
        left_in_group = [] if hung else _group_members(proc.pid)
        stacks: dict[int, str] = {}
        if hung:  # where are they? faulthandler writes every thread's stack on SIGUSR1
            for r in hung:
                os.kill(pids[r], signal.SIGUSR1)
            time.sleep(1.5)
            stacks = {r: _tail(out / f"stacks{r}.txt", 20000) for r in hung}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    exceptions = {r: _read_json(out / f"exception{r}.json") for r in RANKS}
    exits = {r: _read_json(out / f"exit{r}.json") for r in RANKS}
    launched = (exits[0] or {}).get("launched_exit_status", {})
    exit_status = {0: proc.returncode, **{r: launched.get(str(r)) for r in RANKS[1:]}}
    result: dict[str, Any] = {
        "strategy": strategy,
        "mode": mode if strategy != "ddp" else None,
        "target": target,
        "delay_s": round(delay_s, 3),
        "batches_at_signal": batches_at_signal,
        "stop_s": {r: None if s is None else round(s, 3) for r, s in stop_s.items()},
        "hung": bool(hung),
        # where the time went: signal -> on_exception -> atexit -> process gone
        "to_exception_s": {r: _since(exceptions[r], sent_wall) for r in RANKS},
        "to_atexit_s": {r: _since(exits[r], sent_wall) for r in RANKS},
        "num_workers": num_workers,
        "persistent_workers": persistent_workers,
        "read_ahead": read_ahead,
        "rank0_returncode": proc.returncode,
        "exit_status": exit_status,
        "left_in_group": left_in_group,
        "exceptions": exceptions,
        "exits": exits,
    }
    if hung:
        result["stacks"] = stacks
        result["main_stacks"] = {r: main_thread_stack(text) for r, text in stacks.items()}
        result["stderr_tail"] = _tail(out / "stderr")
    return result


def sigterm_on_every_rank(result: dict[str, Any]) -> bool:
    """Whether every rank went through Lightning's ``SIGTERMException`` path."""
    return all((e or {}).get("sigterm", False) for e in result["exceptions"].values())


def exchange_thread_left(result: dict[str, Any]) -> bool:
    """Whether some rank's exit file lists a live exchange thread."""
    return any(
        t["name"] == EXCHANGE_THREAD
        for exit_ in result["exits"].values()
        if exit_ is not None
        for t in exit_["threads"]
    )


if __name__ == "__main__":
    main()
