"""Old homes of moved names: a module ``__getattr__`` that finds a name where it lives now, on
first use, with a ``DeprecationWarning`` (so importing the old home imports nothing above it,
and objects pickled under the old module path still load)."""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved(
    old: str, names: Mapping[str, str] | str, namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``old`` (``namespace``: its ``globals()``): ``names`` maps
    each moved name to its new module, or is one module every unknown name moved to. A name
    found is kept in ``namespace``: it warns once, however often it is read."""

    def __getattr__(name: str) -> Any:  # noqa: N807 (a module's __getattr__)
        new = names if isinstance(names, str) else names.get(name)
        if new is None or name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)
        warnings.warn(
            f"`{old}.{name}` moved to `{new}` (import public names from `lightning_vlmbalance`)",
            DeprecationWarning,
            stacklevel=2,
        )
        namespace[name] = value
        return value

    return __getattr__


def renamed_keyword(old: str, new: str, why: str = "") -> Callable[[Any], Any]:
    """A function's keyword argument ``old`` renamed ``new`` (one word per concept,
    ``docs/glossary.md``): ``old=`` still works, with a ``FutureWarning`` that says ``why``;
    both given is a ``TypeError`` naming both."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                name = fn.__qualname__.removesuffix(".__init__")
                if kwargs.get(new) is not None:  # (``new=None``, a default, is not given)
                    raise TypeError(f"`{name}({old}=..., {new}=...)`: give `{new}` only")
                warnings.warn(
                    f"`{name}({old}=...)` is now `{new}=...`{why}",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap


# ``world_size`` where it meant the data-parallel ranks
DP_RANKS = (
    "world_size",
    "num_replicas",
    " (the data-parallel ranks; `world_size` is every process of the job, tensor-parallel"
    " peers included: docs/glossary.md)",
)
