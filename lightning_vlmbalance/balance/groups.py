"""The process groups of the rebalancing exchange: made once per fit, after the world group (and
the device mesh) exist, and destroyed at the strategy's teardown.

With tensor parallelism the data-parallel group is smaller than the world: the ranks of one
tensor-parallel group compute the same packs, so plans and exchanges run among the data-parallel
peers that share a tensor-parallel rank, one group per tensor-parallel rank (every rank creates
every group, in the same order, as ``new_group`` requires).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["ExchangeGroups"]

log = logging.getLogger(__name__)


@dataclass
class ExchangeGroups:
    """This rank's groups of the exchange (``None``: not made, as with one process).

    Attributes:
        exchange: the feature gather and the plan's exchange (gloo; a group of its own, so the
            exchange never interleaves with the gradient sync).
        payload: the packs' payloads GPU to GPU (NCCL, on a side stream), or ``None`` (they
            travel on ``exchange``).
        encoder: the image embeddings' return in the training step (encoder balancing; a group
            of its own: the exchange thread may be in a collective on ``exchange`` meanwhile).
        ranks: the global rank of each rank of ``exchange`` when it is not the world.
    """

    exchange: dist.ProcessGroup | None = None
    payload: dist.ProcessGroup | None = None
    encoder: dist.ProcessGroup | None = None
    ranks: list[int] | None = None

    @classmethod
    def create(
        cls,
        peer_groups: list[list[int]],
        me: int,
        world_size: int,
        *,
        timeout_s: float,
        gpu_payloads: bool,
        encoder: bool,
    ) -> ExchangeGroups:
        """Every rank's groups, made on every rank in the same order; this rank's returned.

        Args:
            peer_groups: the global ranks of each data-parallel group (one per tensor-parallel
                rank; one group of every rank without tensor parallelism).
            me: this rank's global rank; ``world_size``: every process.
            timeout_s: the groups' deadline (a dead peer fails a collective, never hangs it).
            gpu_payloads: payloads on an NCCL group of their own.
            encoder: make the embeddings' return group (encoder balancing).
        """
        timeout = timedelta(seconds=timeout_s)
        mine = cls()
        for ranks in peer_groups:
            members = None if len(ranks) == world_size else ranks

            def new(backend: str, members: list[int] | None = members) -> dist.ProcessGroup:
                return dist.new_group(ranks=members, backend=backend, timeout=timeout)

            groups = cls(
                exchange=new("gloo"),
                payload=new("nccl") if gpu_payloads else None,
                encoder=new("nccl" if gpu_payloads else "gloo") if encoder else None,
                ranks=None if members is None else [int(r) for r in ranks],
            )
            if me in ranks:
                mine = groups
        return mine

    def destroy(self) -> None:
        """Destroys this rank's groups (best effort: the world may be gone already)."""
        for group in (self.encoder, self.payload, self.exchange):
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError) as err:  # pragma: no cover - best effort
                    log.debug("could not destroy an exchange group: %s", err)
        self.exchange = self.payload = self.encoder = None
        self.ranks = None
