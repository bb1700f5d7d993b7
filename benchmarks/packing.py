"""Benchmark of the packing core on real per-sample length statistics.

What it measures, for one packer (``greedy``: ``pack_greedy``, shuffled fill with pair completion;
``greedy_cap``: the same under ``--image-budget`` image tokens per pack, what
``PackingSampler(max_image_tokens_per_pack=...)`` runs; ``bfd``: plain best-fit-decreasing;
``budget``: best-fit-decreasing with an image-token budget per pack) on one sample mix:

* packing quality: ``efficiency`` = sample tokens / (packs x ``seq_len``), next to ``limit``, the
  best any packer could do (sum / (ceil(sum / seq_len) x seq_len)), and ``gap_to_limit``;
* speed: ``samples_per_s`` over the median of ``--repeat`` timed packer calls (only the packer
  call is timed, with ``time.perf_counter``; single-threaded numpy/python);
* vision load balance: image tokens per pack (mean, max, and ``cv`` = std / mean, which shows how
  unequal the vision-encoder work of the packs is);
* correctness, checked on every run: every sample is in exactly one pack (``split_samples`` counts
  positions that are missing or appear more than once, and must be 0) and no pack exceeds
  ``seq_len``. The script exits with status 1 if a check fails.

Data: CSV length tables (``total_tokens,image_tokens,images``). Without ``--data`` it uses the
four omnibal image sets plus the openchat text-only set from ``shared/data`` next to the repository
checkout, or, if that folder does not exist, ``synthetic_length_table(70_000, ...)``
(``"source": "synthetic"``). ``--text-share F`` fixes the mix: every image row is kept once,
``round(F / (1 - F) * n_image)`` text-only rows are drawn uniformly with replacement
(``numpy.random.default_rng(seed)``), and the combined rows are shuffled with the same generator;
that order is what the packers receive. Samples longer than ``seq_len`` are counted as
``overlong`` and left out before packing.

Commands (from the repository root, virtualenv active)::

    python benchmarks/packing.py --text-share 0 --seq-len 8192 --json
    python benchmarks/packing.py --text-share 0.2 --seq-len 8192 --packer bfd --json
    python benchmarks/packing.py --text-share 0.4 --seq-len 8192 --packer budget \\
        --image-budget 4096 --json
    python benchmarks/packing.py --data a.csv --data b.csv --text-share 0.2 --seq-len 4096

With ``--json`` the last line of stdout is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from common import add_json_flag, print_json, stamp, timed

from lightning_vlmbalance.packing.binpack import (
    Packs,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
)
from lightning_vlmbalance.synthetic import (
    LengthTable,
    read_length_csv,
    synthetic_length_table,
)
from lightning_vlmbalance.synthetic import resample_text_share as _resample_text_share

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_FILES = (
    "omnibal/ai2d_train_12k.csv",
    "omnibal/chartqa_train_18k.csv",
    "omnibal/docvqa_train_10k.csv",
    "omnibal/synthdog_en.csv",
    "multipack/openchat_text.csv",
)
SYNTHETIC_SAMPLES = 70_000


class BenchmarkError(Exception):
    """A user-facing error (bad arguments or data); reported without a traceback."""


def default_data() -> list[Path] | None:
    """The default CSV files, or ``None`` (use synthetic data) if the shared data is absent."""
    if not SHARED_DATA.is_dir():
        return None
    files = [SHARED_DATA / name for name in DEFAULT_FILES if (SHARED_DATA / name).is_file()]
    return files or None


def resample_text_share(table: LengthTable, text_share: float, seed: int) -> LengthTable:
    """:func:`lightning_vlmbalance.synthetic.resample_text_share`, errors as BenchmarkError."""
    try:
        return _resample_text_share(table, text_share, seed)
    except ValueError as err:
        raise BenchmarkError(str(err).replace("text_share", "--text-share")) from err


def make_packer(
    name: str, seq_len: int, window: int, image_tokens: np.ndarray, image_budget: int
) -> Callable[[np.ndarray], Packs]:
    """The packer call to time, as a function of the lengths."""
    if name == "greedy":
        return lambda total: pack_greedy(total, seq_len, window=window)
    if name == "greedy_cap":  # PackingSampler(max_image_tokens_per_pack=image_budget)
        return lambda total: pack_greedy(
            total, seq_len, window=window, image_tokens=image_tokens, max_image_tokens=image_budget
        )
    if name == "bfd":
        return lambda total: pack_best_fit_decreasing(total, seq_len, window=window)
    if name == "budget":
        return lambda total: pack_best_fit_decreasing(
            total, seq_len, window=window, image_tokens=image_tokens, image_budget=image_budget
        )
    raise BenchmarkError(f"unknown packer {name!r}")


def split_samples(packs: Packs, n: int) -> int:
    """Samples not wholly inside exactly one pack: missing, or at more than one place."""
    positions = np.asarray(packs.positions, dtype=np.int64)
    valid = (positions >= 0) & (positions < n)
    counts = np.bincount(positions[valid], minlength=n)
    # positions outside [0, n) are not samples but are a broken plan; count them as well
    return int(np.count_nonzero(counts != 1)) + int(np.count_nonzero(~valid))


def verify(packs: Packs, total: np.ndarray, seq_len: int) -> tuple[int, int, bool]:
    """Checks one plan: ``(split_samples, max_pack_tokens, ok)``.

    ``ok`` means the sorted positions equal ``arange(n)`` and no pack exceeds ``seq_len``.
    """
    n = len(total)
    split = split_samples(packs, n)
    exact = len(packs.positions) == n and np.array_equal(
        np.sort(packs.positions), np.arange(n, dtype=np.int64)
    )
    pack_tokens = packs.tokens(total)
    max_tokens = int(pack_tokens.max()) if len(pack_tokens) else 0
    return split, max_tokens, bool(exact and split == 0 and max_tokens <= seq_len)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark the packers on real per-sample length statistics."
    )
    parser.add_argument(
        "--data",
        action="append",
        type=Path,
        default=None,
        metavar="CSV",
        help="length table (total_tokens,image_tokens,images); repeatable. Default: the omnibal"
        " and openchat files in shared/data, else synthetic data.",
    )
    parser.add_argument(
        "--text-share",
        type=float,
        required=True,
        metavar="F",
        help="fraction of text-only samples after resampling, in [0, 1)",
    )
    parser.add_argument("--seq-len", type=int, required=True, metavar="N", help="pack capacity")
    parser.add_argument(
        "--packer", choices=("greedy", "greedy_cap", "bfd", "budget"), default="greedy"
    )
    parser.add_argument(
        "--image-budget",
        type=int,
        default=None,
        metavar="N",
        help="image tokens per pack for --packer budget (default: seq_len // 2)",
    )
    parser.add_argument("--window", type=int, default=4096, metavar="N", help="packing window")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="resampling seed")
    parser.add_argument("--repeat", type=int, default=3, metavar="R", help="timed runs")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.seq_len < 1:
        parser.error(f"--seq-len {args.seq_len} must be >= 1")
    if args.window < 1:
        parser.error(f"--window {args.window} must be >= 1")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} must be >= 1")
    if not 0.0 <= args.text_share <= 1.0:
        parser.error(f"--text-share {args.text_share} must be in [0, 1)")
    if args.image_budget is None:
        args.image_budget = args.seq_len // 2
    if args.image_budget < 0:
        parser.error(f"--image-budget {args.image_budget} must be >= 0")
    return args


def load(args: argparse.Namespace) -> tuple[LengthTable, list[str] | str]:
    """The resampled, shuffled length table and its source (file names or ``"synthetic"``)."""
    files = args.data if args.data else default_data()
    if files is None:
        # the synthetic rows are drawn i.i.d. at the requested text share: already in random order
        table = synthetic_length_table(
            SYNTHETIC_SAMPLES, text_share=args.text_share, seed=args.seed
        )
        return table, "synthetic"
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise BenchmarkError(f"--data: no such file: {', '.join(missing)}")
    try:
        table = read_length_csv(*files)
    except (ValueError, KeyError) as err:
        raise BenchmarkError(f"--data: {err}") from err
    return resample_text_share(table, args.text_share, args.seed), [Path(f).name for f in files]


def run(args: argparse.Namespace) -> dict[str, object]:
    table, source = load(args)
    total_all = np.asarray(table.total_tokens, dtype=np.int64)
    image_all = np.asarray(table.image_tokens, dtype=np.int64)
    n_text_all = int(np.count_nonzero(image_all == 0))
    overlong_mask = total_all > args.seq_len
    empty_mask = total_all < 1  # a packer rejects empty samples; none in the shared data
    over_budget_mask = np.zeros_like(overlong_mask)
    if args.packer in ("budget", "greedy_cap"):
        over_budget_mask = ~overlong_mask & (image_all > args.image_budget)
    keep = ~(overlong_mask | empty_mask | over_budget_mask)
    total = total_all[keep]
    image = image_all[keep]
    n = len(total)
    if n == 0:
        raise BenchmarkError("no samples left to pack")

    packer = make_packer(args.packer, args.seq_len, args.window, image, args.image_budget)
    times: list[float] = []
    split = max_tokens = 0
    valid = True
    packs: Packs | None = None
    for _ in range(args.repeat):
        packs, seconds = timed(packer, total)
        times.append(seconds)
        run_split, run_max, run_ok = verify(packs, total, args.seq_len)
        # report the worst run (the packers are deterministic, so all runs should agree)
        split, max_tokens, valid = max(split, run_split), max(max_tokens, run_max), valid and run_ok
    assert packs is not None
    median_s = float(np.median(times))

    pack_tokens = packs.tokens(total)
    pack_images = packs.tokens(image).astype(np.float64)
    tokens_sum = int(total.sum())
    efficiency = packing_efficiency(pack_tokens, args.seq_len)
    limit = tokens_sum / (math.ceil(tokens_sum / args.seq_len) * args.seq_len)
    budget_limit = None
    if args.packer in ("budget", "greedy_cap"):
        # with a vision-token budget no plan has fewer packs than the image tokens need
        packs_needed = max(
            math.ceil(tokens_sum / args.seq_len), math.ceil(float(image.sum()) / args.image_budget)
        )
        budget_limit = round(tokens_sum / (packs_needed * args.seq_len), 6)
    mean_img = float(pack_images.mean())
    return {
        "packer": args.packer,
        "seq_len": args.seq_len,
        "text_share": args.text_share,
        "text_share_actual": round(float(np.mean(image == 0)), 6),
        "samples": n,
        "samples_before_filter": len(total_all),
        "text_samples_before_filter": n_text_all,
        "packs": len(packs),
        "efficiency": round(efficiency, 6),
        "limit": round(limit, 6),
        "gap_to_limit": round(limit - efficiency, 6),
        "budget_limit": budget_limit,
        "samples_per_s": round(n / median_s, 1) if median_s > 0 else float("inf"),
        "median_s": round(median_s, 6),
        "times_s": [round(t, 6) for t in times],
        "repeat": args.repeat,
        "max_pack_tokens": max_tokens,
        "split_samples": split,
        "valid": valid,
        "overlong": int(overlong_mask.sum()),
        "empty": int(empty_mask.sum()),
        "over_image_budget": int(over_budget_mask.sum()),
        "image_budget": args.image_budget if args.packer in ("budget", "greedy_cap") else None,
        "image_token_share": round(float(image.sum()) / tokens_sum, 6),
        "mean_image_tokens_per_pack": round(mean_img, 3),
        "max_image_tokens_per_pack": int(pack_images.max()),
        "cv_image_tokens_per_pack": round(float(pack_images.std()) / mean_img, 6)
        if mean_img > 0
        else 0.0,
        "window": args.window,
        "seed": args.seed,
        "threads": 1,
        "source": source,
        **stamp("numpy"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchmarkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    src = result["source"]
    src_text = "synthetic (shared data not found)" if src == "synthetic" else ", ".join(src)
    print(f"source: {src_text}")
    left_out = f"overlong (> seq_len={result['seq_len']}, left out): {result['overlong']}"
    if result["packer"] == "budget":
        left_out += f"; over image budget (left out): {result['over_image_budget']}"
    print(left_out)
    print(
        f"{result['packer']}: seq_len={result['seq_len']} text_share={result['text_share']}"
        f" samples={result['samples']} packs={result['packs']}"
        f" efficiency={result['efficiency']:.4%} limit={result['limit']:.4%}"
        f" gap={result['gap_to_limit']:.4%} {result['samples_per_s']:,.0f} samples/s"
        f" (median of {result['repeat']}) max_pack={result['max_pack_tokens']}"
        f" split={result['split_samples']} image_share={result['image_token_share']:.3f}"
        f" image_tokens/pack mean={result['mean_image_tokens_per_pack']:.0f}"
        f" max={result['max_image_tokens_per_pack']} cv={result['cv_image_tokens_per_pack']:.3f}"
    )
    if not result["valid"]:
        print(
            f"error: invalid packing (split_samples={result['split_samples']},"
            f" max_pack_tokens={result['max_pack_tokens']}, seq_len={result['seq_len']})",
            file=sys.stderr,
        )
    if args.json:
        print_json(result)
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
