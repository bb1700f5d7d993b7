"""What-if simulator: straggler waste and rebalancing gain at any scale, from measured costs.

:func:`simulate` (the core), :class:`ExchangeModel`, :func:`closed_form_waste`; the command line
is ``vlmbalance-sim`` (:mod:`lightning_vlmbalance.sim.cli`). See ``docs/simulator.md``.
"""

from typing import Any

from lightning_vlmbalance.sim.simulate import (
    ALL_MODES,
    MODES,
    SYNC_EVERY,
    ExchangeModel,
    StepOverhead,
    closed_form_waste,
    simulate,
)

__all__ = [
    "ALL_MODES",
    "MODES",
    "SYNC_EVERY",
    "ExchangeModel",
    "StepOverhead",
    "closed_form_waste",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # the old name of MODES
        import warnings

        warnings.warn(
            "`lightning_vlmbalance.sim.STRATEGIES` is deprecated: use `MODES` (the simulator's"
            " strategies are now called modes, as `RebalanceConfig.mode` calls them)",
            FutureWarning,
            stacklevel=2,
        )
        return MODES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
