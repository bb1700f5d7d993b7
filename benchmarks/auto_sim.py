"""``mode="auto"`` against every fixed mode in the simulator, on the shared mixes.

For each mix (the four OmniBal CSVs each with the chat text, and all five), text share, data-
parallel size, micro-steps and strategy (``vlmbalance``: the ranks meet once per optimizer step;
``fsdp_vlmbalance``: at every micro-step), it simulates the fixed modes ``off``, ``overlap``,
``source``, ``encoder``, ``encoder_overlap`` and ``encoder_source`` and ``auto`` (each global
batch priced by ``balance/choice.py`` and the cheapest option taken; the epoch formed at the
source when the simulator predicts that faster), every mode on the same samples, and reports
``auto``'s tokens/s over the best fixed mode's. ``budget`` is left out: it trains other samples.

At one micro-batch per step it also reports a lower bound of the step for the plain packs
(whatever is moved): per global batch the smaller of the packs as placed (no meeting) and the
largest language model plus the image planner's bound on the encoder
(the larger of :func:`~lightning_vlmbalance.balance.images.image_bound` and the linear
relaxation of ``benchmarks/image_lp.py``: the returns make both meetings), and
``auto``'s waste against it.

    python benchmarks/auto_sim.py --json
    python benchmarks/auto_sim.py --mixes all5 --text-shares 0.333 --dp 1024 --ga 1 --json
    python benchmarks/auto_sim.py --mixes all5 --text-shares 0.3 --dp 512,1024 --ga 1,8 \
        --time-planning --json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import common
import numpy as np
from image_lp import lp_bound

from lightning_vlmbalance.balance.choice import choose_step, price_placed
from lightning_vlmbalance.balance.cost import CostModel
from lightning_vlmbalance.balance.image_routing import route_images
from lightning_vlmbalance.balance.images import image_bound
from lightning_vlmbalance.sim import simulate
from lightning_vlmbalance.sim.simulate import ExchangeModel, _draws, _inputs, _PoolCache
from lightning_vlmbalance.synthetic import read_length_csv, resample_text_share

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXT = DATA / "multipack" / "openchat_text.csv"
IMAGES = {
    "ai2d": DATA / "omnibal" / "ai2d_train_12k.csv",
    "chartqa": DATA / "omnibal" / "chartqa_train_18k.csv",
    "docvqa": DATA / "omnibal" / "docvqa_train_10k.csv",
    "synthdog": DATA / "omnibal" / "synthdog_en.csv",
}
FIXED = ("off", "overlap", "source", "encoder", "encoder_overlap", "encoder_source")
SYNC = {"vlmbalance": "step", "fsdp_vlmbalance": "microstep"}


def mix_files(name: str) -> list[Path]:
    return [*IMAGES.values(), TEXT] if name == "all5" else [IMAGES[name], TEXT]


def plain_bound(table: Any, R: int, batches: int, seed: int) -> float:
    """The mean over the drawn global batches (one pack per rank, the packs of ``off``) of the
    lower bound of the step described in the module docstring."""
    pools = _PoolCache(table, 8192, CostModel(), ExchangeModel(), seed, False, None, None)
    greedy = pools.get("greedy", R)
    bounds = []
    for draw in _draws(greedy, R, 1, batches, seed, False, 0):
        inputs = _inputs(greedy, draw, R)
        present = np.arange(inputs.image_ms.shape[1])[None, :] < inputs.counts[:, None]
        costs = inputs.image_ms[present]
        cheap = image_bound(np.full(R, inputs.per_call_ms), costs)
        plan = route_images(
            inputs.llm_ms,
            inputs.image_ms,
            inputs.image_tokens,
            inputs.counts,
            inputs.per_call_ms,
            R,
            reorder=False,
        )
        encoder = lp_bound(
            inputs.per_call_ms, costs, R, upper=float(plan.load_ms.max()), lower=cheap
        )
        routed = float(inputs.llm_ms.max()) + encoder
        bounds.append(min(price_placed(inputs, meets_every_micro_batch=True), routed))
    return float(np.mean(bounds))


def planning_ms(table: Any, R: int, G: int, sync: str, seed: int, batches: int = 4) -> float:
    """The median wall time of one ``choose_step`` (every option priced and planned) over
    ``batches`` drawn global batches of ``R`` ranks x ``G`` micro-steps."""
    pools = _PoolCache(table, 8192, CostModel(), ExchangeModel(), seed, False, None, None)
    greedy = pools.get("greedy", R)
    transfer = ExchangeModel().transfer
    times = []
    for draw in _draws(greedy, R, G, batches, seed, False, 0):
        inputs = _inputs(greedy, draw, R)
        start = time.perf_counter()
        choose_step(
            inputs,
            objective="step" if sync == "step" else "microstep",
            meets_every_micro_batch=sync == "microstep",
            threaded=True,
            transfer=transfer,
        )
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows, summary = [], []
    for mix in args.mixes:
        base = read_length_csv(*mix_files(mix))
        for share in args.text_shares:
            table = resample_text_share(base, share, args.seed)
            for strategy in args.strategies:
                start = time.perf_counter()
                got = simulate(
                    table,
                    seq_len=8192,
                    dp=args.dp,
                    ga=args.ga,
                    modes=[*FIXED, "auto"],
                    batches=args.batches,
                    seed=args.seed,
                    sync_every=SYNC[strategy],
                )
                seconds = time.perf_counter() - start
                for r in got:
                    r.update(mix=mix, text_share=share, strategy=strategy)
                rows += got
                for R in args.dp:
                    for G in args.ga:
                        by = {r["mode"]: r for r in got if r["dp"] == R and r["ga"] == G}
                        auto = by.pop("auto")
                        best = max(by, key=lambda m: by[m]["tokens_per_s_per_rank"])
                        line = {
                            "mix": mix,
                            "text_share": share,
                            "strategy": strategy,
                            "dp": R,
                            "ga": G,
                            "best_fixed": best,
                            "best_fixed_tokens_per_s": round(by[best]["tokens_per_s_per_rank"], 1),
                            "auto_tokens_per_s": round(auto["tokens_per_s_per_rank"], 1),
                            "auto_vs_best": round(
                                auto["tokens_per_s_per_rank"] / by[best]["tokens_per_s_per_rank"],
                                4,
                            ),
                            "auto_waste": round(auto["waste_frac"], 4),
                            "auto_packing": round(auto["packing_efficiency"], 4),
                            "auto_at_source": auto["formed_at_source"],
                            "auto_choices": auto["choices"],
                            "seconds": round(seconds, 1),
                        }
                        if args.time_planning:
                            line["choice_ms"] = round(
                                planning_ms(table, R, G, SYNC[strategy], args.seed), 2
                            )
                        if G == 1 and not auto["formed_at_source"]:
                            bound = plain_bound(table, R, args.batches, args.seed)
                            line["bound_step_ms"] = round(bound, 2)
                            line["auto_waste_vs_bound"] = round(1 - bound / auto["step_ms"], 4)
                        summary.append(line)
                        print(line, file=sys.stderr, flush=True)
    worst = min(summary, key=lambda s: s["auto_vs_best"])
    return {
        **common.stamp(),
        "command": "python benchmarks/auto_sim.py " + " ".join(sys.argv[1:]),
        "rows": len(summary),
        "auto_vs_best_min": worst["auto_vs_best"],
        "worst": worst,
        "summary": summary,
        "simulated": rows if args.full_rows else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", type=lambda s: s.split(","), default=[*IMAGES, "all5"])
    p.add_argument(
        "--text-shares", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 0.5]
    )
    p.add_argument(
        "--dp", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 512, 1024]
    )
    p.add_argument("--ga", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument(
        "--strategies", type=lambda s: s.split(","), default=["vlmbalance", "fsdp_vlmbalance"]
    )
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full-rows", action="store_true", help="every simulated row in the JSON")
    p.add_argument(
        "--time-planning",
        action="store_true",
        help="the median wall time of one choose_step per configuration (choice_ms)",
    )
    common.add_json_flag(p)
    args = p.parse_args()
    result = run(args)
    if args.json:
        common.print_json(result)
    else:
        print(f"{result['rows']} rows; auto / best fixed at least {result['auto_vs_best_min']}")


if __name__ == "__main__":
    main()
