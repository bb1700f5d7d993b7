"""A host clock that moves only when a test says so, for the timing core and the monitor's tests.

``lightning_vlmbalance.timing.timer`` reads ``time.perf_counter`` through its module attribute
``time``; :func:`install` replaces that attribute, so every host interval is exact whatever the
machine's load.
"""

from __future__ import annotations

import pytest

from lightning_vlmbalance.timing import timer as timer_mod


class FakeClock:
    """``time.perf_counter`` for the timer module: seconds that advance only in :meth:`sleep`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def install(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Makes a fresh :class:`FakeClock` the timer module's host clock for one test."""
    fake = FakeClock()
    monkeypatch.setattr(timer_mod, "time", fake)
    return fake
