"""``check_packing``: does a packed row train each of its documents as if it were alone?

Run it on your own checkpoint and a few of your own processed samples before training with
packs. It packs the items into one row (with a padding tail, as the loader does), runs the
model's forward and backward once on the pack and once on every document alone (the model's
own attention, the processor's own fields: the ground truth), and reports, per document, the
largest difference of its logits and of the gradient of its summed token loss with respect to
every trainable parameter. A document that sees another one (attention, positions, a recurrent
state, an image embedding in the wrong place) shows up as a difference far above rounding.

Float64 on the CPU by default: rounding then sits near ``1e-15``, so the verdict's tolerance
(``1e-10`` relative to the largest value compared) separates exact from leaking without doubt.
The model is copied for the check (``dtype=None`` checks the model itself in its own dtype, with
the tolerance ``1e-5`` for float32). Command line::

    python -m lightning_vlmbalance.hf.check MODEL_DIR ITEMS.pt      # a local checkpoint
    python -m lightning_vlmbalance.hf.check --tiny qwen2_5_vl       # a tiny random model

``ITEMS.pt``: ``torch.save([processor(...) for one sample, ...], "ITEMS.pt")``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_vlmbalance.hf.families import Family, family_of
from lightning_vlmbalance.hf.inputs import (
    _VARLEN,
    ATTN_IMPLEMENTATION,
    HFPackCollator,
    hf_model,
    model_inputs,
    prepare_model,
)
from lightning_vlmbalance.packing.collate import IGNORE_INDEX

__all__ = ["DocumentCheck", "PackingReport", "check_packing"]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# families that compute parts in float32 whatever the model's dtype: their RMSNorm (``x.float()``,
# ``weight.float()``: the norm weights' gradients, sums over a row's tokens, round at float32's
# precision; measured on Gemma 3 and Qwen3.5: 1.2e-7 relative, 1e-16 with the norm in float64)
# and Gemma 4's vision pooler and softmax (float32: images padded to a pack's larger patch count
# encode 6-8e-8 apart). In float64 they are held to float32's yardstick.
FLOAT32_NORMS = ("gemma3", "gemma4", "qwen3_5")
FLOAT32_NORM_TOLERANCE = 1e-6
_PAD = 7  # padding tokens after the documents: the loader's packs end with a padding segment


@dataclass(frozen=True)
class DocumentCheck:
    """One document of the packed row against itself alone. ``*_diff``: the largest absolute
    difference; ``*_scale``: the largest absolute value alone (the diff's yardstick)."""

    index: int
    tokens: int
    images: int
    logit_diff: float
    logit_scale: float
    grad_diff: float | None
    grad_scale: float | None
    ok: bool


@dataclass(frozen=True)
class PackingReport:
    """What :func:`check_packing` found; ``ok`` when every document is within the tolerance."""

    family: str
    dtype: str
    tolerance: float
    documents: tuple[DocumentCheck, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.documents)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["documents"] = [asdict(d) for d in self.documents]
        out["ok"] = self.ok
        return out

    def __str__(self) -> str:
        lines = [
            f"packing check of {self.family} ({self.dtype}, tolerance {self.tolerance:g}"
            " x the largest value, at least 1)",
            *([self.note] if self.note else []),
            "doc  tokens  images  logit diff  (of)      grad diff   (of)      verdict",
        ]
        for d in self.documents:
            grad = "-" if d.grad_diff is None else f"{d.grad_diff:.2e}  ({d.grad_scale:.1e})"
            lines.append(
                f"{d.index:>3}  {d.tokens:>6}  {d.images:>6}  {d.logit_diff:.2e}  "
                f"({d.logit_scale:.1e})  {grad:<20}  {'ok' if d.ok else 'DIFFERS'}"
            )
        verdict = (
            "every document trains as if alone: packing is exact for this model"
            if self.ok
            else "some documents differ when packed: do not train this model with packs"
            " (please report it with this table)"
        )
        lines.append(verdict)
        return "\n".join(lines)


def check_packing(
    model: torch.nn.Module,
    items: Sequence[Mapping[str, Any]],
    *,
    dtype: torch.dtype | None = torch.float64,
    gradients: bool = True,
    tolerance: float | None = None,
) -> PackingReport:
    """Packs ``items`` (processor outputs, one sample each) into one row and compares every
    document's logits and loss gradients with the document run alone (see the module docstring).

    Args:
        model: a transformers VLM of a supported family (or a PEFT / compiled / Lightning wrapper
            of one).
        items: at least one processor output; mix text-only and image samples.
        dtype: copy the model to this dtype for the check (default float64); ``None`` checks the
            model itself, as it is (its attention is switched for packs as
            :func:`~lightning_vlmbalance.hf.prepare_model` does).
        gradients: also compare each document's parameter gradients (a backward per document).
        tolerance: the largest difference allowed relative to the largest value compared (at
            least 1); defaults to ``1e-10`` in float64 (``1e-6`` for the families that compute
            parts in float32, :data:`FLOAT32_NORMS`), ``1e-5`` in float32, ``1e-2`` in float16
            and ``5e-2`` in bfloat16 (a coarse check: sums of a document's gradients round at
            bfloat16's 8 bits; the verdict to trust is float64's).

    Raises:
        ValueError: for an unsupported family (by name), no items, or an item the collator
            refuses (naming it).
    """
    if not items:
        raise ValueError("check_packing: give at least one processed item")
    base = hf_model(model)
    family = family_of(base)
    work = base if dtype is None else copy.deepcopy(base).to(dtype)
    dtype = next(work.parameters()).dtype
    if work is not base and dtype == torch.float64 and _grouped_experts(work):
        # torch's grouped_mm has no float64 kernel; the per-expert loop computes the same thing
        work.set_experts_implementation("eager")
    tol = TOLERANCE.get(dtype, 1e-2) if tolerance is None else float(tolerance)
    note = ""
    if family.name in FLOAT32_NORMS and tol < FLOAT32_NORM_TOLERANCE and tolerance is None:
        tol = FLOAT32_NORM_TOLERANCE
        note = (
            f"{family.name} computes parts in float32 whatever the model's dtype (its RMSNorm"
            f"{', its vision pooler' if family.name == 'gemma4' else ''}): held to float32's"
            f" yardstick, {tol:g}; a leak differs by far more"
        )
    items = [_cast(it, dtype) for it in items]
    was_training = work.training
    work.eval()  # no dropout: the two runs must compute the same function
    text_cfg = work.config.get_text_config()
    reference = text_cfg._attn_implementation
    if reference in _VARLEN:  # packed kernels; the reference is the plain one
        reference = "sdpa"
    collate = HFPackCollator(work.config, seq_len=sum(_length(it) for it in items) + _PAD)
    batch = collate(items)
    cu = batch["cu_seqlens"].tolist()
    params = [p for p in work.parameters() if p.requires_grad] if gradients else []
    try:
        prepare_model(work)
        with torch.set_grad_enabled(gradients):
            packed = work(**model_inputs(work, batch, labels=False)).logits[0]
        work.set_attn_implementation({"text_config": reference})
        docs = []
        for i, item in enumerate(items):
            labels = batch["labels"][0, cu[i] : cu[i + 1]]
            got = packed[cu[i] : cu[i + 1]]
            with torch.set_grad_enabled(gradients):
                alone = work(**_alone_inputs(item, family)).logits[0]
            logit_diff = float((got - alone).detach().abs().max())
            logit_scale = float(alone.detach().abs().max())
            grad_diff = grad_scale = None
            if params:
                g_packed = _grads(_doc_loss(got, labels), params, retain=True)
                g_alone = _grads(_doc_loss(alone, labels), params, retain=False)
                grad_diff = max(float((a - b).abs().max()) for a, b in zip(g_packed, g_alone))
                grad_scale = max(float(b.abs().max()) for b in g_alone)
            ok = logit_diff <= tol * max(1.0, logit_scale) and (
                grad_diff is None or grad_diff <= tol * max(1.0, grad_scale or 0.0)
            )
            docs.append(
                DocumentCheck(
                    index=i,
                    tokens=cu[i + 1] - cu[i],
                    images=len(family.to_sample(item, i, positions=False).get("image_sizes", [])),
                    logit_diff=logit_diff,
                    logit_scale=logit_scale,
                    grad_diff=grad_diff,
                    grad_scale=grad_scale,
                    ok=ok,
                )
            )
    finally:
        if work is base:  # the caller's model: back to packed attention and its mode
            work.set_attn_implementation({"text_config": ATTN_IMPLEMENTATION})
            work.train(was_training)
    return PackingReport(
        family.name,
        str(dtype).removeprefix("torch."),
        tol,
        tuple(docs),
        note=note,
    )


def _grouped_experts(model: torch.nn.Module) -> bool:
    impl = getattr(model.config, "_experts_implementation", None)
    impls = impl.values() if isinstance(impl, dict) else [impl]
    return any(i not in (None, "eager") for i in impls)


def _length(item: Mapping[str, Any]) -> int:
    return int(torch.as_tensor(item["input_ids"]).shape[-1])


def _cast(item: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The item with its floating tensors (pixels) in ``dtype``."""
    out = {}
    for k, v in item.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v
    return out


def _alone_inputs(item: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """The processor output as the model's own keyword arguments: one row, no labels. A Gemma
    item without its processor's marking of the image tokens gets it (the pack attends within
    each image as the processor marks it; the model alone would not, without the field)."""
    out = {k: v for k, v in item.items() if k != "labels" and v is not None}
    ids = torch.as_tensor(out["input_ids"])
    out["input_ids"] = ids if ids.dim() == 2 else ids[None]
    if family.image_blocks and family._token_types not in out:
        out[family._token_types] = (out["input_ids"] == family.image_token_id).long()
    for k in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
        if k in out:
            t = torch.as_tensor(out[k])
            out[k] = t if t.dim() == 2 else t[None]
    out["use_cache"] = False
    return out


def _doc_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The document's summed next-token loss (the collator's labels; the model shifts)."""
    return F.cross_entropy(
        logits[:-1].float() if logits.dtype == torch.float16 else logits[:-1],
        labels[1:].to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _grads(loss: torch.Tensor, params: list[torch.Tensor], *, retain: bool) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_vlmbalance.hf.check",
        description="Does a packed row train each document as if alone? (logits and gradients)",
    )
    p.add_argument("model", nargs="?", help="a local checkpoint directory (from_pretrained)")
    p.add_argument("items", nargs="?", help="torch.save'd list of processor outputs")
    p.add_argument("--tiny", metavar="FAMILY", help="a tiny random model of FAMILY instead")
    p.add_argument("--n", type=int, default=4, help="synthetic items with --tiny (default 4)")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32", "bfloat16"))
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--no-gradients", action="store_true", help="logits only")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import transformers as tf

    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from lightning_vlmbalance.hf.synthetic import SyntheticProcessed, tiny_config

        torch.manual_seed(0)
        model = tf.AutoModelForImageTextToText.from_config(tiny_config(args.tiny))
        data = SyntheticProcessed(model.config, max(args.n, 1), seed=1)
        items = [data[i] for i in range(len(data))]
    elif args.model and args.items:
        model = tf.AutoModelForImageTextToText.from_pretrained(args.model)
        items = torch.load(args.items, weights_only=False)
    else:
        build_parser().error("give MODEL_DIR and ITEMS.pt, or --tiny FAMILY")
    report = check_packing(
        model, items, dtype=dtype, gradients=not args.no_gradients, tolerance=args.tolerance
    )
    print(json.dumps(report.to_dict()) if args.json else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
