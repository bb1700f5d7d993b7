"""Plots StragglerMonitor's per-rank phase charts from a TensorBoard event folder to a PNG.

    python benchmarks/plot_straggler.py runs/vlm/version_0 -o docs/img/straggler_main_job.png

One panel per phase (``straggler/<phase>_ms/rank_<r>``, one line per rank) plus the waste
fraction: the same view as the custom-scalars layout in TensorBoard. Needs matplotlib (the ``dev``
extra). With ``--json`` it prints, last, one JSON object with each series' median per rank.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from common import add_json_flag, print_json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_vlmbalance.timing import COMPUTE_PHASES, WAIT_PHASES

PANELS = (*COMPUTE_PHASES, *WAIT_PHASES, "step")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("logdir", type=Path)
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--title", default="StragglerMonitor: milliseconds per optimizer step")
    add_json_flag(p)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = EventAccumulator(str(args.logdir))
    acc.Reload()
    series: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        m = re.fullmatch(r"straggler/(\w+)_ms/rank_(\d+)", tag)
        if m:
            ev = acc.Scalars(tag)
            series[m[1]][int(m[2])] = (
                np.array([e.step for e in ev]),
                np.array([e.value for e in ev]),
            )
    if not series:
        raise SystemExit(f"no straggler/* scalars in {args.logdir}")
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5), constrained_layout=True)
    for ax, phase in zip(axes.flat, PANELS):
        for rank, (x, y) in sorted(series[phase].items()):
            ax.plot(x, y, label=f"rank {rank}", lw=1.2)
        ax.set_title(f"{phase}_ms")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    waste = acc.Scalars("straggler/waste_frac")
    ax = axes.flat[len(PANELS)]
    ax.plot([e.step for e in waste], [e.value for e in waste], color="black", lw=1.2)
    ax.set_title("waste_frac (waiting / rank-time)")
    ax.set_ylim(0, max(0.05, max(e.value for e in waste) * 1.2))
    ax.grid(alpha=0.3)
    worst = acc.Scalars("straggler/worst_rank")
    ax = axes.flat[len(PANELS) + 1]
    ax.plot([e.step for e in worst], [e.value for e in worst], "o", ms=3, color="black")
    ax.set_title("worst_rank")
    ax.set_yticks(sorted(series[PANELS[0]]))
    ax.grid(alpha=0.3)
    fig.suptitle(args.title)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    if args.json:
        medians = {
            ph: {r: round(float(np.median(y)), 2) for r, (_, y) in ranks.items()}
            for ph, ranks in series.items()
        }
        medians["waste_frac"] = round(float(np.median([e.value for e in waste])), 4)
        print_json(medians)


if __name__ == "__main__":
    main()
