"""The epoch packing plan: which rank computes which pack, identical on every rank (numpy only).

Every rank builds the same plan from the dataset's length table, the seed and the epoch, so all
ranks know every rank's pack count without a collective:

1. The samples are cut into ``num_replicas`` contiguous shards by index (rank ``r`` reads shard
   ``r``: sequential I/O).
2. Each shard is shuffled with a generator seeded by ``(seed, epoch, shard)`` and packed by
   :func:`~lightning_vlmbalance.packing.binpack.pack_greedy` (windows over the shuffled order, so no
   global sort by length).
3. Pack counts are equalised: ranks with more packs than ``ceil(P / num_replicas)`` hand their last
   packs to ranks with fewer (counted as ``moved_packs``). Then the *remainder policy* settles the
   ``P mod num_replicas`` left over:

   - ``"pad"`` (default): the ranks one pack short get one *padding pack* (no sample, no loss
     token). Every sample is used exactly once; nothing is dropped or duplicated.
   - ``"drop"``: the left-over packs are dropped; their samples are counted in
     ``dropped_samples`` and listed in ``dropped_sample_ids``.

4. With ``shuffle`` (the default), each rank's real packs are put in a random order seeded by
   ``(seed, epoch, rank)``; padding packs stay last. The packer emits a window's packs ordered by
   content, and training them in that order would make image-heavy steps cluster and step cost
   drift through the epoch. ``shuffle=False`` keeps packing order.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from lightning_vlmbalance._moved import DP_RANKS, renamed_keyword
from lightning_vlmbalance.packing.binpack import (
    Packs,
    pack_best_fit_decreasing,
    pack_greedy,
    packing_efficiency,
    raise_for_first_bad,
)

__all__ = [
    "EpochPlan",
    "PackingConfig",
    "apply_overlong_policy",
    "as_length_column",
    "build_epoch_plan",
]

log = logging.getLogger(__name__)

Overlong = Literal["error", "skip", "truncate"]
Remainder = Literal["pad", "drop"]
Packer = Literal["greedy", "bfd", "budget"]
_OVERLONG: tuple[str, ...] = get_args(Overlong)
_REMAINDER: tuple[str, ...] = get_args(Remainder)
_PACKERS: tuple[str, ...] = get_args(Packer)

PADDING = -1  # pack id of a padding pack
_ORDER_STREAM = 1  # last word of the pack-order generator's seed


@dataclass(kw_only=True, slots=True, frozen=True)
class PackingConfig:
    """How samples become packs. Identical on every rank (it is part of the plan's fingerprint).

    Args:
        seq_len: tokens per pack.
        seed: base seed of the per-epoch shuffle.
        shuffle: shuffle samples within each shard every epoch.
        window: samples packed together (see ``pack_greedy``).
        min_fill: fill below which a pack is dissolved once and retried in the next window.
        overlong: policy for a sample longer than ``seq_len``: ``"error"`` (names the sample),
            ``"skip"`` (counted and logged), ``"truncate"`` (text-only samples are cut to
            ``seq_len``; a sample with images still raises, images are never cut).
        remainder: ``"pad"`` or ``"drop"`` (see the module docstring).
        packer: ``"greedy"`` (default), ``"bfd"`` (best-fit-decreasing baseline) or ``"budget"``
            (best-fit-decreasing with ``image_budget`` image tokens per pack: the load-balancing
            baseline whose packing efficiency collapses).
        image_budget: image tokens allowed per pack with ``packer="budget"``.
        max_image_tokens_per_pack: a vision-token budget for the ``"greedy"`` packer: no pack
            holds more image tokens (the vision encoder's memory grows with its patches); a
            sample over it is an error naming it. Packs stay as full as the budget allows.
    """

    seq_len: int
    seed: int = 0
    shuffle: bool = True
    window: int = 4096
    min_fill: float = 0.98
    overlong: Overlong = "error"
    remainder: Remainder = "pad"
    packer: Packer = "greedy"
    image_budget: int | None = None
    max_image_tokens_per_pack: int | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"`PackingConfig(seq_len={self.seq_len!r})` must be >= 1")
        if self.window < 1:
            raise ValueError(f"`PackingConfig(window={self.window!r})` must be >= 1")
        if self.overlong not in _OVERLONG:
            raise ValueError(
                f"`PackingConfig(overlong={self.overlong!r})` is not one of {_OVERLONG}"
            )
        if self.remainder not in _REMAINDER:
            raise ValueError(
                f"`PackingConfig(remainder={self.remainder!r})` is not one of {_REMAINDER}"
            )
        if self.packer not in _PACKERS:
            raise ValueError(f"`PackingConfig(packer={self.packer!r})` is not one of {_PACKERS}")
        cap = self.max_image_tokens_per_pack
        if cap is not None and (self.packer != "greedy" or cap < 1):
            raise ValueError(
                f"`PackingConfig(max_image_tokens_per_pack={cap!r})` is a positive budget for the"
                f" 'greedy' packer (packer={self.packer!r})"
            )
        if (self.packer == "budget") != (self.image_budget is not None):
            raise ValueError(
                "`PackingConfig(image_budget=...)` is required with, and only with, packer='budget'"
            )


@dataclass(kw_only=True, slots=True)
class EpochPlan:
    """One epoch's packs on every rank.

    ``rank_packs[r][k]`` is the array of sample ids that rank ``r`` computes at its ``k``-th step
    (empty for a padding pack) and ``rank_pack_ids[r][k]`` the pack's id, unique in the epoch
    (``-1`` for a padding pack). Every rank has the same number of packs.
    """

    epoch: int
    num_replicas: int  # the data-parallel ranks
    rank_packs: list[list[np.ndarray]]
    rank_pack_ids: list[list[int]]
    pack_tokens: np.ndarray  # tokens of each real pack, by pack id
    seq_len: int
    moved_packs: int = 0
    padding_packs: int = 0
    dropped_sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    skipped_sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    truncated_sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # balanced at the source: global batches re-formed, and (exact=True) kept as they were
    balanced_batches: int = 0

    @property
    def world_size(self) -> int:
        """Deprecated: :attr:`num_replicas` (``world_size`` is every process of the job)."""
        warnings.warn(
            "`EpochPlan.world_size` is now `EpochPlan.num_replicas` (the data-parallel ranks;"
            " `world_size` is every process of the job: docs/glossary.md)",
            FutureWarning,
            stacklevel=2,
        )
        return self.num_replicas

    fallback_batches: int = 0
    # formed at the source (build_balanced_epoch_plan), and the per-epoch decision of
    # ``SourceBalance(when="auto")`` that chose this plan (``EpochChoice.to_dict()``), if any
    formed_at_source: bool = False
    epoch_choice: dict | None = None

    @property
    def packs_per_rank(self) -> int:
        return len(self.rank_packs[0]) if self.rank_packs else 0

    @property
    def efficiency(self) -> float:
        """Packing efficiency of the real packs (sample tokens / (packs x seq_len))."""
        return packing_efficiency(self.pack_tokens, self.seq_len)

    @property
    def dropped_samples(self) -> int:
        return len(self.dropped_sample_ids)

    def sample_ids(self) -> np.ndarray:
        """Every sample id computed this epoch, over all ranks (for coverage checks)."""
        parts = [p for packs in self.rank_packs for p in packs]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def apply_overlong_policy(
    total_tokens: np.ndarray, image_tokens: np.ndarray, seq_len: int, policy: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Applies the over-long policy to a length table.

    Returns:
        ``(effective_lengths, skipped_ids, truncated_ids)``; skipped samples keep their length in
        ``effective_lengths`` but must not be packed.

    Raises:
        ValueError: naming the first offending sample, for ``"error"``, or for a sample with image
            tokens under ``"truncate"``.
    """
    over = np.flatnonzero(total_tokens > seq_len)
    empty = np.zeros(0, np.int64)
    if len(over) == 0:
        return total_tokens, empty, empty
    i = int(over[0])
    if policy == "error":
        raise ValueError(
            f"sample {i} has {int(total_tokens[i])} tokens, more than `seq_len={seq_len}`"
            f" ({len(over)} such samples). Pass `overlong='skip'` to leave them out (counted),"
            " `overlong='truncate'` to cut text-only samples, or raise `seq_len`."
        )
    if policy == "skip":
        _warn_once(
            "Skipping %d samples longer than seq_len=%d (first: sample %d with %d tokens).",
            len(over),
            seq_len,
            i,
            int(total_tokens[i]),
        )
        return total_tokens, over.astype(np.int64), empty
    with_images = over[image_tokens[over] > 0]
    if len(with_images):
        j = int(with_images[0])
        raise ValueError(
            f"sample {j} has {int(total_tokens[j])} tokens ({int(image_tokens[j])} image tokens),"
            f" more than `seq_len={seq_len}`, and `overlong='truncate'` never cuts a sample with"
            " images. Use `overlong='skip'` or raise `seq_len`."
        )
    _warn_once(
        "Truncating %d text-only samples longer than seq_len=%d (first: sample %d, %d tokens).",
        len(over),
        seq_len,
        i,
        int(total_tokens[i]),
    )
    effective = total_tokens.copy()
    effective[over] = seq_len
    return effective, empty, over.astype(np.int64)


_warned: set[tuple] = set()


def _warn_once(msg: str, *args: Any) -> None:
    """The plan is rebuilt every epoch on every rank: say each policy outcome once."""
    if (msg, args) not in _warned:
        _warned.add((msg, args))
        log.warning(msg, *args)


def as_length_column(values: Any, column: str) -> np.ndarray:
    """One column of a length table as ``int64``, refusing what a cast would silently change.

    A NaN or infinite value, or a non-integral one (``10.7``), raises ``ValueError`` naming the
    column and the first such sample; integral floats (``10.0``, as read from a CSV) are accepted.
    """
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "b" or arr.dtype.kind not in "f":
        raise ValueError(
            f"length table column {column!r} must hold integers, got dtype {arr.dtype}"
        )
    bad = np.flatnonzero(~np.isfinite(arr))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"sample {i} has {float(arr.flat[i])} in length table column {column!r}")
    raise_for_first_bad(
        arr != np.round(arr),
        lambda i, _: (
            f"sample {i} has a non-integral length {float(arr.flat[i])} in length table"
            f" column {column!r}: token counts are integers (nothing is rounded silently)"
        ),
    )
    return arr.astype(np.int64)


def check_length_table(total_tokens: np.ndarray, image_tokens: np.ndarray) -> None:
    """Validates a length table; raises ``ValueError`` naming the first bad sample."""
    if total_tokens.ndim != 1 or image_tokens.shape != total_tokens.shape:
        raise ValueError(
            f"length table columns must be 1-D and of equal length, got total_tokens "
            f"{tuple(total_tokens.shape)} and image_tokens {tuple(image_tokens.shape)}"
        )
    if len(total_tokens) == 0:
        raise ValueError("the dataset is empty: its length table has no samples")
    raise_for_first_bad(
        total_tokens < 1, lambda i, _: f"sample {i} has {int(total_tokens[i])} tokens (< 1)"
    )
    raise_for_first_bad(
        (image_tokens < 0) | (image_tokens > total_tokens),
        lambda i, _: (
            f"sample {i} has {int(image_tokens[i])} image tokens but"
            f" {int(total_tokens[i])} tokens in all: image tokens must be in [0, total_tokens]"
        ),
    )


def check_image_counts(images: np.ndarray, image_tokens: np.ndarray) -> None:
    """Validates the ``images`` column against ``image_tokens``; raises ``ValueError`` naming the
    first bad sample: one entry per sample, and images exactly where there are image tokens."""
    if images.shape != image_tokens.shape:
        raise ValueError(
            f"length table column 'images' has shape {tuple(images.shape)} but image_tokens"
            f" {tuple(image_tokens.shape)}: one image count per sample"
        )
    bad = np.flatnonzero((images < 0) | ((images > 0) != (image_tokens > 0)))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"sample {i} has {int(images[i])} images and {int(image_tokens[i])} image tokens:"
            " a sample has images exactly when it has image tokens"
        )


