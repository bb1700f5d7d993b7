"""The loss contract of packed batches: every optimizer step gets the gradient of the token-mean
loss over its whole global batch (torch only, no Lightning import).

What one process computing the whole global batch would do is ``loss = sum_t l_t / N`` (``N``
targets in the global batch). Under data parallelism the step is split into packs on ``R`` ranks
and ``A`` micro-steps; the gradient-averaging collective (DDP's all-reduce, FSDP's reduce-scatter)
divides by ``R`` and Lightning divides each micro-step's loss by ``accumulate_grad_batches = A``.
So each pack's summed token loss is multiplied by

    loss_weight = R * A / N

and the sum over ranks and micro-steps of the averaged gradients is exactly ``grad(sum_t l_t) / N``.
``A`` is Lightning's divisor, not the number of micro-steps the step really had: a step cut short
(epoch end, ``limit_train_batches``, ``fast_dev_run``) has fewer packs, ``N`` counts only their
targets, and Lightning still divides by ``A``. A loader that knows the optimizer steps
(:class:`~lightning_vlmbalance.RebalancingLoader` under ``strategy="vlmbalance"``,
:class:`~lightning_vlmbalance.PackedDataLoader` given the ``trainer``) groups its packs into steps
with :func:`optimizer_steps`, counts ``N`` over all ranks, and sets the fields with
:func:`weigh_step`; :func:`packed_cross_entropy` is the loss that uses them.

Batch fields (besides ``loss_tokens``, this pack's targets):

========================  ===============================================================
``global_loss_tokens``    ``N``: targets of the whole optimizer step (all ranks)
``loss_weight``           ``R * A / N`` (``0.0`` when the step has no target)
``meta["weighted_for"]``  ``(R, A)`` the weight assumes; ``packed_cross_entropy(module=...)``
                          checks it against the running Trainer
========================  ===============================================================

A :class:`~lightning_vlmbalance.PackCollator` batch alone is its own global batch: ``N =
loss_tokens``, ``(R, A) = (1, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lightning_vlmbalance.parallel import step_spec

__all__ = [
    "PackedLoss",
    "loss_weight",
    "optimizer_steps",
    "packed_cross_entropy",
    "weigh_step",
]

IGNORE_INDEX = -100


def loss_weight(ranks: int, micro_steps: int, global_loss_tokens: int) -> float:
    """``ranks * micro_steps / global_loss_tokens`` (``0.0`` for a step without targets: its
    summed loss is ``0`` and must stay finite)."""
    return ranks * micro_steps / global_loss_tokens if global_loss_tokens > 0 else 0.0


def weigh_step(
    batches: Iterable[dict[str, Any]], *, global_loss_tokens: int, ranks: int, micro_steps: int
) -> None:
    """Sets ``global_loss_tokens``, ``loss_weight`` and ``meta["weighted_for"]`` on every pack of
    one optimizer step (this rank's share of it)."""
    weight = loss_weight(ranks, micro_steps, global_loss_tokens)
    for batch in batches:
        batch["global_loss_tokens"] = int(global_loss_tokens)
        batch["loss_weight"] = weight
        batch["meta"]["weighted_for"] = (int(ranks), int(micro_steps))


def optimizer_steps(
    batches: Iterable[Any],
    *,
    micro_steps: int,
    start: Callable[[], int] = lambda: 0,
    stop: Callable[[], float] | None = None,
) -> Iterator[list[Any]]:
    """Groups an epoch's batches into the optimizer steps Lightning will make of them.

    Lightning steps after batch ``i`` (0-based position in the epoch) when ``(i + 1) %
    micro_steps == 0`` or ``i + 1`` is the epoch's last batch (``stop``: its number of training
    batches, ``len`` cut by ``limit_train_batches`` / ``fast_dev_run`` / ``overfit_batches``).
    ``start`` is the position of the first batch (``> 0`` after a mid-epoch resume); both are read
    once the first batch has been fetched (loaders resolve their start position lazily), and
    ``stop`` again at every batch (an epoch re-planned mid-way by online calibration changes
    length). No batch at or past ``stop`` is fetched: the training loop would never take it.
    """
    iterator = iter(batches)
    batch = next(iterator, _NOTHING)
    if batch is _NOTHING:
        return
    position = int(start())

    def end_now() -> float:
        return stop() if stop is not None else float("inf")

    group: list[Any] = []
    while position < end_now():
        group.append(batch)
        position += 1
        end = end_now()
        if position % micro_steps == 0 or position == end:
            yield group
            group = []
            if position == end:
                return
        batch = next(iterator, _NOTHING)
        if batch is _NOTHING:
            break
    if group:
        yield group


_NOTHING = object()


class PackedLoss(NamedTuple):
    """What :func:`packed_cross_entropy` returns.

    Attributes:
        loss: ``loss_sum * loss_weight``: return it from ``training_step``.
        loss_sum: summed token cross-entropy of the pack (float32 or wider).
        loss_tokens: targets in the pack (``0`` for a padding pack).
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    loss_tokens: int

    @property
    def mean(self) -> torch.Tensor | None:
        """The pack's mean token loss, detached, for logging (``None`` without targets: a padding
        pack must not be logged as a loss of 0)."""
        if self.loss_tokens <= 0:
            return None
        return self.loss_sum.detach() / self.loss_tokens


def packed_cross_entropy(
    logits: torch.Tensor, batch: dict[str, Any], *, module: Any = None
) -> PackedLoss:
    """Next-token cross-entropy of a packed batch, weighted for its optimizer step.

    Position ``t`` predicts ``labels[t + 1]`` (the Hugging Face convention; the collator masks each
    document's first label so no document predicts across a boundary). Half-precision logits are
    upcast to float32 for the loss.

    Args:
        logits: ``(T, V)`` or ``(1, T, V)`` logits of the pack.
        batch: the ``PackedBatch`` (``labels``, ``loss_tokens``, ``loss_weight``, ...).
        module: the ``LightningModule`` computing the loss: while it trains, the batch's weight
            is checked against its Trainer's ranks and micro-steps per step (a loader that
            did not know the optimizer steps would give a wrong gradient silently).

    Raises:
        ValueError: if ``module`` trains with ``R`` ranks and ``A`` micro-steps but the batch was
            weighted for others (for example a ``PackedDataLoader`` built without ``trainer=``
            under ``strategy="ddp"``), saying what to change.

    Example::

        def training_step(self, batch, batch_idx):
            out = vb.packed_cross_entropy(self(batch), batch, module=self)
            if out.mean is not None:
                self.log("train/loss", out.mean, batch_size=out.loss_tokens)
            return out.loss
    """
    if module is not None:
        check_weighted_for(batch, module)
    logits_TV = logits.reshape(-1, logits.shape[-1])[:-1]
    labels_T = batch["labels"].reshape(-1)[1:]
    if logits_TV.dtype in (torch.float16, torch.bfloat16):
        logits_TV = logits_TV.float()
    loss_sum = F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    weight = batch.get("loss_weight")
    if weight is None:  # a batch from an older collator: it is its own global batch
        tokens = int(batch["loss_tokens"])
        weight = 1.0 / tokens if tokens else 0.0
    return PackedLoss(loss_sum * weight, loss_sum, int(batch["loss_tokens"]))


def check_weighted_for(batch: dict[str, Any], module: Any) -> None:
    """Raises ``ValueError`` if ``batch`` was weighted for other ranks or micro-steps than the
    Trainer that trains ``module`` uses (no check outside training)."""
    try:
        trainer = module.trainer
    except (RuntimeError, AttributeError):  # not attached to a Trainer, or no LightningModule
        return
    if trainer is None or not getattr(trainer, "training", False):
        return
    step = step_spec(trainer)
    expected = (step.world.gradient_ranks, step.micro_steps)
    got = tuple(batch.get("meta", {}).get("weighted_for", (1, 1)))
    if got != expected:
        was_none = ""
        if batch.get("meta", {}).get("loader_trainer_was_none"):
            was_none = (
                ". The loader was built with `trainer=None`: `self.trainer` is None where it"
                " was built (a LightningDataModule's `__init__` runs before the Trainer is"
                " attached); build it in `train_dataloader()`"
            )
        raise ValueError(
            f"the batch's loss_weight assumes {got[0]} rank(s) x {got[1]} micro-step(s) per"
            f" optimizer step, but this Trainer averages gradients over {expected[0]} rank(s)"
            f" with `accumulate_grad_batches={expected[1]}`: the gradient would not be that of"
            " the token-mean loss. Give the training loader its trainer"
            " (`PackedDataLoader(..., trainer=self.trainer)` or `PackedStreamLoader(...,"
            " trainer=self.trainer)`), or use `Trainer(strategy='vlmbalance')`" + was_none
        )
