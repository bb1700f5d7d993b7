"""Preemption: how long a 2-process CPU fit takes to stop after SIGTERM, and how it stops.

Each trial launches ``tests.balance.preempt_job`` (the example VLM, GA ``--accumulate``, with
``strategy="vlmbalance"`` in a ``--modes`` mode, or plain ``"ddp"``), waits until both ranks
train, waits a random delay (uniform in ``[0, --max-delay-s)``, seeded), sends SIGTERM to both
ranks back to back (``--target both``, as SLURM and Kubernetes do), to rank 0 only (``rank0``:
Lightning's launcher forwards it to rank 1) or to the job's whole process group (``group``: as
SLURM at the time limit and ``kill -TERM -PGID`` do, DataLoader workers included; see
``--num-workers``), and measures when each rank's process is gone, and its exit status. A
rank still alive after ``--cap-s`` is hung: its stacks are dumped (``faulthandler``, see
``--keep``) and the job is killed. The harness is ``tests.balance.preempt_job.run_trial``, the
same as the test's (``tests/balance/test_preemption.py``).

Per configuration: ``trials``; ``stopped_10s`` (trials where every rank was gone within 10 s);
``median_stop_s`` / ``max_stop_s`` (the slower rank of each trial, over the trials that stopped
before the cap); ``hung``; ``sigterm_all`` (trials where every rank's ``Callback.on_exception``
saw Lightning's ``SIGTERMException``); ``exceptions`` (what the ranks left ``fit`` with, counted);
``thread_left`` (trials with a ``vlmbalance-exchange`` thread alive at a rank's exit);
``no_exit_file`` (trials where a rank never reached ``atexit``: killed by a signal, e.g. by
Lightning's child-process observer); ``rank0_returncodes``; ``exit_status`` (trials counted by
``"rank 0's/rank 1's"`` exit status; 143 is 128 + SIGTERM, what schedulers read as
"terminated").

Commands (from the repository root; about 13 s per trial on 2 CPU cores, plus the cap when hung)::

    python -m tests.suites.preemption --trials 20 --strategies vlmbalance,ddp \\
        --modes overlap,sync,off --target both,rank0 --json
    python -m tests.suites.preemption --trials 20 --strategies vlmbalance --modes overlap \\
        --target group --num-workers 2 --json
    python -m tests.suites.preemption --trials 1 --strategies ddp --target rank0 --json  # smoke

The last line of stdout is one JSON object with ``--json``: ``rows`` (one per configuration, the
fields above) and ``trials`` (each trial's timings, exceptions and, when hung, the main thread's
stack of each hung rank).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.balance.preempt_job import (
    TARGETS,
    exchange_thread_left,
    run_trial,
    sigterm_on_every_rank,
)

STOP_BOUND_S = 10.0
MODES = ("overlap", "sync", "off")


def _csv(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {choices}")
        return items

    return parse


def _configs(args: argparse.Namespace) -> list[tuple[str, str | None, str]]:
    configs: list[tuple[str, str | None, str]] = []
    for strategy in args.strategies:
        for mode in args.modes if strategy == "vlmbalance" else [None]:
            configs += [(strategy, mode, target) for target in args.target]
    return configs


def _compact(res: dict[str, Any]) -> dict[str, Any]:
    """One trial for the JSON: timings and outcomes, the hung ranks' main stack only."""
    keep = ("delay_s", "batches_at_signal", "stop_s", "to_exception_s", "to_atexit_s", "hung")
    trial: dict[str, Any] = {k: res[k] for k in keep}
    trial["rank0_returncode"] = res["rank0_returncode"]
    trial["exit_status"] = res["exit_status"]
    trial["exceptions"] = {
        r: e and {"type": e["type"], "raised_at": e["raised_at"][-1]}
        for r, e in res["exceptions"].items()
    }
    trial["threads_at_exit"] = {
        r: e and [t["name"] for t in e["threads"]] for r, e in res["exits"].items()
    }
    if res["hung"]:
        trial["main_stack"] = res["main_stacks"]
    return trial


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row from its trials."""
    stops = [max(r["stop_s"].values()) for r in results if not r["hung"]]
    exceptions = collections.Counter(
        (e or {}).get("type", "none") for r in results for e in r["exceptions"].values()
    )
    return {
        "trials": len(results),
        "stopped_10s": sum(
            not r["hung"] and max(r["stop_s"].values()) <= STOP_BOUND_S for r in results
        ),
        "median_stop_s": round(statistics.median(stops), 3) if stops else None,
        "max_stop_s": round(max(stops), 3) if stops else None,
        "hung": sum(r["hung"] for r in results),
        "sigterm_all": sum(sigterm_on_every_rank(r) for r in results),
        "exceptions": dict(exceptions),
        "thread_left": sum(exchange_thread_left(r) for r in results),
        "no_exit_file": sum(any(e is None for e in r["exits"].values()) for r in results),
        "rank0_returncodes": dict(collections.Counter(str(r["rank0_returncode"]) for r in results)),
        "exit_status": dict(
            collections.Counter("/".join(map(str, r["exit_status"].values())) for r in results)
        ),
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'strategy':10s} {'mode':7s} {'target':6s} {'trials':>6s} {'<=10s':>5s} {'median':>7s}"
        f" {'max':>7s} {'hung':>4s} {'SIGTERM':>7s} {'thread':>6s} {'noexit':>6s}  exceptions"
    )
    print(head)
    print("-" * len(head))
    for row in rows:

        def sec(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        print(
            f"{row['strategy']:10s} {row['mode'] or '-':7s} {row['target']:6s}"
            f" {row['trials']:6d} {row['stopped_10s']:5d} {sec(row['median_stop_s']):>7s}"
            f" {sec(row['max_stop_s']):>7s} {row['hung']:4d} {row['sigterm_all']:7d}"
            f" {row['thread_left']:6d} {row['no_exit_file']:6d}  {row['exceptions']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=20, help="per configuration")
    p.add_argument("--strategies", type=_csv(("vlmbalance", "ddp")), default=["vlmbalance", "ddp"])
    p.add_argument("--modes", type=_csv(MODES), default=list(MODES), help="of vlmbalance")
    p.add_argument("--target", type=_csv(TARGETS), default=list(TARGETS))
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--max-delay-s", type=float, default=2.0)
    p.add_argument("--cap-s", type=float, default=40.0, help="a rank alive this long is hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", help="keep every trial's files (pids, exceptions, stacks) here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.trials < 1:
        p.error(f"`--trials {args.trials}` must be >= 1")

    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    trials: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for strategy, mode, target in _configs(args):
            results = []
            for i in range(args.trials):
                name = f"{strategy}-{mode or 'ddp'}-{target}-{i}"
                res = run_trial(
                    root / name,
                    strategy=strategy,
                    mode=mode or "off",
                    target=target,
                    delay_s=rng.uniform(0.0, args.max_delay_s),
                    accumulate=args.accumulate,
                    num_workers=args.num_workers,
                    cap_s=args.cap_s,
                )
                results.append(res)
                trials.append({"config": name.rsplit("-", 1)[0], "trial": i, **_compact(res)})
                exc = {r: (e or {}).get("type") for r, e in res["exceptions"].items()}
                print(
                    f"{name}: delay {res['delay_s']:.2f} s, stop_s {res['stop_s']},"
                    f" exceptions {exc}, exit status {res['exit_status']}",
                    flush=True,
                )
            rows.append(
                {"strategy": strategy, "mode": mode, "target": target, **summarize(results)}
            )
    print()
    _print_table(rows)
    if args.json:
        report = {
            "command": " ".join(["python", "-m", "tests.suites.preemption", *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cap_s": args.cap_s,
            "rows": rows,
            "trials": trials,
        }
        print(json.dumps(report))


if __name__ == "__main__":
    main()