def _pack_shard(
    ids: np.ndarray, lengths: np.ndarray, image_tokens: np.ndarray, config: PackingConfig
) -> Packs:
    if config.packer == "greedy":
        return pack_greedy(
            lengths,
            config.seq_len,
            window=config.window,
            min_fill=config.min_fill,
            image_tokens=image_tokens,
            max_image_tokens=config.max_image_tokens_per_pack,
        )
    if config.packer == "bfd":
        return pack_best_fit_decreasing(lengths, config.seq_len, window=config.window)
    return pack_best_fit_decreasing(
        lengths,
        config.seq_len,
        window=config.window,
        image_tokens=image_tokens,
        image_budget=config.image_budget,
    )


@renamed_keyword(*DP_RANKS)
def build_epoch_plan(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    config: PackingConfig,
    *,
    num_replicas: int,
    epoch: int,
) -> EpochPlan:
    """Builds the packing plan of one epoch; the same inputs give the same plan on every rank.

    With ``config.shuffle`` each rank trains its real packs in a random order seeded by
    ``(seed, epoch, rank)`` (step 4 of the module docstring); without it, in packing order.

    Raises:
        ValueError: for a bad length table, an over-long sample under ``overlong="error"``, or a
            shard too small to give every rank a sample.
    """
    plan = _plan_in_packing_order(
        total_tokens, image_tokens, config, num_replicas=num_replicas, epoch=epoch
    )
    if config.shuffle:
        _shuffle_pack_order(plan, config.seed)
    return plan


