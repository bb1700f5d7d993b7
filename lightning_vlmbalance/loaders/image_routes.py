"""Encoder balancing's part of forming a global batch: the images of each micro-step sent
to the ranks that encode them, and each pack given its route (a mixin of
:class:`~lightning_vlmbalance.loaders.global_batch.GlobalBatchFormer`, which owns the groups,
the exchange and the ready events it uses)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_vlmbalance.balance.cost import FEATURES, CostModel
from lightning_vlmbalance.balance.encoder import probe_fields, route_for
from lightning_vlmbalance.balance.exchange import ExchangeError, on_stream
from lightning_vlmbalance.balance.image_routing import ImageRouting, plan_image_routing
from lightning_vlmbalance.packing.collate import cat_padded

__all__ = ["ImageRoutes", "image_payload_fields", "nbytes"]


class ImageRoutes:
    """Routes the images of a global batch (``RebalanceConfig(encoder=True)``, and
    ``mode="auto"``'s ``images`` and ``both``). Needs the former's ``num_replicas``, ``rank``,
    ``group``, ``config``, ``channel``, ``device``, ``ready_events``, ``_side_stream`` and
    ``_exchange``."""

    num_replicas: int
    rank: int
    group: Any
    config: Any
    channel: Any
    device: torch.device
    ready_events: dict[int, Any]

    def _side_stream(self) -> Any: ...

    def _exchange(self, payloads: dict, moves: list, ready_events: dict | None = None) -> dict: ...

    def _balance_encoder(
        self, batches: list[Any], features: np.ndarray, cost_model: CostModel
    ) -> tuple[list[Any], dict[str, float]]:
        """Encoder balancing of one global batch (``RebalanceConfig(encoder=True)``): the plan
        (:func:`~lightning_vlmbalance.balance.image_routing.plan_image_routing`; in ``"off"``
        mode the packs keep their micro-steps), then :meth:`_route`."""
        start = time.perf_counter()
        sizes = self._gather_image_sizes(batches, features)  # (W * G, K), rows per image
        routing = plan_image_routing(
            features, sizes, cost_model, self.num_replicas, reorder=self.config.mode != "off"
        )
        planned_ms = (time.perf_counter() - start) * 1e3
        order, stats = self._route(batches, routing, sizes)
        stats["encoder_plan_ms"] += planned_ms
        return order, stats

    def _route(
        self, batches: list[Any], routing: ImageRouting, sizes: np.ndarray
    ) -> tuple[list[Any], dict[str, float]]:
        """Carries out an image routing of this rank's ``batches`` (every rank's packs, rank by
        rank, as ``routing`` placed them; ``sizes`` their image sizes): the pixels sent where
        they are encoded, and each batch given its ``encoder_route`` and ``encoder_fields``
        (see :mod:`~lightning_vlmbalance.balance.encoder`). Returns this rank's batches in
        order and the statistics."""
        W, G, r = self.num_replicas, len(batches), self.rank
        start = time.perf_counter()
        order = [batches[int(p) - r * G] for p in routing.placed[r]]
        K = sizes.shape[1]
        mine: dict[int, Any] = {}
        moves: list[tuple[int, int, int]] = []
        foreign: list[list[int]] = []  # per micro-step: the keys of the images received
        for m, step in enumerate(routing.steps):
            own = step.home == r
            batch = order[m]
            fields = image_payload_fields(batch)
            batch["encoder_route"] = route_for(
                group=self.channel,
                rank=r,
                world=W,
                own_sizes=step.rows[own].tolist(),
                own_encoder=step.encoder[own].tolist(),
                foreign=[
                    (int(h), int(n))
                    for h, n, e in zip(step.home, step.rows, step.encoder)
                    if e == r and h != r
                ],
                moved_any=step.moved_any,
            )
            # what the encoder must still see: preprocessing of the batch is refused there
            batch["encoder_route"].probe = probe_fields(fields)
            keys = []
            for h, i, e in zip(step.home, step.index, step.encoder):
                if e == h:
                    continue
                key = (m * W + int(h)) * K + int(i)
                moves.append((key, int(h), int(e)))
                if h == r:
                    mine[key] = {name: t[a[i] : a[i + 1]] for name, (t, a) in fields.items()}
                elif e == r:
                    keys.append(key)
            foreign.append(keys)
        planned_ms = (time.perf_counter() - start) * 1e3
        events: dict[int, Any] = {}
        stream = self._side_stream()
        received = self._exchange(mine, moves, ready_events=events)
        received_bytes = 0
        for m, keys in enumerate(foreign):
            got = [received[k] for k in keys]
            received_bytes += sum(nbytes(g) for g in got)
            with on_stream(self.device, stream):
                # on CUDA: the images are joined on the exchange's side stream, after their own
                # transfers, and the micro-step's batch waits for that (its own event)
                if stream is not None:
                    for k in keys:
                        stream.wait_event(events[k])
                fields = _received_fields(got, image_payload_fields(order[m]))
                if stream is not None and keys:
                    self.ready_events[id(order[m])] = stream.record_event()
            order[m]["encoder_fields"], order[m]["encoder_field_rows"] = fields
        return order, {
            "encoder_moved_images": float(routing.moved_images),
            "encoder_bytes": float(received_bytes),  # this rank's; no collective
            "encoder_received_images": float(sum(len(keys) for keys in foreign)),  # this rank's
            "encoder_plan_ms": planned_ms,
            "exchange_ms": (time.perf_counter() - start) * 1e3 - planned_ms,
            "planned_waste_frac": routing.planned_waste_frac,
            "baseline_waste_frac": routing.baseline_waste_frac,
        }

    def _gather_image_sizes(self, batches: list[Any], features: np.ndarray) -> np.ndarray:
        """Every pack's image sizes (rows per image), ``(W * G, K)`` zero-padded, ``K`` the most
        images in a pack of the global batch (known from the gathered features)."""
        K = max(1, int(features[:, FEATURES.index("images")].max()))
        local = torch.zeros((len(batches), K), dtype=torch.int64)
        for k, b in enumerate(batches):
            sizes = [int(x) for x in b["meta"]["image_sizes"]]
            local[k, : len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.num_replicas)]
        try:
            dist.all_gather(gathered, local, group=self.group)
        except RuntimeError as err:
            raise ExchangeError(
                f"rank {self.rank}: gathering the image sizes of a global batch failed (a peer"
                f" died or stopped?): {err}"
            ) from err
        return torch.cat(gathered).numpy()


def image_payload_fields(batch: dict[str, Any]) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """The per-image tensors of a pack that travel with an image encoded on another rank, as
    ``{name: (tensor, starts)}``: image ``i`` is ``tensor[starts[i] : starts[i + 1]]``.

    A pack of pixel rows (``pixel_values`` with ``image_cu_seqlens``) moves those rows. A pack
    whose images are in ``image_fields`` (the Hugging Face families) moves every field, split by
    ``image_field_rows`` (``{name: rows of each image}``, set by the collator that knows the
    layout).

    Raises:
        ValueError: for an image field without its rows per image, named (it would stay with
            the pack while its image is encoded elsewhere), or rows that do not add up.
    """
    fields = batch.get("image_fields") or {}
    if not fields:
        if "pixel_values" not in batch:  # a text-only pack of a layout without pixel rows
            return {}
        pixels = batch["pixel_values"]
        return {"pixel_values": (pixels, np.asarray(batch["image_cu_seqlens"].tolist()))}
    rows = batch.get("image_field_rows") or {}
    unknown = sorted(set(fields) - set(rows))
    if unknown:
        raise ValueError(
            f"encoder balancing moves each image with its per-image fields; the batch has"
            f" image fields {unknown} without their rows per image in `image_field_rows`"
            f" (known: {sorted(rows)}), so it cannot tell which rows belong to which image"
        )
    out = {}
    for name, tensor in fields.items():
        starts = np.concatenate([[0], np.cumsum(np.asarray(rows[name], dtype=np.int64))])
        if starts[-1] != tensor.shape[0]:
            raise ValueError(
                f"image field {name!r} has {tensor.shape[0]} rows but `image_field_rows` gives"
                f" {int(starts[-1])}"
            )
        out[name] = (tensor, starts)
    return out


def _received_fields(
    got: list[dict[str, torch.Tensor]], own: dict[str, tuple[torch.Tensor, np.ndarray]]
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The images received for one micro-step, field by field (``cat_padded``: whole images of
    different tile counts are zero-padded to the largest), with the rows of each."""
    names = list(got[0]) if got else list(own)
    fields = {}
    for name in names:
        if got:
            fields[name] = cat_padded([g[name] for g in got], name)
        else:  # nothing received: an empty field like this rank's own (if it has one)
            t = own[name][0]
            fields[name] = t.new_empty((0, *t.shape[1:]))
    return fields, {name: [int(g[name].shape[0]) for g in got] for name in names}


def nbytes(obj: Any) -> int:
    """Bytes of the tensors in a pack (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    return 0
