"""Lightning callbacks: thin adapters over the framework-free cores."""

from lightning_vlmbalance.callbacks.activation_offload import ActivationOffload
from lightning_vlmbalance.callbacks.compiled_moe import CompiledMoERouting
from lightning_vlmbalance.callbacks.straggler_monitor import StragglerMonitor

__all__ = ["ActivationOffload", "CompiledMoERouting", "StragglerMonitor"]
