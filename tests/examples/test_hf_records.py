"""The records recipe (``examples/hf_records.py``, ``docs/hugging_face.md``): PNG files and
conversations on disk, through the family's real processor and chat template, into a 2-rank
packed fit under "vlmbalance"; every record trained once, labels on the assistant's turns only,
and the TensorBoard logs read back. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import run_module

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_records_on_disk_train_on_two_ranks(tmp_path: Path, family: str) -> None:
    demo = tmp_path / "demo"
    proc = run_module(
        "examples.hf_records",
        *("--demo", str(demo), "--root", str(tmp_path / "runs"), "--family", family),
        *("--num-records", "48"),
        timeout=600,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY_JSON "))
    summary = json.loads(line.removeprefix("SUMMARY_JSON "))
    assert summary["every_record_once"] and summary["records"] == 48
    assert summary["optimizer_steps"] > 0 and summary["final_loss"] == summary["final_loss"]
    images = sorted((demo / "images").glob("*.png"))
    assert images and (demo / "records.jsonl").is_file()
    acc = EventAccumulator(summary["log_dir"])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags
    for rank in (0, 1):
        assert f"straggler/step_ms/rank_{rank}" in tags


def test_labels_train_the_assistant_turns_only(tmp_path: Path) -> None:
    """The dataset the recipe packs: per record, exactly the assistant's answers are labels
    (the template's generation markers; by prefix, the turn's separator too), and a record
    whose image entries do not match its images is named."""
    from examples.hf_records import write_demo_records
    from lightning_vlmbalance.hf.offline import tiny_processor
    from lightning_vlmbalance.hf.records import ChatRecords

    path = write_demo_records(tmp_path, 12, seed=3)
    proc = tiny_processor("qwen2_5_vl")
    marked, prefix = ChatRecords(path, proc), ChatRecords(path, proc, masks="prefix")
    assert marked.masks == "generation"
    for i in range(len(marked)):
        record = json.loads(path.read_text().splitlines()[i])
        answers = [m["content"][0]["text"] for m in record["messages"] if m["role"] == "assistant"]
        a, b = marked[i]["labels"][0], prefix[i]["labels"][0]
        assert proc.tokenizer.decode(a[a != -100].tolist()) == "".join(f"{t}<eos>" for t in answers)
        assert proc.tokenizer.decode(b[b != -100].tolist()) == "".join(
            f"{t}<eos>\n" for t in answers
        )
        assert torch.equal(marked[i]["input_ids"], prefix[i]["input_ids"])
    first = json.loads(path.read_text().splitlines()[0])
    image = next(p for r in map(json.loads, path.read_text().splitlines()) for p in r["images"])
    broken = ChatRecords(
        [{"images": [image], "messages": [{"role": "user", "content": "hi"}]}, first],
        proc,
        root=tmp_path,
    )
    with pytest.raises(ValueError, match="record 0: 0 image entries in its messages, 1 images"):
        broken[0]
    broken.records[1] = {**first, "images": ["missing.png"]}
    broken.records[1]["messages"][0]["content"] = [{"type": "image"}]
    with pytest.raises(ValueError, match=r"record 1: image file .*missing.png does not exist"):
        broken[1]
    (tmp_path / "corrupt.png").write_bytes(b"not a png")
    broken.records[1]["images"] = ["corrupt.png"]
    with pytest.raises(ValueError, match=r"record 1: image file .*corrupt.png cannot be read"):
        broken[1]
