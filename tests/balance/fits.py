"""Helpers shared by the test modules that run ``tests.balance.strategy_job`` fits: build a job,
read its result, compare parameters (a helper module, so no test file imports another)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.launch import run_module


def job(out: Path, *args: str) -> tuple[str, ...]:
    """The ``run_jobs`` / ``run_modules`` entry of a strategy-job fit writing to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return ("tests.balance.strategy_job", "--out", str(out), *args)


def fit_result(out: Path) -> dict:
    """``{"params": final parameters, r: rank r's records and stats}`` of a finished fit."""
    result = {"params": torch.load(out / "params.pt")}
    for r in (0, 1):
        if (out / f"rank{r}.json").exists():
            result[r] = {
                **json.loads((out / f"rank{r}.json").read_text()),
                **json.loads((out / f"stats{r}.json").read_text()),
            }
    return result


def fit(out: Path, *args: str) -> dict:
    """Runs one strategy-job fit now (a non-zero exit fails the test) and reads its result."""
    run_module(*job(out, *args), timeout=600)
    return fit_result(out)


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest relative difference between two parameter dicts, tensor by tensor."""
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-300)) for k in a)


def packs(res: dict) -> list[int]:
    """Every pack id trained by ranks 0 and 1, sorted."""
    return sorted(p for r in (0, 1) for _, p, _ in res[r]["seen"])
