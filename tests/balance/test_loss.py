"""The loss contract in real fits: every optimizer step's gradient is that of the token-mean loss
over the whole global batch, as one process computing it alone would get (float64).

Each fit records, on rank 0, the parameters before every optimizer step and the gradients before
and after Lightning's clipping, and on every rank which samples it trained in which step. The
reference rebuilds every pack of the step from the dataset, computes ``sum(token losses) / N`` in
one process at the recorded parameters, and differentiates it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.packing.collate import PackItem
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table
from tests.launch import run_modules
from tests.packing.lightning_job import SMALL_VLM

SEQ_LEN, SAMPLES, CLIP = 128, 160, 0.5
# 2 epochs of 7 micro-batches per rank with accumulation 3: steps of 3, 3 and 1 micro-batches
RUN = ("--samples", str(SAMPLES), "--accumulate", "3", "--limit-train-batches", "7")
RUN += ("--epochs", "2", "--max-steps", "-1", "--record-grads")


def _job(out: Path, *args: str) -> tuple[str, ...]:
    out.mkdir(parents=True, exist_ok=True)
    return ("tests.balance.strategy_job", "--out", str(out), *RUN, *args)


def _result(out: Path) -> dict:
    ranks = sorted(int(p.stem[len("stats") :]) for p in out.glob("stats*.json"))
    return {
        "grads": torch.load(out / "grads.pt"),
        "weights": {r: json.loads((out / f"stats{r}.json").read_text())["weights"] for r in ranks},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("loss")
    jobs = {
        "overlap": ("--strategy", "vlmbalance", "--clip", str(CLIP)),
        "off": ("--strategy", "vlmbalance", "--mode", "off"),
        "ddp": ("--strategy", "ddp", "--clip", str(CLIP)),
        "one_rank": ("--strategy", "vlmbalance", "--devices", "1"),
    }
    run_modules([_job(root / name, *args) for name, args in jobs.items()])
    return {name: _result(root / name) for name in jobs}


def _dataset() -> SyntheticVLMDataset:
    table = synthetic_length_table(
        SAMPLES, text_share=0.2, tile_tokens=8, max_text_tokens=64, seed=1
    )
    return SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)


def _reference_grads(params: dict, packs: list[list[int]], ds) -> tuple[dict, int]:
    """One process, the whole global batch: grad of sum(token losses) / N at ``params``."""
    model = ToyVLM(**SMALL_VLM, max_positions=SEQ_LEN).double()
    model.load_state_dict(params, strict=False)
    collate = vb.PackCollator(SEQ_LEN, image_feature_shape=(8,))
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for sample_ids in packs:
        batch = collate([ds[i] for i in sample_ids])
        batch["pixel_values"] = batch["pixel_values"].double()
        out = vb.packed_cross_entropy(model(batch), batch)
        total, tokens = total + out.loss_sum, tokens + out.loss_tokens
    (total / tokens).backward()
    return {k: p.grad for k, p in model.named_parameters()}, tokens


def _rel(a: dict, b: dict) -> float:
    num = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in b))
    return float(num / torch.sqrt(sum((b[k] ** 2).sum() for k in b)))


def _global_norm(g: dict) -> float:
    return float(torch.sqrt(sum((v**2).sum() for v in g.values())))


@pytest.mark.parametrize("name", ["overlap", "off", "ddp", "one_rank"])
def test_gradient_is_that_of_the_global_token_mean(runs, name) -> None:
    """Float64, accumulation 3, steps cut short by limit_train_batches: before the optimizer step
    the gradient equals (relative 1e-10) that of one process on the same global batch."""
    run, ds = runs[name], _dataset()
    steps = run["grads"]
    assert len(steps) == 6  # 2 epochs x (3 + 3 + 1 micro-batches)
    for record in steps:
        mine = [w for ws in run["weights"].values() for w in ws if w[0] == record["step"]]
        packs = [w[1] for w in mine]
        ref, tokens = _reference_grads(record["params"], packs, ds)
        # the partial step counts only its own tokens, on every micro-batch of every rank
        assert {w[3] for w in mine} == {tokens}, (record["step"], mine)
        assert _rel(record["grads_pre"], ref) < 1e-10, record["step"]
    partial = [s for s in steps if len([w for w in run["weights"][0] if w[0] == s["step"]]) == 1]
    assert len(partial) == 2  # the last step of each epoch has 1 micro-batch per rank


@pytest.mark.parametrize("name", ["overlap", "ddp"])
def test_clipping_clips_exactly_when_one_process_would(runs, name) -> None:
    """The gradient the optimizer applies is the single process's, clipped at the same norm."""
    run, ds = runs[name], _dataset()
    clipped = 0
    for record in run["grads"]:
        mine = [w for ws in run["weights"].values() for w in ws if w[0] == record["step"]]
        ref, _ = _reference_grads(record["params"], [w[1] for w in mine], ds)
        norm = _global_norm(ref)
        coef = min(1.0, CLIP / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        clipped += coef < 1.0
        expected = {k: v * coef for k, v in ref.items()}
        assert _rel(record["grads_post"], expected) < 1e-10, (record["step"], norm)
    # the threshold sits inside the range of norms: some steps are clipped, some not
    assert 0 < clipped < len(run["grads"]), clipped


def test_fast_dev_run_counts_only_the_trained_batch(tmp_path) -> None:
    """fast_dev_run with accumulation 2 trains one micro-batch: the step's tokens are its own
    (they used to include the next, untrained batch)."""
    from tests.cpu_fit import cpu_trainer, packed_loader

    seen: list[tuple[int, int, float]] = []

    class Recording(ToyVLM):
        def training_step(self, batch, batch_idx):
            seen.append((batch["loss_tokens"], batch["global_loss_tokens"], batch["loss_weight"]))
            return super().training_step(batch, batch_idx)

    trainer = cpu_trainer([], steps=-1, fast_dev_run=True, accumulate_grad_batches=2)
    trainer.fit(Recording(**SMALL_VLM, max_positions=SEQ_LEN), packed_loader(trainer))
    assert len(seen) == 1
    tokens, global_tokens, weight = seen[0]
    assert global_tokens == tokens and weight == pytest.approx(2 / tokens)


def test_forgotten_trainer_is_named_not_silent(tmp_path) -> None:
    """Accumulation 2 with a loader that does not know the optimizer steps: an error that says
    what to change, not a gradient off by the accumulation factor."""
    from tests.cpu_fit import cpu_trainer, packed_loader

    trainer = cpu_trainer([], steps=2, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"PackedDataLoader\(\.\.\., trainer=self.trainer\)"):
        trainer.fit(ToyVLM(**SMALL_VLM, max_positions=SEQ_LEN), packed_loader())


def test_padding_pack_is_not_logged_as_a_loss() -> None:
    """Under plain DDP rank 0's last logged train/loss was 0.0: a padding pack (no target)."""
    logged: list[float] = []

    class Recording(ToyVLM):
        def log(self, name, value, *args, **kwargs):
            logged.append(float(value))

    model = Recording(**SMALL_VLM, max_positions=SEQ_LEN)
    collate = vb.PackCollator(SEQ_LEN, image_feature_shape=(8,))
    padding = collate([PackItem(-1, -1, None)])
    assert vb.packed_cross_entropy(model(padding), padding).mean is None
    loss = model.training_step(padding, 0)
    assert logged == [] and float(loss) == 0.0
    model.training_step(collate([_dataset()[0]]), 1)
    assert len(logged) == 1 and logged[0] > 0
