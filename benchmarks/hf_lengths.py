"""Benchmark of ``header_lengths`` (lengths from image headers) against ``item_lengths`` over
``ChatRecords`` (the processor on every record), with the equality check.

What it measures, per family, on the same generated records (PNG files on disk, ``--records``
records of 1-2 images, sides drawn uniformly from ``--min-side`` to ``--max-side`` pixels, a
single- or multi-turn conversation each):

* ``item_lengths_s``: ``item_lengths(ChatRecords(records, processor), config)``, once (the
  reference: every image decoded and processed);
* ``header_lengths_s``: ``header_lengths(ChatRecords(...), config=config)``, the median of
  ``--repeat`` calls (``header_cold_s``: the first call, which also builds the per-processor
  plan);
* ``load_table_s``: ``load_length_table`` of a table saved by ``header_lengths(table=...)``
  (fingerprint and per-record hashes checked; median of ``--repeat``);
* each as seconds per 1,000 records (``*_per_1000``), ``speedup`` = item / header and
  ``speedup_load`` = item / load, and ``equal``: the three ``ItemLengths`` are identical (the
  script exits with status 1 if not).

Processors: each family's real processor class built offline (``tiny_processor`` with the tiny
tokenizer and chat template), with the image settings of the released models (``--settings
real``, the default; listed per family in ``REAL`` below and in the JSON) or the tiny test
settings (``--settings tiny``). The model config is ``tiny_config(family)``, with Mistral 3's
vision patch size set to the processor's (14) so that ``item_lengths`` counts the same cells.
Single-threaded torch (``torch.set_num_threads(1)``); the tokenizer's batch call uses its own
(Rust) threads.

Commands (from the repository root, virtualenv active)::

    python benchmarks/hf_lengths.py --json
    python benchmarks/hf_lengths.py --families qwen2_5_vl gemma3 --records 200 --json
    python benchmarks/hf_lengths.py --settings tiny --families all --records 300

With ``--json`` the last line of stdout is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from common import add_json_flag, print_json, stamp, timed

DEFAULT_FAMILIES = ("qwen2_5_vl", "gemma3", "internvl", "mistral3", "idefics3")

# the image settings of released checkpoints (preprocessor_config.json / processor_config.json)
REAL: dict[str, dict[str, Any]] = {
    "qwen2_vl": {  # Qwen/Qwen2-VL-7B-Instruct
        "image_processor": ("Qwen2VLImageProcessorPil", {"patch_size": 14, "merge_size": 2}),
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    },
    "qwen2_5_vl": {  # Qwen/Qwen2.5-VL-7B-Instruct: min_pixels 3136, max_pixels 12845056
        "image_processor": ("Qwen2VLImageProcessorPil", {"patch_size": 14, "merge_size": 2}),
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    },
    "qwen3_vl": {  # Qwen/Qwen3-VL-8B-Instruct
        "image_processor": ("Qwen2VLImageProcessorPil", {"patch_size": 16, "merge_size": 2}),
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    },
    "glm4v": {  # zai-org/GLM-4.1V-9B-Thinking
        "image_processor": ("Glm4vImageProcessorPil", {"patch_size": 14, "merge_size": 2}),
        "size": {"shortest_edge": 12544, "longest_edge": 9633792},
    },
    "gemma3": {  # google/gemma-3-4b-it: 896 x 896, 256 tokens per image, no pan-and-scan
        "image_processor": ("Gemma3ImageProcessorPil", {"size": {"height": 896, "width": 896}}),
        "processor": {"image_seq_length": 256},
    },
    "internvl": {  # OpenGVLab/InternVL3-8B-hf: 448 tiles, up to 12 + thumbnail, 256 per tile
        "image_processor": (
            "GotOcr2ImageProcessorPil",
            {
                "size": {"height": 448, "width": 448},
                "crop_to_patches": True,
                "min_patches": 1,
                "max_patches": 12,
            },
        ),
        "processor": {"image_seq_length": 256},
    },
    "mistral3": {  # mistralai/Mistral-Small-3.1-24B: longest edge 1540, patch 14, merge 2
        "image_processor": (
            "PixtralImageProcessorPil",
            {"size": {"longest_edge": 1540}, "patch_size": {"height": 14, "width": 14}},
        ),
        "processor": {"patch_size": 14, "spatial_merge_size": 2},
    },
    "idefics3": {  # HuggingFaceM4/Idefics3-8B-Llama3: longest 4 x 364, tiles of 364, 169 each
        "image_processor": (
            "Idefics3ImageProcessorPil",
            {"size": {"longest_edge": 1456}, "max_image_size": {"longest_edge": 364}},
        ),
        "processor": {"image_seq_len": 169},
    },
    "smolvlm": {  # HuggingFaceTB/SmolVLM2-2.2B-Instruct: longest 1536, tiles of 384, 81 each
        "image_processor": (
            "SmolVLMImageProcessorPil",
            {"size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}},
        ),
        "processor": {"image_seq_len": 81},
    },
    "llava_onevision": {  # llava-hf/llava-onevision-qwen2-7b-ov-hf: 384, anyres_max_9
        "image_processor": (
            "LlavaOnevisionImageProcessorPil",
            {"size": {"height": 384, "width": 384}, "crop_size": {"height": 384, "width": 384}},
        ),
        "processor": {"num_image_tokens": 729, "vision_aspect_ratio": "anyres_max_9"},
    },
    "gemma4": {  # google/gemma-4: patch 16, pooling 3, 280 soft tokens
        "image_processor": (
            "Gemma4ImageProcessorPil",
            {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 280},
        ),
        "processor": {"image_seq_length": 280},
    },
}
REAL["qwen3_vl_moe"] = REAL["qwen3_5"] = REAL["qwen3_vl"]


def real_processor(family: str, config: Any) -> Any:
    """``tiny_processor(family, config)`` with the released model's image settings."""
    import transformers as tf

    from lightning_vlmbalance.hf.offline import tiny_processor

    spec = REAL[family]
    cls_name, kwargs = spec["image_processor"]
    kwargs = dict(kwargs)
    if "size" in spec:
        kwargs["size"] = spec["size"]
    if cls_name in ("Qwen2VLImageProcessorPil", "Glm4vImageProcessorPil"):
        kwargs["temporal_patch_size"] = 2
    if cls_name == "LlavaOnevisionImageProcessorPil":
        kwargs["image_grid_pinpoints"] = [
            [384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)
        ]
    ip = getattr(tf, cls_name)(**kwargs)
    return tiny_processor(family, config, image_processor=ip, **spec.get("processor", {}))


