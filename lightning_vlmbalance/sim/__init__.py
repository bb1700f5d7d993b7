"""What-if simulator: straggler waste and rebalancing gain at any scale, from measured costs.

:func:`simulate` (the core), :class:`ExchangeModel`, :func:`closed_form_waste`; the command line
is ``vlmbalance-sim`` (:mod:`lightning_vlmbalance.sim.cli`). See ``docs/simulator.md``.
"""

from lightning_vlmbalance.sim.simulate import (
    STRATEGIES,
    SYNC_EVERY,
    ExchangeModel,
    StepOverhead,
    closed_form_waste,
    simulate,
)

__all__ = [
    "STRATEGIES",
    "SYNC_EVERY",
    "ExchangeModel",
    "StepOverhead",
    "closed_form_waste",
    "simulate",
]
