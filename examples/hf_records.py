"""The recipe of ``docs/hugging_face.md``: records on disk -> the model's processor -> packs -> a
2-rank fit with the package's strategy.

    python -m examples.hf_records --demo runs/records_demo          # writes PNG records, trains
    python -m examples.hf_records --records data.jsonl --family gemma3

A record (JSON lines) is a conversation and the image files it shows (see
``lightning_vlmbalance.hf.records``). The processor here is the family's real processor class
built offline for the tiny random-init model (``lightning_vlmbalance.hf.offline``); with a real
checkpoint it is ``AutoProcessor.from_pretrained(path)``. Labels train the assistant's turns
only. Lightning's DDP launcher re-runs this module for the other rank.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image

import lightning_vlmbalance as vb
from examples.hf_vlm import HFVLM, PackedHFData
from examples.train import RunSummary, print_run
from lightning_vlmbalance.hf.lengths import header_lengths
from lightning_vlmbalance.hf.offline import tiny_processor
from lightning_vlmbalance.hf.records import ChatRecords
from lightning_vlmbalance.hf.synthetic import TINY_FAMILIES, tiny_config


def write_demo_records(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` records under ``root``: PNG files of random sizes (0-2 per record, some text-only),
    one or two question-answer turns each; returns the JSON-lines file."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        paths = []
        for j in range(int(rng.choice([0, 1, 1, 2]))):
            h, w = (int(x) for x in rng.integers(12, 64, size=2))
            path = root / "images" / f"{i:05d}_{j}.png"
            Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
            paths.append(str(path.relative_to(root)))
        user = [{"type": "image"} for _ in paths] + [{"type": "text", "text": f"what is {i}?"}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": f"it is {i}."}]},
        ]
        if rng.random() < 0.3:  # a second turn
            messages += [
                {"role": "user", "content": [{"type": "text", "text": "and then?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "then more."}]},
            ]
        lines.append(json.dumps({"images": paths, "messages": messages}))
    path = root / "records.jsonl"
    for stale in root.glob("records.*.lengths.npz"):  # made for the images written before
        stale.unlink()
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)  # the file appears whole
    return path


class RecordsData(PackedHFData):
    """``ChatRecords`` through the family's processor, packed by ``PackingSampler``."""

    def __init__(self, records: Path, family: str, seq_len: int, seed: int) -> None:
        config = tiny_config(family)
        dataset = ChatRecords(records, tiny_processor(family, config))
        # from the image headers and the tokenizer (no image decoded), saved beside the records
        # with a fingerprint of the processor's settings; equal to item_lengths(dataset, config)
        table = Path(records).with_suffix(f".{family}.lengths.npz")
        lengths = header_lengths(dataset, table=table, config=config)
        super().__init__(config, dataset, seq_len=seq_len, seed=seed, lengths=lengths)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", type=Path, help="a JSON-lines file of records")
    p.add_argument("--demo", type=Path, help="write demo PNG records into this folder first")
    p.add_argument("--num-records", type=int, default=96)
    p.add_argument("--family", default="qwen2_5_vl", choices=TINY_FAMILIES)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs")
    args = p.parse_args(argv)
    if (args.records is None) == (args.demo is None):
        p.error("give --records FILE or --demo DIR")

    torch.set_num_threads(1)  # one core per rank
    L.seed_everything(args.seed, verbose=False)
    records = args.records
    if args.demo is not None:
        records = args.demo / "records.jsonl"
        if "LOCAL_RANK" not in os.environ:  # the launched rank reads what rank 0 wrote
            write_demo_records(args.demo, args.num_records, args.seed)
    data = RecordsData(records, args.family, args.seq_len, args.seed)
    monitor = vb.StragglerMonitor(log_every_n_steps=5)
    summary = RunSummary(monitor)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="vlmbalance",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=TensorBoardLogger(Path(args.root), name=f"records_{args.family}"),
        log_every_n_steps=2,
        callbacks=[monitor, summary],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(HFVLM(data.config), datamodule=data)
    plan = data.loader.sampler.plan()
    trained = sorted(int(i) for packs in plan.rank_packs for ids in packs for i in ids)
    summary.summary["records"] = len(data.dataset)
    summary.summary["records_trained"] = len(trained)
    summary.summary["every_record_once"] = trained == list(range(len(data.dataset)))
    if trainer.is_global_zero:
        print_run(summary.summary)
        print(
            f"Records trained this epoch: {len(trained)} of {len(data.dataset)}"
            f" (every record once: {summary.summary['every_record_once']})"
        )
    return summary.summary


if __name__ == "__main__":
    main()