def model_config(family: str, settings: str) -> Any:
    from lightning_vlmbalance.hf.synthetic import tiny_config

    config = tiny_config(family)
    if family == "mistral3" and settings == "real":
        config.vision_config.patch_size = 14  # item_lengths counts 28 x 28 cells, as the processor
    return config


def make_records(
    root: Path, n: int, *, min_side: int, max_side: int, seed: int
) -> list[dict[str, Any]]:
    """``n`` records of 1-2 PNG images (smooth random content, sides uniform in
    ``[min_side, max_side]``), single- or multi-turn."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        paths = []
        for j in range(int(rng.integers(1, 3))):
            h, w = (int(x) for x in rng.integers(min_side, max_side + 1, 2))
            path = root / f"{i:05d}_{j}.png"
            if not path.exists():
                small = (rng.random((max(h // 32, 1), max(w // 32, 1), 3)) * 255).astype(np.uint8)
                Image.fromarray(small).resize((w, h), Image.BILINEAR).save(path, compress_level=1)
            paths.append(path.name)
        question = " ".join(["describe the picture"] * int(rng.integers(1, 4)))
        content = [{"type": "image"} for _ in paths] + [{"type": "text", "text": question}]
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": "a scene. " * 3}]},
        ]
        if rng.random() < 0.3:
            messages += [
                {"role": "user", "content": "anything else?"},
                {"role": "assistant", "content": "no."},
            ]
        records.append({"images": paths, "messages": messages})
    return records


def run_family(
    family: str, records: list[dict[str, Any]], root: Path, args: argparse.Namespace
) -> dict[str, Any]:
    from lightning_vlmbalance.hf import item_lengths
    from lightning_vlmbalance.hf.lengths import header_lengths, load_length_table
    from lightning_vlmbalance.hf.offline import tiny_processor
    from lightning_vlmbalance.hf.records import ChatRecords

    config = model_config(family, args.settings)
    if args.settings == "real":
        processor = real_processor(family, config)
    else:
        processor = tiny_processor(family, config)
    data = ChatRecords(records, processor, root=root)
    n = len(data)

    cold, cold_s = timed(header_lengths, data, config=config)
    warm = []
    for _ in range(args.repeat):
        got, s = timed(header_lengths, data, config=config)
        warm.append(s)
    table = root / f"lengths_{family}_{args.settings}.npz"
    table.unlink(missing_ok=True)
    header_lengths(data, config=config, table=table)  # computes and saves
    loads = []
    for _ in range(args.repeat):
        loaded, s = timed(load_length_table, table, data, config=config)
        loads.append(s)
    ref, item_s = timed(item_lengths, data, config)

    def same(a: Any, b: Any) -> bool:
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    header_s, load_s = statistics.median(warm), statistics.median(loads)
    per = 1000.0 / n
    return {
        "family": family,
        "processor": type(processor).__name__,
        "image_processor": type(processor.image_processor).__name__,
        "image_settings": _settings(processor),
        "records": n,
        "image_units": int(ref.images.sum()),  # images, or tiles where the tile is the unit
        "mean_total_tokens": float(ref.total_tokens.mean()),
        "mean_image_tokens": float(ref.image_tokens.mean()),
        "item_lengths_s": item_s,
        "header_cold_s": cold_s,
        "header_lengths_s": header_s,
        "load_table_s": load_s,
        "item_lengths_per_1000": item_s * per,
        "header_lengths_per_1000": header_s * per,
        "load_table_per_1000": load_s * per,
        "speedup": item_s / header_s,
        "speedup_cold": item_s / cold_s,
        "speedup_load": item_s / load_s,
        "equal": same(ref, got) and same(ref, cold) and same(ref, loaded),
    }


def _settings(processor: Any) -> dict[str, Any]:
    ip = processor.image_processor.to_dict()
    keep = (
        "size",
        "patch_size",
        "merge_size",
        "max_image_size",
        "crop_to_patches",
        "min_patches",
        "max_patches",
        "do_pan_and_scan",
        "pooling_kernel_size",
        "max_soft_tokens",
        "crop_size",
    )
    out = {k: ip[k] for k in keep if k in ip}
    for k in ("image_seq_length", "image_seq_len", "num_image_tokens", "spatial_merge_size"):
        if hasattr(processor, k):
            out[f"processor.{k}"] = getattr(processor, k)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--min-side", type=int, default=300)
    parser.add_argument("--max-side", type=int, default=1500)
    parser.add_argument("--settings", choices=("real", "tiny"), default="real")
    parser.add_argument("--repeat", type=int, default=3, help="timed header / load calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="image folder (default: temp)")
    add_json_flag(parser)
    args = parser.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    from lightning_vlmbalance.hf.synthetic import TINY_FAMILIES

    families = list(TINY_FAMILIES) if args.families == ["all"] else args.families
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        records, make_s = timed(
            make_records,
            root,
            args.records,
            min_side=args.min_side,
            max_side=args.max_side,
            seed=args.seed,
        )
        results = []
        for family in families:
            res = run_family(family, records, root, args)
            results.append(res)
            if not args.json:
                print(
                    f"{family:16s} item {res['item_lengths_per_1000']:7.3f} s/1000  header"
                    f" {res['header_lengths_per_1000']:6.4f} s/1000 (x{res['speedup']:.0f},"
                    f" cold x{res['speedup_cold']:.0f})  load {res['load_table_per_1000']:6.4f}"
                    f" s/1000 (x{res['speedup_load']:.0f})  equal={res['equal']}",
                    flush=True,
                )
    out = {
        **stamp("torch", "transformers", "tokenizers", "PIL", "numpy"),
        "command": " ".join(["python", "benchmarks/hf_lengths.py", *(argv or sys.argv[1:])]),
        "records": args.records,
        "sides": [args.min_side, args.max_side],
        "settings": args.settings,
        "make_records_s": make_s,
        "results": results,
        "all_equal": all(r["equal"] for r in results),
    }
    if args.json:
        print_json(out)
    return 0 if out["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
