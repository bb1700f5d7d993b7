"""The top-level namespace: its ``__all__`` and its docstring name the same public API, and
internal pieces stay in their submodules."""

from __future__ import annotations

import re

import lightning_vlmbalance as vb


def test_all_and_the_docstring_agree() -> None:
    doc = vb.__doc__ or ""
    documented = set(re.findall(r":(?:class|func):`(\w+)`", doc))
    assert documented <= set(vb.__all__), sorted(documented - set(vb.__all__))
    assert [n for n in vb.__all__ if n not in doc] == []
    assert all(hasattr(vb, name) for name in vb.__all__)


def test_internal_pieces_live_in_their_submodules() -> None:
    for name in ("Rebalancer", "pack_best_fit_decreasing"):
        assert name not in vb.__all__ and not hasattr(vb, name), name
    from lightning_vlmbalance.packing import pack_best_fit_decreasing  # noqa: F401
    from lightning_vlmbalance.strategy import Rebalancer  # noqa: F401
