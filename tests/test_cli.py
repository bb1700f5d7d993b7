"""LightningCLI: ``VLMBalanceStrategy`` from a YAML config, by registered name and by class path.

jsonargparse resolves ``trainer.strategy`` either as a plain string (Lightning's registry name)
or as ``{class_path, init_args}``, where ``class_path`` is a dotted import path or the name of an
imported ``Strategy`` subclass; a registry name is neither, so it takes no ``init_args``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from tests.cpu_fit import packed_loader

pytestmark = pytest.mark.usefixtures("one_thread", "restore_process_state", "cli_argv")

TRAINER = """\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""


class TinyVLM(ToyVLM):
    """The example VLM, small; ``dim`` is what the CLI configures."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(vocab_size=64, patch_dim=8, dim=dim, heads=2)


class PackedData(L.LightningDataModule):
    def train_dataloader(self) -> vb.PackedDataLoader:
        return packed_loader()


@pytest.fixture
def cli_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads `args`, not pytest's argv


def _fit(tmp_path: Path, strategy_yaml: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(TRAINER + strategy_yaml + "model:\n  dim: 32\n")
    args = ["fit", "--config", str(config), "--trainer.max_steps", "2"]
    return LightningCLI(TinyVLM, PackedData, args=args, save_config_callback=None)


@pytest.mark.parametrize(
    "class_path", ["lightning_vlmbalance.VLMBalanceStrategy", "VLMBalanceStrategy"]
)
def test_strategy_by_class_path_with_init_args(tmp_path, class_path) -> None:
    """``class_path`` + ``init_args`` must build the strategy with those arguments and fit."""
    strategy = f"  strategy:\n    class_path: {class_path}\n    init_args:\n      mode: sync\n"
    cli = _fit(tmp_path, strategy)
    assert isinstance(cli.trainer.strategy, vb.VLMBalanceStrategy)
    assert cli.trainer.strategy.mode == "sync"
    assert cli.trainer.global_step == 2


def test_strategy_by_registered_name(tmp_path) -> None:
    """The plain string is Lightning's registry name: the strategy with its defaults."""
    cli = _fit(tmp_path, "  strategy: vlmbalance\n")
    assert isinstance(cli.trainer.strategy, vb.VLMBalanceStrategy)
    assert cli.trainer.strategy.mode == "auto"
    assert cli.trainer.global_step == 2


def test_registered_name_takes_no_init_args(tmp_path, capsys) -> None:
    """``class_path: vlmbalance`` is not a class path (what the docs tell users not to write);
    if jsonargparse ever accepts it, this fails and the docs can offer the short form."""
    strategy = "  strategy:\n    class_path: vlmbalance\n    init_args:\n      mode: sync\n"
    with pytest.raises(SystemExit):
        _fit(tmp_path, strategy)
    assert "Expected a dot import path string: vlmbalance" in capsys.readouterr().err
