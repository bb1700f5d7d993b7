"""The simulator's row for the main job's own setting, against the waiting the job measured.

Reads one main-job log (``python -m examples.train ... > LOG``: its ``SUMMARY_JSON`` line),
rebuilds the job's data (``examples.train``'s defaults: the same table), and simulates each
mode it trained at its own setting (2 ranks, its accumulation, the packs dealt as the sampler
deals them: ``replay=True``, 33 global batches) with the cost model that mode ended with. The
ranks meet once per optimizer step under ``vlmbalance`` and at every micro-step under
``fsdp_vlmbalance`` (read from the log's first round's strategy flag, ``--strategy``). The
job's ``encoder`` mode orders each rank's packs over its micro-steps (``encoder_overlap``).

Each mode is simulated twice: on the cost model's times (``simulated_waste``), and with the
times off by that model's own error (``simulated_waste_jittered``: ``simulate(jitter=...)``,
the relative error's standard deviation taken as ``sqrt(pi / 2)`` times the held-out mean
absolute percentage error of the last refit the mode adopted, as for a normal error; the
plans and choices are still made on the predicted times, as the job made them).

    python benchmarks/sim_main_job.py LOG [--strategy fsdp_vlmbalance] --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from examples.train import build_parser, build_table
from lightning_vlmbalance import CostModel
from lightning_vlmbalance.sim import simulate

SIM_MODE = {"encoder": "encoder_overlap"}  # the job's encoder mode orders packs per rank
SYNC = {"vlmbalance": "step", "fsdp_vlmbalance": "microstep"}


def compare(log: Path, strategy: str) -> list[dict[str, Any]]:
    lines = [x for x in log.read_text().splitlines() if x.startswith("SUMMARY_JSON ")]
    if not lines:
        raise SystemExit(f"{log}: no SUMMARY_JSON line (did the job finish?)")
    summary = json.loads(lines[-1].removeprefix("SUMMARY_JSON "))
    args = build_parser().parse_args([])  # the job's defaults: its data and setting
    table = build_table(args)
    rows = []
    for mode, measured in summary["modes"].items():
        model = CostModel.from_dict(measured["final_model"])
        jitter = model_error(measured)
        steps = measured["optimizer_steps"]
        row, noisy = (
            _simulated(table, args, summary, strategy, mode, model, steps, error)
            for error in (0.0, jitter)
        )
        rows.append(
            {
                "mode": mode,
                "simulated_waste": round(row["waste_frac"], 4),
                "measured_waiting": measured["waste_frac"],
                "ratio": round(row["waste_frac"] / measured["waste_frac"], 3),
                "jitter": round(jitter, 4),
                "simulated_waste_jittered": round(noisy["waste_frac"], 4),
                "ratio_jittered": round(noisy["waste_frac"] / measured["waste_frac"], 3),
                "auto_formed_at_source": row.get("formed_at_source"),
                "auto_choices": row.get("choices"),
            }
        )
    return rows


def _simulated(
    table: Any,
    args: argparse.Namespace,
    summary: dict[str, Any],
    strategy: str,
    mode: str,
    model: CostModel,
    steps: int,
    jitter: float,
) -> dict[str, Any]:
    """The simulator's row of one mode at the job's setting."""
    (row,) = simulate(
        table,
        seq_len=args.seq_len,
        cost_model=model,
        dp=[summary["ranks"]],
        ga=[args.accumulate],
        modes=[SIM_MODE.get(mode, mode)],
        replay=True,
        batches=steps,
        seed=args.seed,
        sync_every=SYNC[strategy],
        jitter=jitter,
    )
    return row


def model_error(measured: dict[str, Any]) -> float:
    """The relative error of the mode's cost model as a standard deviation: ``sqrt(pi / 2)``
    times the held-out MAPE of the last refit it adopted (0 without one)."""
    errors = (measured.get("calibration") or {}).get("held_out_error") or []
    return math.sqrt(math.pi / 2.0) * float(errors[-1][1]) if errors else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", type=Path)
    p.add_argument("--strategy", choices=tuple(SYNC), default="vlmbalance")
    common.add_json_flag(p)
    args = p.parse_args()
    rows = compare(args.log, args.strategy)
    if args.json:
        common.print_json({**common.stamp(), "log": str(args.log), "rows": rows})
    else:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()
