"""What the tests of the benchmark scripts share: loading a script, and a CSV mix to run it on.

A script imports its siblings (``common``, ``packing``, ``moe_routing``) by their bare names:
``python benchmarks/<script>.py`` puts ``benchmarks/`` first on ``sys.path``. :func:`load`
gives the import the same path, and takes it away again afterwards.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from lightning_vlmbalance.synthetic import synthetic_length_table

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported afresh as module ``_benchmark_<name>`` (registered in
    ``sys.modules``, where its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def mix_csv(folder: Path, samples: int) -> Path:
    """A length table of ``samples`` synthetic samples (text share 0.3, seed 0) written as the
    scripts' ``--data`` CSV (``total_tokens,image_tokens,images``) in ``folder``."""
    table = synthetic_length_table(samples, text_share=0.3, seed=0)
    csv = folder / "mix.csv"
    rows = np.stack([table.total_tokens, table.image_tokens, table.images], axis=1)
    header = "total_tokens,image_tokens,images"
    np.savetxt(csv, rows, fmt="%d", delimiter=",", header=header, comments="")
    return csv
