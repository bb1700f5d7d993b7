"""Activation offload: saved activations to (pinned) host memory and back, hidden behind compute.

Framework-free core: :class:`ActivationOffloader` and :func:`offload_activations`; the
Lightning callback is :class:`~lightning_vlmbalance.callbacks.ActivationOffload`.
"""

from lightning_vlmbalance.offload.offloader import (
    OFFLOAD_MODES,
    ActivationOffloader,
    offload_activations,
)
from lightning_vlmbalance.offload.pool import HostPool

__all__ = ["OFFLOAD_MODES", "ActivationOffloader", "HostPool", "offload_activations"]
