"""``vlmbalance-sim``: what-if tables and plots of straggler waste and rebalancing gain.

    vlmbalance-sim run --data mix.csv --text-share 0.4 --seq-len 8192 --dp 8,64,512,4096 \\
        --ga 1,8 --modes off,sync,overlap,budget [--cost-model cost.json] [--json] \\
        [--training-strategy vlmbalance|fsdp_vlmbalance|ddp]
    vlmbalance-sim calibrate OUT/straggler -o cost.json

``run`` prints a table (or, with ``--json``, a JSON list of rows) and writes a PNG of waste and
gain against the data-parallel size, one line per mode and micro-step count (``--plot``;
needs matplotlib). ``--modes`` are the rebalancing modes (``RebalanceConfig.mode``'s word;
``--strategies``, their old name, is a deprecated alias). ``calibrate`` fits the cost model to
StragglerMonitor JSON lines (a file or a folder of ``rank_*.jsonl``) and prints the fit error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.sim.simulate import (
    ALL_MODES,
    MODES,
    SYNC_EVERY,
    ExchangeModel,
    simulate,
)
from lightning_vlmbalance.synthetic import read_length_csv, resample_text_share

# how often the ranks of each Trainer strategy meet: "vlmbalance" syncs once per optimizer step;
# FSDP all-gathers and reduce-scatters in every micro-batch; Lightning's plain "ddp" broadcasts its
# SIGTERM flag at every micro-batch
SYNC_OF_STRATEGY = {"vlmbalance": "step", "fsdp_vlmbalance": "microstep", "ddp": "microstep"}

_COLUMNS = (
    ("mode", "{:>15}"),
    ("dp", "{:>6}"),
    ("ga", "{:>4}"),
    ("step_ms", "{:>11.1f}"),
    ("step_p95_ms", "{:>11.1f}"),
    ("ideal_step_ms", "{:>11.1f}"),
    ("waste_frac", "{:>7.3f}"),
    ("tokens_per_s_per_rank", "{:>9.0f}"),
    ("packing_efficiency", "{:>6.3f}"),
    ("moved_packs", "{:>8.1f}"),
    ("moved_images", "{:>8.1f}"),
    ("gain", "{:>+7.3f}"),
)


def comma_list(
    item: Callable[[str], Any] = str,
    *,
    choices: Sequence[Any] | None = None,
    minimum: Any = None,
) -> Callable[[str], list[Any]]:
    """An argparse ``type`` that reads a comma-separated list: ``"8,64"`` -> ``[8, 64]``.

    Empty items are skipped (``"8,"`` is ``[8]``); the list must not be empty.

    Args:
        item: converts one item (``int``, ``float``, ``str``, ...).
        choices: the allowed values, if restricted.
        minimum: the smallest allowed value, if bounded.

    Example::

        parser.add_argument("--dp", type=comma_list(int, minimum=1), default=[8, 64])
        parser.add_argument("--mode", type=comma_list(choices=("off", "sync", "overlap")))
    """
    kind = "integers" if item is int else "numbers" if item is float else "values"

    def parse(text: str) -> list[Any]:
        try:
            values = [item(v) for v in text.split(",") if v]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind}, got {text!r}")
        if choices is not None and any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {', '.join(map(str, choices))}; got {text!r}"
            )
        if minimum is not None and min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind} >= {minimum}, got {text!r}")
        return values

    return parse


def number(
    item: Callable[[str], Any] = int,
    *,
    minimum: Any = None,
    maximum: Any = None,
    above: Any = None,
) -> Callable[[str], Any]:
    """An argparse ``type`` for one finite number in a range (argparse names the flag).

    Args:
        item: ``int`` or ``float``.
        minimum, maximum: inclusive bounds, if any.
        above: an exclusive lower bound, if any (``above=0``: positive).
    """
    kind = "an integer" if item is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = item(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"expected {kind} > {above}, got {text!r}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind} >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected {kind} <= {maximum}, got {text!r}")
        return value

    return parse


class _DeprecatedAlias(argparse.Action):
    """Stores like the flag it aliases, with a one-line deprecation note on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: note: {option_string} is deprecated, use {self.new} (same values)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlmbalance-sim", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a sweep")
    run.add_argument("--data", action="append", type=Path, required=True, metavar="CSV")
    run.add_argument(
        "--text-share", type=number(float, minimum=0.0, maximum=1.0), default=None, metavar="F"
    )
    run.add_argument("--seq-len", type=number(int, minimum=1), default=8192)
    run.add_argument("--dp", type=comma_list(int, minimum=1), default=[8, 64, 512])
    run.add_argument("--ga", type=comma_list(int, minimum=1), default=[1, 8])
    modes = run.add_mutually_exclusive_group()  # the old name with the new: refused
    modes.add_argument(
        "--modes",
        dest="modes",
        type=comma_list(choices=ALL_MODES),
        default=list(MODES),
        help=f"the rebalancing modes to compare: any of {', '.join(ALL_MODES)}"
        f" (default: {','.join(MODES)})",
    )
    modes.add_argument(
        "--strategies",
        dest="modes",
        action=_DeprecatedAlias,
        new="--modes",
        type=comma_list(choices=ALL_MODES),
        default=argparse.SUPPRESS,
        metavar="MODES",
        help="deprecated: the old name of --modes",
    )
    run.add_argument("--cost-model", type=Path, default=None, metavar="FILE")
    run.add_argument(
        "--batches",
        type=number(int, minimum=1),
        default=32,
        help="global batches per configuration",
    )
    run.add_argument(
        "--training-strategy",
        choices=tuple(SYNC_OF_STRATEGY),
        default=None,
        help="the Trainer strategy modelled: how often its ranks synchronise (vlmbalance, the"
        " default: once per optimizer step; fsdp_vlmbalance, and Lightning's plain ddp: every"
        " micro-batch)",
    )
    run.add_argument(
        "--sync-every",
        choices=SYNC_EVERY,
        default=None,
        help="how often the ranks synchronise, overriding the default strategy's (an error if"
        " it contradicts an explicit --training-strategy)",
    )
    run.add_argument(
        "--bandwidth-gb-s", type=number(float, above=0.0), default=ExchangeModel.bandwidth_gb_s
    )
    run.add_argument("--seed", type=number(int, minimum=0), default=0)
    run.add_argument("--plot", type=Path, default=Path("vlmbalance_sim.png"), metavar="PNG")
    run.add_argument("--no-plot", action="store_true")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--json", action="store_true")
    cal = sub.add_parser("calibrate", help="fit the cost model to StragglerMonitor JSON lines")
    cal.add_argument("timings", type=Path, metavar="TIMINGS")
    cal.add_argument("-o", "--output", type=Path, required=True, metavar="COST_JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        return _run(args)
    except (ValueError, OSError) as err:
        print(f"vlmbalance-sim: error: {err}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    model = CostModel()
    report = model.fit(args.timings)
    model.save(args.output)
    print(f"fitted on {args.timings}: {report}")
    print(f"wrote {args.output}")
    return 0


def _sync_every(args: argparse.Namespace) -> str:
    """The synchronisation modelled: ``--sync-every``, else that of ``--training-strategy``
    (default ``vlmbalance``). Only an explicit contradiction of the two is an error."""
    if args.training_strategy is None:
        return args.sync_every or SYNC_OF_STRATEGY["vlmbalance"]
    implied = SYNC_OF_STRATEGY[args.training_strategy]
    if args.sync_every and args.sync_every != implied:
        raise ValueError(
            f"`--training-strategy {args.training_strategy}` synchronises every {implied},"
            f" not `--sync-every {args.sync_every}`: give one of the two"
        )
    return implied


def _run(args: argparse.Namespace) -> int:
    sync_every = _sync_every(args)
    if not args.no_plot:
        check_plot_path(args.plot)  # before the sweep: a bad path must not waste it
    table = read_length_csv(*args.data)
    if args.text_share is not None:
        table = resample_text_share(table, args.text_share, args.seed)
    model = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    total = len(args.dp) * len(args.ga) * len(args.modes) * args.batches
    bar = None
    if not args.no_progress and not args.json:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="simulating", unit="batch", file=sys.stderr)
    try:
        rows = simulate(
            table,
            seq_len=args.seq_len,
            cost_model=model,
            dp=args.dp,
            ga=args.ga,
            modes=args.modes,
            exchange=ExchangeModel(bandwidth_gb_s=args.bandwidth_gb_s),
            batches=args.batches,
            seed=args.seed,
            sync_every=sync_every,
            progress=bar.update if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    # the table first: a plot that fails after all does not lose it
    if args.json:
        print(json.dumps(rows), flush=True)
    else:
        print(" ".join(name for name, _ in _COLUMNS))
        for row in rows:
            print(
                " ".join(fmt.format(row[k]) if row[k] is not None else "-" for k, fmt in _COLUMNS)
            )
        sys.stdout.flush()
    if not args.no_plot:
        plot(rows, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def check_plot_path(path: Path) -> None:
    """Refuses a ``--plot`` path that :func:`plot` could not write: no matplotlib, a folder
    that does not exist or cannot be written, or a file type matplotlib cannot save.

    Raises:
        ValueError: naming ``--plot`` and the path.
    """
    plt = _pyplot()
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"`--plot {path}` is a folder; give a file name such as sim.png")
    if not folder.is_dir():
        raise ValueError(f"`--plot {path}`: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"`--plot {path}`: the folder {folder} is not writable")
    suffix = path.suffix.lstrip(".").lower()
    fig = plt.figure()
    try:
        supported = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if suffix and suffix not in supported:
        raise ValueError(
            f"`--plot {path}`: matplotlib cannot write .{suffix} files; use one of"
            f" {', '.join(sorted(supported))}"
        )


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError(
            "--plot needs matplotlib (pip install matplotlib) or pass --no-plot"
        ) from err
    return plt


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Waste and gain against the data-parallel size, one line per (mode, ga)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["mode"], r["ga"]) for r in rows}, key=lambda k: (k[1], k[0]))
    colors = {m: f"C{i}" for i, m in enumerate(ALL_MODES)}
    styles = {
        ga: ("-", "--", ":", "-.")[i % 4] for i, ga in enumerate(sorted({k[1] for k in keys}))
    }
    for mode, ga in keys:
        sel = [r for r in rows if (r["mode"], r["ga"]) == (mode, ga)]
        sel.sort(key=lambda r: r["dp"])
        dps = [r["dp"] for r in sel]
        style = {"color": colors[mode], "linestyle": styles[ga], "marker": "o"}
        label = f"mode {mode}, ga={ga}"
        left.plot(dps, [r["waste_frac"] for r in sel], label=label, **style)
        right.plot(dps, [r["gain"] or 0.0 for r in sel], label=label, **style)
    for ax, title in (
        (left, "straggler waste (1 - ideal / step)"),
        (right, "throughput gain over off"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel ranks")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
