"""What every benchmark script repeats: the ``--json`` flag, the machine it ran on, its timers.

The scripts import it as ``common``: Python puts a script's own folder (``benchmarks/``) first on
``sys.path`` when it runs ``python benchmarks/<script>.py``, and the tests that load a script by
its path put that folder there for the import. Standard library only, and nothing imported at
import time beyond it: ``gpu_check.py`` runs it on a GPU machine that has torch and the carried
wheels, and reading a version must neither import torch nor create a CUDA context.

- :func:`add_json_flag` and :func:`print_json`: ``--json`` prints the result as one JSON object,
  the last line of stdout (what the tests and ``results/`` read).
- :func:`environment` and :func:`stamp`: python, platform, CPU count and package versions; the
  stamp adds the date and a one-line machine, for a result's top level.
- :func:`timed`, :func:`wall_ms`, :func:`cuda_ms` and :func:`median_ms`: one timed call, and the
  median of repeated calls after untimed warm-up calls.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the result as one JSON object, the last line of stdout."""
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object, last"
    )


def print_json(result: Mapping[str, Any], *, indent: int | None = None) -> None:
    """Prints ``result`` as JSON and flushes: one line unless ``indent`` is given (a script
    whose whole stdout is the object may indent it)."""
    print(json.dumps(result, indent=indent), flush=True)


def version(package: str) -> str | None:
    """The installed version of ``package`` (an import name), ``None`` if it is not installed.

    An already imported module's ``__version__`` wins (what runs, even from a source tree);
    otherwise the installed distribution's metadata is read without importing the package.
    """
    module = sys.modules.get(package)
    found = getattr(module, "__version__", None)
    if isinstance(found, str):
        return found
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(*packages: str) -> dict[str, Any]:
    """``python``, ``platform``, ``cpus``, and the version of each of ``packages``."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    info.update({name: version(name) for name in packages})
    return info


def stamp(*packages: str) -> dict[str, Any]:
    """A result's metadata: ``date``, ``machine`` (architecture and CPU count in one string)
    and :func:`environment` of ``packages``."""
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        **environment(*packages),
    }


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``(fn(*args, **kwargs), seconds it took)``, on ``time.perf_counter``."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def wall_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds one call of ``fn`` takes on the host clock."""
    return timed(fn)[1] * 1e3


def cuda_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds one call of ``fn`` takes on the current CUDA stream: CUDA events around it,
    recorded once the whole device is idle (no earlier work, on any stream, in the time)."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(
    fn: Callable[[], Any],
    *,
    reps: int,
    warmup: int = 0,
    clock: Callable[[Callable[[], Any]], float] = wall_ms,
) -> float:
    """Median of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones, each timed by
    ``clock`` (:func:`wall_ms`, or :func:`cuda_ms` for GPU work)."""
    if reps < 1:
        raise ValueError(f"`reps={reps}`: at least one timed call")
    for _ in range(warmup):
        fn()
    return statistics.median(clock(fn) for _ in range(reps))
