"""The python code blocks of every method card run, and check what the card claims: they are part
of what the docs promise (composer's method cards are tested the same way)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _asserts(tree: ast.AST) -> int:
    """``assert`` statements and ``torch.testing.assert_close`` calls in a block."""
    return sum(
        isinstance(node, ast.Assert)
        or (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "assert_close")
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("card", DOCS, ids=[p.name for p in DOCS])
def test_code_blocks_run_and_check_their_claims(card: Path, tmp_path, monkeypatch) -> None:
    blocks = BLOCK.findall(card.read_text())
    assert blocks, f"{card.name} has no python example"
    monkeypatch.chdir(tmp_path)  # a block may write files (logs, checkpoints): not in the repo
    for i, code in enumerate(blocks):
        tree = compile(code, str(card), "exec", ast.PyCF_ONLY_AST)
        # a block that checks nothing passes whatever the code does
        assert _asserts(tree), f"{card.name}, python block {i + 1}: no assert checks its claim"
        exec(compile(tree, str(card), "exec"), {"__name__": "__doc_example__"})


def test_a_failing_claim_fails_the_test() -> None:
    """The harness runs the blocks' asserts for real (a card's check cannot pass vacuously)."""
    tree = compile("x = 1\nassert x == 2, 'claim'", "card.md", "exec", ast.PyCF_ONLY_AST)
    assert _asserts(tree) == 1
    with pytest.raises(AssertionError, match="claim"):
        exec(compile(tree, "card.md", "exec"), {"__name__": "__doc_example__"})
