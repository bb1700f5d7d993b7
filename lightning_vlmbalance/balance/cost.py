"""Cost model: a pack's vision and language-model milliseconds from a few integers.

Pure numpy. The features of a pack are integers every rank can all-gather cheaply:

==================  =====================================================================
``total_tokens``    tokens in the pack (text + image)
``image_tokens``    image tokens (what the vision encoder computes)
``images``          number of images
``image_sq_tokens`` sum over images of (tokens of that image)^2: attention inside each image
``doc_sq_tokens``   sum over documents of (document length)^2: packed causal attention
==================  =====================================================================

Each phase is linear in the features of its module, with non-negative coefficients (ms per unit):

* ``vision_fwd``, ``vision_bwd``: ``image_pack`` (1 if the pack has an image: the encoder's fixed
  cost), ``images``, ``image_tokens``, ``image_sq_tokens``;
* ``llm_fwd``, ``llm_bwd``: ``pack`` (1 per pack), ``total_tokens``, ``doc_sq_tokens``.

Default coefficients: vision forward 60 ms + 0.28 ms per image token per pack (the production
numbers in DESIGN.md: 3,000 image tokens -> 900 ms, 500 -> 200 ms), backward twice forward. The
LLM defaults are an assumption of the same scale (about 300 ms forward for a full 8,192-token
pack, a quarter of it attention), not a measurement: :meth:`CostModel.fit` replaces them with
coefficients fitted to StragglerMonitor logs by non-negative least squares.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FEATURES",
    "LLM_PHASES",
    "MEASURED_FIELDS",
    "MODELLED_PHASES",
    "CostModel",
    "FitReport",
    "features_from_meta",
    "features_from_packs",
    "nnls",
    "read_monitor_jsonl",
    "sample_features",
]

FEATURES: tuple[str, ...] = (
    "total_tokens",
    "image_tokens",
    "images",
    "image_sq_tokens",
    "doc_sq_tokens",
)
MODELLED_PHASES: tuple[str, ...] = ("vision_fwd", "vision_bwd", "llm_fwd", "llm_bwd")
LLM_PHASES: tuple[str, ...] = ("llm_fwd", "llm_bwd")  # what a pack costs wherever its images go
_VISION_TERMS = ("image_pack", "images", "image_tokens", "image_sq_tokens")
_LLM_TERMS = ("pack", "total_tokens", "doc_sq_tokens")
_TERMS = {
    "vision_fwd": _VISION_TERMS,
    "vision_bwd": _VISION_TERMS,
    "llm_fwd": _LLM_TERMS,
    "llm_bwd": _LLM_TERMS,
}
# StragglerMonitor micro-batch fields -> the phases whose sum they measure
_MEASURED = {
    "vision_fwd_ms": ("vision_fwd",),
    "llm_fwd_ms": ("llm_fwd",),
    "backward_ms": ("vision_bwd", "llm_bwd"),
}
# the measured per-micro-batch times a fit uses (StragglerMonitor record keys)
MEASURED_FIELDS: tuple[str, ...] = tuple(_MEASURED)
_FORMAT_VERSION = 1


# the largest pack cost the planner takes (integer microseconds: int64 holds 2.9e5 years)
MAX_PACK_COST_MS = 3.2e10


def _default_coefficients() -> dict[str, dict[str, float]]:
    vision_fwd = {"image_pack": 60.0, "images": 0.0, "image_tokens": 0.28, "image_sq_tokens": 0.0}
    llm_fwd = {"pack": 20.0, "total_tokens": 0.03, "doc_sq_tokens": 1.0e-6}
    return {
        "vision_fwd": vision_fwd,
        "vision_bwd": {k: 2.0 * v for k, v in vision_fwd.items()},
        "llm_fwd": llm_fwd,
        "llm_bwd": {k: 2.0 * v for k, v in llm_fwd.items()},
    }


@dataclass(frozen=True)
class FitReport:
    """How well a fitted :class:`CostModel` explains the measurements it was fitted to.

    Attributes:
        samples: micro-batches used (records with the pack features).
        mape: mean absolute percentage error per measured field (``vision_fwd_ms``, ...) and for
            their sum (``total_ms``), as a fraction (0.05 = 5%).
        r2: coefficient of determination per field and for ``total_ms``.
        fitted: the fields that were fitted; the phases of a field absent from the data keep
            their previous coefficients.
        timed: per measured field, how many of the ``samples`` had that time.
        determined: per fitted field, the terms the records determined (fitted).
        kept: per fitted field, the terms the records cannot determine, which kept their
            previous (prior) coefficients: a term that is zero in every record (no image in
            text-only timings), or a combination of the others (``images``, ``image_tokens``
            and ``image_sq_tokens`` when every image has the same size). Their errors above
            say nothing about these terms.
        skipped: records without the pack features (not used).
    """

    samples: int
    mape: dict[str, float]
    r2: dict[str, float]
    fitted: tuple[str, ...]
    timed: dict[str, int] = field(default_factory=dict)
    determined: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kept: dict[str, tuple[str, ...]] = field(default_factory=dict)
    skipped: int = 0

    def __str__(self) -> str:
        parts = [f"{k}: MAPE {self.mape[k]:.2%}, R^2 {self.r2[k]:.4f}" for k in self.mape]
        text = f"cost-model fit on {self.samples} micro-batches"
        if self.skipped:
            text += f" ({self.skipped} records without the pack features skipped)"
        if self.timed:
            text += " (timed: " + ", ".join(f"{k} {v}" for k, v in self.timed.items()) + ")"
        text += "; " + "; ".join(parts)
        kept = {k: v for k, v in self.kept.items() if v}
        if kept:
            text += "; kept the prior (not determined by these records) for " + "; ".join(
                f"{k}: {', '.join(v)}" for k, v in kept.items()
            )
        return text


@dataclass(kw_only=True)
class CostModel:
    """Predicted milliseconds of a pack per phase; see the module docstring for the terms.

    Args:
        coefficients: ``{phase: {term: ms per unit}}``; missing phases or terms take the
            defaults. Coefficients must be finite and non-negative.

    Raises:
        ValueError: for an unknown phase or term, or a negative or non-finite coefficient.

    Example::

        >>> model = CostModel()
        >>> feats = {"total_tokens": [8192, 8192], "image_tokens": [3000, 500],
        ...          "images": [3, 1], "image_sq_tokens": [3_000_000, 250_000],
        ...          "doc_sq_tokens": [8192**2, 8192**2]}
        >>> [round(x) for x in model.predict(feats)["vision_fwd"]]
        [900, 200]
    """

    coefficients: dict[str, dict[str, float]] = field(default_factory=_default_coefficients)

    def __post_init__(self) -> None:
        merged = _default_coefficients()
        if not isinstance(self.coefficients, Mapping):
            raise ValueError(
                "`CostModel`: coefficients must be a mapping {phase: {term: ms per unit}}, got"
                f" {type(self.coefficients).__name__}"
            )
        for phase, terms in self.coefficients.items():
            if phase not in merged:
                raise ValueError(
                    f"`CostModel`: unknown phase {phase!r}; phases are {MODELLED_PHASES}"
                )
            if not isinstance(terms, Mapping):
                raise ValueError(
                    f"`CostModel`: coefficients of {phase} must be a mapping {{term: ms per"
                    f" unit}}, got {terms!r}"
                )
            for term, value in terms.items():
                if term not in merged[phase]:
                    raise ValueError(
                        f"`CostModel`: phase {phase!r} has no term {term!r};"
                        f" its terms are {_TERMS[phase]}"
                    )
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ValueError(
                        f"`CostModel`: coefficient {phase}.{term} = {value!r} must be a number"
                    )
                value = float(value)
                if not (math.isfinite(value) and value >= 0.0):
                    raise ValueError(
                        f"`CostModel`: coefficient {phase}.{term} = {value!r} must be finite"
                        " and >= 0"
                    )
                merged[phase][term] = value
        self.coefficients = merged

    # -- prediction -------------------------------------------------------------------------

    def predict(self, features: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Milliseconds per phase for each pack: ``{phase: (N,) float64}``."""
        terms = _term_matrix(features)
        return {
            phase: terms[:, [_ALL_TERMS.index(t) for t in _TERMS[phase]]]
            @ np.array([self.coefficients[phase][t] for t in _TERMS[phase]])
            for phase in MODELLED_PHASES
        }

    def pack_cost_ms(self, features: Mapping[str, Any]) -> np.ndarray:
        """Forward plus backward milliseconds of each pack, ``(N,) float64``."""
        return np.sum(list(self.predict(features).values()), axis=0)

    def additive_cost_ms(
        self, features: Mapping[str, Any], phases: Sequence[str] = MODELLED_PHASES
    ) -> tuple[np.ndarray, float, float]:
        """Each row's forward plus backward milliseconds from its additive terms (every term
        but ``pack`` and ``image_pack``), and the two per-pack costs: what every pack pays once
        and what a pack with any image pays once. For rows of :func:`sample_features` (one
        sample each) the first sums over a pack's samples to the pack's cost less those two:
        the source former's per-sample costs, from the same term matrix as :meth:`predict`.
        ``phases``: the phases summed (``LLM_PHASES``: the language model alone)."""
        unknown = [p for p in phases if p not in MODELLED_PHASES]
        if unknown:
            raise ValueError(f"`additive_cost_ms(phases={list(phases)})`: unknown {unknown}")
        terms = _term_matrix(features)
        per_term = np.array(
            [sum(self.coefficients[p].get(t, 0.0) for p in phases) for t in _ALL_TERMS]
        )
        fixed = [_ALL_TERMS.index(t) for t in _PER_PACK_TERMS]
        additive = [i for i in range(len(_ALL_TERMS)) if i not in fixed]
        pack, image_pack = (float(per_term[_ALL_TERMS.index(t)]) for t in _PER_PACK_TERMS)
        return terms[:, additive] @ per_term[additive], pack, image_pack

    def llm_cost_ms(self, features: Mapping[str, Any]) -> np.ndarray:
        """Language-model forward plus backward milliseconds of each pack, ``(N,) float64``:
        what a pack costs wherever its images are encoded."""
        predicted = self.predict(features)
        return predicted["llm_fwd"] + predicted["llm_bwd"]

    def image_cost_ms(self, image_tokens: Any) -> tuple[np.ndarray, float]:
        """Vision forward plus backward milliseconds of each image encoded by itself (its
        ``images``, ``image_tokens`` and ``image_sq_tokens`` terms), ``(N,) float64``, and the
        encoder's per-call cost (the ``image_pack`` terms), which a rank pays once for all the
        images it encodes: the encoder balancer's inputs."""
        tokens = np.asarray(image_tokens, dtype=np.int64)
        vision = ("vision_fwd", "vision_bwd")
        per_call = sum(self.coefficients[p]["image_pack"] for p in vision)
        per_image = sum(
            self.coefficients[p]["images"]
            + self.coefficients[p]["image_tokens"] * tokens
            + self.coefficients[p]["image_sq_tokens"] * (tokens * tokens)
            for p in vision
        )
        return np.asarray(per_image, dtype=np.float64).reshape(tokens.shape), float(per_call)

    def pack_cost_us(self, features: Mapping[str, Any]) -> np.ndarray:
        """:meth:`pack_cost_ms` rounded to integer microseconds: the planner's input.

        Raises:
            ValueError: for a cost that integer microseconds cannot hold (a pack predicted to
                take more than :data:`MAX_PACK_COST_MS`: the model's coefficients are far off),
                naming the pack and the model's largest coefficient.
        """
        cost_ms = self.pack_cost_ms(features)
        too_big = np.flatnonzero(~(cost_ms <= MAX_PACK_COST_MS))
        if len(too_big):
            i = int(too_big[0])
            phase, term, value = max(
                ((p, t, v) for p, terms in self.coefficients.items() for t, v in terms.items()),
                key=lambda c: c[2],
            )
            raise ValueError(
                f"CostModel: pack {i} is predicted to take {float(cost_ms[i]):.3g} ms, more than"
                f" {MAX_PACK_COST_MS:.0e} ms (a year): the model's coefficients are far off"
                f" (its largest: {phase}.{term} = {value:.3g} ms per unit)"
            )
        return np.rint(cost_ms * 1000.0).astype(np.int64)

    # -- calibration ------------------------------------------------------------------------

    def fit(self, records: Iterable[Mapping[str, Any]] | str | Path) -> FitReport:
        """Fits the coefficients to measured micro-batch times, in place.

        Args:
            records: StragglerMonitor micro-batch records (dicts holding the pack features and
                some of ``vision_fwd_ms``, ``llm_fwd_ms``, ``backward_ms``), or a path to a
                StragglerMonitor JSON-lines file or a folder of them.

        ``vision_fwd_ms`` fits the vision forward terms, ``llm_fwd_ms`` the LLM forward terms,
        and ``backward_ms`` (vision and LLM backward together) all terms at once, split back
        into the two backward phases. Each is a non-negative least-squares fit of relative
        errors (timing noise grows with the time) on columns scaled to unit norm. A field absent
        from every record leaves its phases unchanged.

        Only what the records determine is fitted: a term that is zero in every record (a
        vision term in text-only timings) or a combination of the terms before it (in the
        order ``pack``, ``image_pack``, ``total_tokens``, ``image_tokens``, ``images``,
        ``doc_sq_tokens``, ``image_sq_tokens``; e.g. ``images`` and ``image_sq_tokens`` when
        every image has the same size as every other) keeps its current coefficient (the
        prior), and the others are fitted to the times minus the kept terms' share; unless the
        records contradict the prior: a term that fits them clearly better (1% lower error) at
        0 is set to 0 and counts as determined (a frozen vision tower's backward, where every
        pack has an image and ``image_pack`` is ``pack``). The report's ``determined`` and
        ``kept`` name them.

        Returns:
            The :class:`FitReport` (errors of the fitted model on the same records).

        Raises:
            ValueError: if no record has the pack features and at least one measured field, a
                record is not a mapping, a feature is not a finite number >= 0, a measured
                time is not a finite number >= 0 (each naming the record: its index in
                ``records``, or its file, line and place in ``"micro"``), or a field has fewer
                usable records than the terms it fits. The model is unchanged then.
        """
        records, rows, where = _featured_records(records)
        terms = _term_matrix({f: [r[f] for r in rows] for f in FEATURES})
        fitted: list[str] = []
        determined: dict[str, tuple[str, ...]] = {}
        kept: dict[str, tuple[str, ...]] = {}
        new = {phase: dict(terms_) for phase, terms_ in self.coefficients.items()}
        for measured, phases in _MEASURED.items():
            have = np.array([r.get(measured) is not None for r in rows])
            if not have.any():
                continue
            for i in np.flatnonzero(have):
                _check_number(rows[i][measured], measured, where[i], what="time")
            pairs = [(p, t) for p in phases for t in _TERMS[p]]
            cols = [_ALL_TERMS.index(t) for _, t in pairs]
            A = terms[have][:, cols]
            y = np.array([r[measured] for r, h in zip(rows, have) if h], dtype=np.float64)
            if len(y) < len(cols):
                raise ValueError(
                    f"CostModel.fit: {measured} has {len(y)} records, fewer than the"
                    f" {len(cols)} terms it fits"
                )
            prior = np.array([self.coefficients[p][t] for p, t in pairs])
            coef, live = _fit_terms(A, y, prior, [t for _, t in pairs])
            for (phase, term), value in zip(pairs, coef):
                new[phase][term] = float(value)
            fitted.append(measured)
            determined[measured] = tuple(t for (_, t), ok in zip(pairs, live) if ok)
            kept[measured] = tuple(t for (_, t), ok in zip(pairs, live) if not ok)
        if not fitted:
            raise ValueError(
                "CostModel.fit: no record has a measured time"
                f" ({', '.join(_MEASURED)}); is the StragglerMonitor timing the vision and"
                " LLM modules?"
            )
        self.coefficients = new  # all fields fitted: only now replace the model
        report = self.evaluate(rows, fitted=tuple(fitted))
        return replace(report, determined=determined, kept=kept, skipped=len(records) - len(rows))

    def evaluate(
        self, records: Iterable[Mapping[str, Any]], fitted: tuple[str, ...] = tuple(_MEASURED)
    ) -> FitReport:
        """Errors of this model's predictions on measured micro-batch records."""
        rows = [r for r in records if all(r.get(f) is not None for f in FEATURES)]
        pred = self.predict({f: [r[f] for r in rows] for f in FEATURES})
        mape: dict[str, float] = {}
        r2: dict[str, float] = {}
        timed: dict[str, int] = {}
        complete = np.ones(len(rows), dtype=bool)
        total_y = np.zeros(len(rows))
        total_p = np.zeros(len(rows))
        for measured, phases in _MEASURED.items():
            if measured not in fitted:
                continue
            have = np.array([r.get(measured) is not None for r in rows], dtype=bool)
            timed[measured] = int(have.sum())
            complete &= have
            y = np.array([r[measured] if h else 0.0 for r, h in zip(rows, have)])
            p = np.sum([pred[ph] for ph in phases], axis=0)
            mape[measured], r2[measured] = _errors(y[have], p[have])
            total_y += y
            total_p += p
        if complete.any():
            mape["total_ms"], r2["total_ms"] = _errors(total_y[complete], total_p[complete])
        return FitReport(samples=len(rows), mape=mape, r2=r2, fitted=fitted, timed=timed)

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The model as JSON-ready data (a copy: changing it leaves the model as it is)."""
        coefficients = {phase: dict(terms) for phase, terms in self.coefficients.items()}
        return {"version": _FORMAT_VERSION, "unit": "ms", "coefficients": coefficients}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """The model of :meth:`to_dict`'s output.

        Raises:
            ValueError: for data that is not an object of this format and version, without a
                ``"coefficients"`` object of objects, or with a bad phase, term or value.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"CostModel.from_dict: expected a JSON object, got {type(data).__name__}"
            )
        if data.get("version") != _FORMAT_VERSION or data.get("unit") != "ms":
            raise ValueError(
                f"CostModel.from_dict: expected version {_FORMAT_VERSION} in ms, got"
                f" version={data.get('version')!r} unit={data.get('unit')!r}"
            )
        coefficients = data.get("coefficients")
        if not isinstance(coefficients, Mapping):
            raise ValueError(
                'CostModel.from_dict: expected "coefficients": {phase: {term: ms per unit}},'
                f" got {coefficients!r}"[:200]
            )
        return cls(
            coefficients={
                p: dict(t) if isinstance(t, Mapping) else t for p, t in coefficients.items()
            }
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """The model saved at ``path`` (errors name the file)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"CostModel.load: {path} is not JSON: {err}") from err
        except UnicodeDecodeError as err:
            raise ValueError(f"CostModel.load: {path} is not UTF-8 text (JSON): {err}") from err
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"CostModel.load: {path}: {err}") from err


_ALL_TERMS: tuple[str, ...] = (*_VISION_TERMS, *_LLM_TERMS)
_PER_PACK_TERMS = ("pack", "image_pack")  # paid once per pack, not per sample


def _term_matrix(features: Mapping[str, Any]) -> np.ndarray:
    """``(N, terms)`` float64 design matrix in ``_ALL_TERMS`` order."""
    missing = [f for f in FEATURES if f not in features]
    if missing:
        raise ValueError(f"CostModel: features {missing} are missing (need {FEATURES})")
    cols = {f: np.asarray(features[f], dtype=np.float64).reshape(-1) for f in FEATURES}
    n = len(cols["total_tokens"])
    for f, col in cols.items():
        if len(col) != n:
            raise ValueError(f"CostModel: feature {f!r} has {len(col)} values, expected {n}")
        if not np.isfinite(col).all() or (col < 0).any():
            bad = int(np.flatnonzero(~np.isfinite(col) | (col < 0))[0])
            raise ValueError(f"CostModel: pack {bad} has {f} = {col[bad]!r} (must be >= 0)")
    cols["image_pack"] = (cols["images"] > 0).astype(np.float64)
    cols["pack"] = np.ones(n)
    return np.stack([cols[t] for t in _ALL_TERMS], axis=1)


def _errors(y: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    pos = y > 0
    mape = float(np.mean(np.abs(p[pos] - y[pos]) / y[pos])) if pos.any() else float("nan")
    ss_res = float(np.sum((y - p) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return mape, (1.0 - ss_res / ss_tot) if ss_tot > 0 else float("nan")


def _row_scale(t: np.ndarray) -> np.ndarray:
    """What each record's error is relative to: its measured time (a record measuring 0 ms:
    the median time)."""
    return np.where(t > 0, t, np.median(t[t > 0]) if (t > 0).any() else 1.0)


def _relative_sse(A: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    """The sum of squared relative errors of ``A @ coef`` against ``y`` (``_scaled_nnls``'s)."""
    r = (A @ coef - y) / _row_scale(y)
    return float(r @ r)


def _scaled_nnls(A: np.ndarray, y: np.ndarray, weight_of: np.ndarray | None = None) -> np.ndarray:
    """NNLS of *relative* errors on unit-norm columns.

    Timing noise is roughly proportional to the time, so each row is divided by its measured
    value ``weight_of`` (default ``y``; a row measuring 0 ms by the median instead); the columns
    span ~10 orders of magnitude and are scaled to unit norm. All-zero columns get a zero
    coefficient.
    """
    weight = 1.0 / _row_scale(y if weight_of is None else weight_of)
    A = A * weight[:, None]
    y = y * weight
    norms = np.linalg.norm(A, axis=0)
    live = norms > 0
    coef = np.zeros(A.shape[1])
    if live.any():
        coef[live] = nnls(A[:, live] / norms[live], y) / norms[live]
    return coef


def _featured_records(
    records: Iterable[Mapping[str, Any]] | str | Path,
) -> tuple[list[Any], list[Mapping[str, Any]], list[str]]:
    """The records :meth:`CostModel.fit` reads (from a StragglerMonitor file or folder when
    given a path), those of them that have every pack feature, and where each of those comes
    from (its index in ``records``, or its file, line and place in ``"micro"``), for errors.

    Raises:
        ValueError: as :meth:`CostModel.fit`, for a record that is not a mapping, a feature
            that is not a finite number >= 0, or no record with the pack features.
    """
    if isinstance(records, str | Path):
        records, sources = _read_monitor_records(records)
    else:
        records = list(records)
        sources = [f"record {i}" for i in range(len(records))]
    rows, where = [], []
    for rec, src in zip(records, sources):
        if not isinstance(rec, Mapping):
            raise ValueError(
                f"CostModel.fit: {src} is not a micro-batch record (a mapping of pack"
                f" features and times), got {type(rec).__name__}"
            )
        if all(rec.get(f) is not None for f in FEATURES):
            for f in FEATURES:
                _check_number(rec[f], f, src)
            rows.append(rec)
            where.append(src)
    if not rows:
        raise ValueError(
            "CostModel.fit: no micro-batch record has the pack features"
            f" {FEATURES}; log packed batches (PackCollator) with the StragglerMonitor"
        )
    return records, rows, where


def _fit_terms(
    A: np.ndarray, y: np.ndarray, prior: np.ndarray, names: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """One measured field's coefficients, as :meth:`CostModel.fit` describes: the terms the
    records determine fitted to ``y`` minus the kept terms' share at their ``prior``, and a
    kept term that the records contradict set to 0. Returns the coefficients and which terms
    count as determined."""
    live = _determined_columns(A, y, names)
    coef = prior.copy()
    # the kept terms' share at their prior; the determined terms fit the rest
    rest = y - A[:, ~live] @ prior[~live]
    coef[live] = _scaled_nnls(A[:, live], rest, weight_of=y)
    # a kept term in the span of the others whose prior the records contradict (the
    # determined terms cannot take its share back: they cannot go negative, as when a
    # frozen vision tower has no backward) is set to 0 where that fits clearly better
    contradicted = ~live & (np.abs(A).sum(axis=0) > 0) & (prior > 0)
    if contradicted.any():
        zero = np.where(contradicted, 0.0, prior)
        other = zero.copy()
        other[live] = _scaled_nnls(A[:, live], y - A[:, ~live] @ zero[~live], weight_of=y)
        if _relative_sse(A, y, other) < 0.99 * _relative_sse(A, y, coef):
            coef, live = other, live | contradicted
    return coef, live


# A weighted, unit-norm column closer than this to the span of the columns chosen before it is
# taken as a combination of them: the records cannot tell its coefficient from theirs.
_DETERMINED_TOL = 1e-6
# The order in which terms are taken when some are combinations of others: fixed costs first,
# then the per-token terms (the main cost), per-image counts, then the quadratic terms.
_FIT_ORDER = (
    "pack",
    "image_pack",
    "total_tokens",
    "image_tokens",
    "images",
    "doc_sq_tokens",
    "image_sq_tokens",
)


def _determined_columns(A: np.ndarray, y: np.ndarray, names: list[str]) -> np.ndarray:
    """Which columns of ``A`` the records determine: a greedy pivoted Gram-Schmidt in
    ``_FIT_ORDER`` on the columns as :func:`_scaled_nnls` weights and scales them; a column
    (nearly) in the span of those taken before it is not determined."""
    W = A / _row_scale(y)[:, None]
    norms = np.linalg.norm(W, axis=0)
    live = np.zeros(A.shape[1], dtype=bool)
    basis: list[np.ndarray] = []
    for j in sorted(range(A.shape[1]), key=lambda j: _FIT_ORDER.index(names[j])):
        if norms[j] == 0:
            continue
        v = W[:, j] / norms[j]
        for b in basis:  # twice, for numerical stability
            v = v - (b @ v) * b
        for b in basis:
            v = v - (b @ v) * b
        residual = float(np.linalg.norm(v))
        if residual > _DETERMINED_TOL:
            basis.append(v / residual)
            live[j] = True
    return live


def _check_number(value: Any, name: str, where: str, what: str = "feature") -> None:
    """A finite number >= 0, or a ValueError naming the record."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(float(value)) and float(value) >= 0):
        must = "a finite time >= 0" if what == "time" else "a finite number >= 0"
        raise ValueError(f"CostModel.fit: {where} has {name} = {value!r} (must be {must})")


def nnls(A: np.ndarray, y: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares ``argmin_{x >= 0} |A x - y|`` (Lawson and Hanson, 1974, ch. 23).

    The active-set method: grow the set of positive coefficients by the most negative gradient
    component, solve unconstrained least squares on it, and step back to the boundary whenever
    a coefficient would turn negative.
    """
    A = np.asarray(A, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.linalg.norm(A, 1) * max(A.shape)
    for _ in range(max_iter or 3 * n):
        w = A.T @ (y - A @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def read_monitor_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The micro-batch records of StragglerMonitor JSON-lines files (a file or a folder).

    Raises:
        ValueError: for a line that is not a JSON object or whose ``"micro"`` is not a list of
            objects (naming the file and line), or when no file is found.
    """
    return _read_monitor_records(path)[0]


def _read_monitor_records(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`read_monitor_jsonl`, and where each record was: ``"FILE:LINE micro[J]"``."""
    path = Path(path)
    files = sorted(path.glob("rank_*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"read_monitor_jsonl: no StragglerMonitor JSON-lines file at {path}")
    records: list[dict[str, Any]] = []
    sources: list[str] = []
    for f in files:
        with open(f) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{f}:{lineno}: not JSON ({err})") from err
                if not isinstance(step, dict):
                    raise ValueError(f"{f}:{lineno}: expected a JSON object")
                micro = step.get("micro", [])
                if not isinstance(micro, list) or not all(isinstance(m, dict) for m in micro):
                    raise ValueError(
                        f'{f}:{lineno}: "micro" must be a list of micro-batch objects, got'
                        f" {json.dumps(micro)[:80]}"
                    )
                records.extend(micro)
                sources.extend(f"{f}:{lineno} micro[{j}]" for j in range(len(micro)))
    return records, sources


_META_KEYS = ("total_tokens", "image_tokens", "images", "doc_lens", "image_sizes")


def features_from_meta(meta: Mapping[str, Any]) -> dict[str, int]:
    """The cost features (:data:`FEATURES`, python ints: no device sync) of one packed batch
    from its ``meta`` (as :class:`~lightning_vlmbalance.PackCollator` builds it).

    Raises:
        ValueError: naming the first missing ``meta`` key.
    """
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ValueError(
            f"the cost features need batch['meta'][{missing[0]!r}] (missing: {missing}); build"
            " batches with PackCollator"
        )
    return {
        "total_tokens": int(meta["total_tokens"]),
        "image_tokens": int(meta["image_tokens"]),
        "images": int(meta["images"]),
        "image_sq_tokens": sum(int(n) * int(n) for n in meta["image_sizes"]),
        "doc_sq_tokens": sum(int(n) * int(n) for n in meta["doc_lens"]),
    }


def features_from_packs(
    packs: Any, total_tokens: np.ndarray, image_tokens: np.ndarray, images: np.ndarray
) -> dict[str, np.ndarray]:
    """Pack features from a per-sample length table and a :class:`~..packing.Packs`: the sums
    of its samples' :func:`sample_features`."""
    per_sample = sample_features(total_tokens, image_tokens, images)
    return {name: packs.tokens(column) for name, column in per_sample.items()}


def sample_features(
    total_tokens: np.ndarray, image_tokens: np.ndarray, images: np.ndarray
) -> dict[str, np.ndarray]:
    """Each sample's cost features (:data:`FEATURES`, ``int64``) as if it were a pack of its own.

    A sample is one document; its image tokens are taken as split evenly over its images (the
    length table has no per-image sizes), the squared size rounded down: the one rounding rule
    of every user of a length table (pack features, the source former's per-sample costs).
    """
    total = np.asarray(total_tokens, dtype=np.int64)
    image = np.asarray(image_tokens, dtype=np.int64)
    count = np.asarray(images, dtype=np.int64)
    return {
        "total_tokens": total,
        "image_tokens": image,
        "images": count,
        "image_sq_tokens": np.where(count > 0, image * image // np.maximum(count, 1), 0),
        "doc_sq_tokens": total * total,
    }
