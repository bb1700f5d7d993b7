"""The simulator's row for the main job's own setting, against the waiting the job measured.

Reads one main-job log (``python -m examples.train ... > LOG``: its ``SUMMARY_JSON`` line),
rebuilds the job's data (``examples.train``'s defaults: the same table), and simulates each
mode it trained at its own setting (2 ranks, its accumulation, the packs dealt as the sampler
deals them: ``replay=True``, 33 global batches) with the cost model that mode ended with. The
ranks meet once per optimizer step under ``vlmbalance`` and at every micro-step under
``fsdp_vlmbalance`` (read from the log's first round's strategy flag, ``--strategy``). The
job's ``encoder`` mode orders each rank's packs over its micro-steps (``encoder_overlap``).

    python benchmarks/sim_main_job.py LOG [--strategy fsdp_vlmbalance] --json
"""

from __future__ import annotations

import argparse
import json
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
        (row,) = simulate(
            table,
            seq_len=args.seq_len,
            cost_model=model,
            dp=[summary["ranks"]],
            ga=[args.accumulate],
            modes=[SIM_MODE.get(mode, mode)],
            replay=True,
            batches=measured["optimizer_steps"],
            seed=args.seed,
            sync_every=SYNC[strategy],
        )
        rows.append(
            {
                "mode": mode,
                "simulated_waste": round(row["waste_frac"], 4),
                "measured_waiting": measured["waste_frac"],
                "ratio": round(row["waste_frac"] / measured["waste_frac"], 3),
                "auto_formed_at_source": row.get("formed_at_source"),
                "auto_choices": row.get("choices"),
            }
        )
    return rows


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
