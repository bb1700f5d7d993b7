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


# the layers, lowest first: a module imports only from its own layer or lower ones (the base
# modules from nothing above them), so that the package reads bottom-up and has no cycles
_LAYERS = (
    ("parallel", "loss", "_lightning", "_moved", "attention", "synthetic"),
    ("packing", "timing", "offload", "moe"),
    ("balance",),
    ("loaders", "callbacks"),
    ("preemption", "strategy", "hf", "sim", "streams", "fabric"),
)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for level, names in enumerate(_LAYERS):
        if top in names:
            return level
    raise AssertionError(f"{module}: not in any layer of the test (add it)")


def _imports() -> dict[str, set[str]]:
    """Every module's imports of the package's own modules, read from the source (imports
    inside functions count: they run too), less those under ``if TYPE_CHECKING``."""
    import ast
    from pathlib import Path

    root = Path(vb.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "lightning_vlmbalance":  # `from lightning_vlmbalance import x`
                    found |= {f"lightning_vlmbalance.{a.name}" for a in node.names}
                elif node.module.startswith("lightning_vlmbalance."):
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("lightning_vlmbalance.")}
        graph[name] = found
    return graph


def test_imports_run_down_the_layers_only() -> None:
    """packing/ (pure packing) <- balance/ (cost, planners, the former) <- loaders/ <- the
    strategy: no module imports from a layer above its own. The deprecated names a package
    re-exports from above (``packing.PackingSampler``, ``balance.RebalancingLoader``) are
    found on first use, in its ``__getattr__``, and are the only exception."""
    upward = []
    for module, imported in _imports().items():
        if module == "lightning_vlmbalance":
            continue  # the namespace re-exports everything
        for target in imported:
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    allowed = {
        "lightning_vlmbalance.packing -> lightning_vlmbalance.loaders.map_style",
        "lightning_vlmbalance.balance -> lightning_vlmbalance.loaders.rebalancing",
    }
    assert sorted(set(upward) - allowed) == []


def test_the_moved_names_still_work_with_a_deprecation() -> None:
    import pytest

    import lightning_vlmbalance.balance as balance
    import lightning_vlmbalance.packing as packing

    for owner, name in (
        (packing, "PackingSampler"),
        (packing, "PackedDataLoader"),
        (packing, "PackedStreamLoader"),
        (packing, "SourceBalance"),
        (balance, "RebalancingLoader"),
    ):
        with pytest.deprecated_call(match=name):
            assert getattr(owner, name) is getattr(vb, name)
    # `from package import name` reads the name twice: it warns once
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lightning_vlmbalance.packing import PackedStreamLoader  # noqa: F401
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) <= 1


def test_objects_pickled_under_the_old_module_paths_still_load() -> None:
    """A pickle names its class by module path (a sampler kept by ``save_hyperparameters``,
    say): the old paths find the moved classes."""
    import pickle

    import pytest

    for module, name in (
        ("lightning_vlmbalance.packing.sampler", "PackingSampler"),
        ("lightning_vlmbalance.packing.streaming", "PackedStreamLoader"),
        ("lightning_vlmbalance.packing.source", "SourceBalance"),
        ("lightning_vlmbalance.balance.loader", "RebalancingLoader"),
    ):
        with pytest.deprecated_call(match=name):
            found = pickle.loads(f"c{module}\n{name}\n.".encode())  # the GLOBAL opcode
        assert found is getattr(vb, name)
    balance = vb.SourceBalance(micro_steps=2)
    old = pickle.dumps(balance).replace(
        b"lightning_vlmbalance.balance.source", b"lightning_vlmbalance.packing.source"
    )
    assert pickle.loads(old) == balance  # (warned once above, for this module's name)
