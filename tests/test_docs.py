"""The python code blocks of every method card run: they are part of what the docs promise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("card", DOCS, ids=[p.name for p in DOCS])
def test_code_blocks_run(card: Path) -> None:
    blocks = BLOCK.findall(card.read_text())
    assert blocks, f"{card.name} has no python example"
    for code in blocks:
        exec(compile(code, str(card), "exec"), {"__name__": "__doc_example__"})