def _shuffle_pack_order(plan: EpochPlan, seed: int) -> None:
    """Puts each rank's real packs in a random order seeded by ``(seed, epoch, rank)``, in place.

    The packer emits a window's packs ordered by their content (on a synthetic mix, image tokens
    per pack climb by about 40% from a window's first packs to its last), so training them in
    that order drifts: image-heavy steps cluster and step cost climbs through every window.
    Padding packs stay last. Pack ids travel with their packs, so they keep their meaning;
    counts, tokens and efficiency are unchanged.
    """
    for r, (packs, ids) in enumerate(zip(plan.rank_packs, plan.rank_pack_ids)):
        real = sum(1 for i in ids if i != PADDING)  # padding packs are appended last
        # a stream apart from the sample shuffle's ``[seed, epoch, r]``
        order = np.random.default_rng([seed, plan.epoch, r, _ORDER_STREAM]).permutation(real)
        packs[:real] = [packs[k] for k in order]
        ids[:real] = [ids[k] for k in order]


def _plan_in_packing_order(
    total_tokens: np.ndarray,
    image_tokens: np.ndarray,
    config: PackingConfig,
    *,
    num_replicas: int,
    epoch: int,
) -> EpochPlan:
    """:func:`build_epoch_plan` with every rank's packs in packing order (steps 1-3)."""
    total_tokens = as_length_column(total_tokens, "total_tokens")
    image_tokens = as_length_column(image_tokens, "image_tokens")
    check_length_table(total_tokens, image_tokens)
    if num_replicas < 1:
        raise ValueError(f"`num_replicas={num_replicas!r}` must be >= 1")
    n = len(total_tokens)
    if n < num_replicas:
        raise ValueError(
            f"the dataset has {n} samples, fewer than the {num_replicas} ranks: some rank's shard"
            " would be empty"
        )
    lengths, skipped, truncated = apply_overlong_policy(
        total_tokens, image_tokens, config.seq_len, config.overlong
    )
    keep = np.ones(n, dtype=bool)
    keep[skipped] = False
    cap = config.max_image_tokens_per_pack
    if cap is not None:  # named by the dataset's index (the packer sees shuffled positions)
        raise_for_first_bad(
            keep & (np.asarray(image_tokens) > cap),
            lambda i, k: (
                f"sample {i} has {int(image_tokens[i])} image tokens, more than"
                f" `max_image_tokens_per_pack={cap}` ({k} such samples): images are never cut;"
                " raise the budget or leave those samples out"
            ),
        )

    bounds = np.linspace(0, n, num_replicas + 1).astype(np.int64)  # contiguous shards
    shard_packs: list[list[np.ndarray]] = []
    shard_ids: list[list[int]] = []
    tokens: list[np.ndarray] = []
    next_id = 0
    for r in range(num_replicas):
        ids = np.arange(bounds[r], bounds[r + 1], dtype=np.int64)
        ids = ids[keep[ids]]
        if config.shuffle:
            rng = np.random.default_rng([config.seed, epoch, r])
            ids = ids[rng.permutation(len(ids))]
        packs = _pack_shard(ids, lengths[ids], image_tokens[ids], config)
        shard_packs.append([ids[packs[k]] for k in range(len(packs))])
        shard_ids.append(list(range(next_id, next_id + len(packs))))
        tokens.append(packs.tokens(lengths[ids]))
        next_id += len(packs)
    pack_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)

    total = next_id
    if total == 0:
        raise ValueError("no sample is left to pack (every sample was skipped)")
    if config.remainder == "pad":
        target = -(-total // num_replicas)
    else:
        target = total // num_replicas
        if target == 0:
            raise ValueError(
                f"only {total} packs for {num_replicas} ranks: `remainder='drop'` would drop them"
                " all; use `remainder='pad'`"
            )
    moved, leftover = _equalize(shard_packs, shard_ids, target)
    padding = 0
    for r in range(num_replicas):  # "pad": deficits (W * target - total packs in all)
        while len(shard_packs[r]) < target:
            shard_packs[r].append(np.zeros(0, np.int64))
            shard_ids[r].append(PADDING)
            padding += 1
    dropped = np.concatenate([pack for pack, _ in leftover]) if leftover else np.zeros(0, np.int64)
    if leftover:
        log.warning(
            "Dropping %d packs (%d samples) so that every rank has %d packs in epoch %d"
            " (`remainder='drop'`).",
            len(leftover),
            len(dropped),
            target,
            epoch,
        )
    return EpochPlan(
        epoch=epoch,
        num_replicas=num_replicas,
        rank_packs=shard_packs,
        rank_pack_ids=shard_ids,
        pack_tokens=pack_tokens,
        seq_len=config.seq_len,
        moved_packs=moved,
        padding_packs=padding,
        dropped_sample_ids=dropped,
        skipped_sample_ids=skipped,
        truncated_sample_ids=truncated,
    )


def _equalize(
    rank_packs: list[list[np.ndarray]], rank_ids: list[list[int]], target: int
) -> tuple[int, list[tuple[np.ndarray, int]]]:
    """Moves packs above ``target`` (from the end of a rank's list) to the ranks with the fewest.

    Returns the number of packs moved and the packs left over once every rank has ``target``.
    """
    surplus: list[tuple[np.ndarray, int]] = []
    for packs, ids in zip(rank_packs, rank_ids):  # in rank order, each rank's in its own order
        surplus.extend(zip(packs[target:], ids[target:]))
        del packs[target:], ids[target:]
    moved = 0
    while moved < len(surplus):
        r = min(range(len(rank_packs)), key=lambda q: (len(rank_packs[q]), q))
        if len(rank_packs[r]) >= target:
            break
        pack, pid = surplus[moved]
        rank_packs[r].append(pack)
        rank_ids[r].append(pid)
        moved += 1
    return moved, surplus[moved:]
