"""packed_attention equals attention computed document by document (forward and gradients)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_vlmbalance import packed_attention


def _reference(q, k, v, lens, causal):
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        sl = slice(start, start + n)
        qd, kd, vd = (x[sl].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(outs)


CASES = [
    [7, 3, 12],  # padded-documents layout
    [40, 1, 1, 2],  # one long document: block-diagonal layout
    [1],
    [5, 5, 5, 5],
]


@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_matches_per_document_attention_float64(lens, causal, kv_heads) -> None:
    torch.manual_seed(0)
    T, H, Dh = sum(lens), 4, 8
    q = torch.randn(T, H, Dh, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, kv_heads, Dh, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, kv_heads, Dh, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, max(lens), causal=causal)
    ref = _reference(q, k, v, lens, causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    g_out = torch.autograd.grad(out, (q, k, v), grad)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_empty_sequence_keeps_parameters_in_the_graph() -> None:
    """A pack without images runs the vision tower on zero tokens; q, k and v all get gradients."""
    w = torch.randn(4, 3 * 8, requires_grad=True)
    x = torch.zeros(0, 4)
    q, k, v = (x @ w).view(0, 3, 2, 4).unbind(1)
    out = packed_attention(q, k, v, torch.zeros(1, dtype=torch.int32), 0, causal=False)
    assert out.shape == (0, 2, 4)
    out.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


def test_shape_errors_are_clear() -> None:
    q = torch.randn(5, 4, 8)
    with pytest.raises(ValueError, match="Hkv must divide H"):
        packed_attention(
            q,
            torch.randn(5, 3, 8),
            torch.randn(5, 3, 8),
            torch.tensor([0, 5], dtype=torch.int32),
            5,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_reference(dtype) -> None:
    """On CUDA (flash-attn varlen when installed) the result matches the float32 reference."""
    torch.manual_seed(0)
    lens = [300, 17, 1000, 5]
    T, H, Dh = sum(lens), 8, 64
    q, k, v = (torch.randn(T, H, Dh, device="cuda", dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    out = packed_attention(q, k, v, cu, max(lens))
    ref = _reference(q.float(), k.float(), v.float(), lens, True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_torch_varlen_matches_the_sdpa_fallback(dtype, kv_heads, causal) -> None:
    """PyTorch's own varlen kernel (the GPU path without flash-attn): forward and gradients
    against the SDPA fallback on the same inputs, both against a float32 per-document reference;
    8,192 tokens in documents of very different lengths."""
    from lightning_vlmbalance.attention import _varlen_attn

    if _varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lens = [4000, 17, 1, 2500, 600, 1074]
    T, H, Dh = sum(lens), 8, 64
    assert T == 8192
    base = [torch.randn(T, h, Dh, device="cuda") for h in (H, kv_heads, kv_heads)]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    grad_out = torch.randn(T, H, Dh, device="cuda")

    def run(backend: str | None, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        q, k, v = (x.detach().to(dt).clone().requires_grad_() for x in base)
        if backend is None:
            out = _reference(q, k, v, lens, causal)
        else:
            out = packed_attention(q, k, v, cu, max(lens), causal=causal, backend=backend)
        out.backward(grad_out.to(dt))
        return tuple(t.float() for t in (out, q.grad, k.grad, v.grad))

    ref = run(None, torch.float32)
    varlen, sdpa = run("varlen", dtype), run("sdpa", dtype)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), varlen, sdpa, ref):
        scale = r.abs().max().item()
        err_varlen = (a - r).abs().max().item() / scale
        err_sdpa = (b - r).abs().max().item() / scale
        # the varlen kernel is as close to the reference as the fallback, within rounding
        assert err_varlen <= max(2 * err_sdpa, 2e-2), (name, err_varlen, err_sdpa)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_backend_is_a_varlen_kernel_in_half_precision() -> None:
    from lightning_vlmbalance.attention import _varlen_attn, attention_backend, flash_attn_available

    q = torch.zeros(4, 2, 8, device="cuda", dtype=torch.bfloat16)
    expected = "flash_attn" if flash_attn_available() else "varlen" if _varlen_attn else "sdpa"
    assert attention_backend(q) == expected
    assert attention_backend(q.float()) == "sdpa"


def test_backend_is_checked() -> None:
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="`backend='varlen'` needs CUDA fp16/bf16"):
        packed_attention(q, q, q, cu, 6, backend="varlen")
    with pytest.raises(ValueError, match="not one of"):
        packed_attention(q, q, q, cu, 6, backend="triton")
    torch.testing.assert_close(
        packed_attention(q, q, q, cu, 6, backend="sdpa"), packed_attention(q, q, q, cu, 6)
    )


def test_metadata_that_does_not_describe_the_batch_is_an_error() -> None:
    q = torch.randn(12, 2, 4)
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="longest document has 5 tokens, `max_seqlen=4`"):
        packed_attention(q, q, q, cu, 4)
    with pytest.raises(ValueError, match="cu_seqlens end at 10 for 12 tokens"):
        packed_attention(q, q, q, torch.tensor([0, 5, 10], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="same shape"):
        packed_attention(q, q, q[:, :1], cu, 5)


def _masked_reference(q, k, v, lens, window, blocks):
    """Each document alone with transformers' rule as a dense mask: key j is seen by query i
    when ``j > i - window`` and (``j <= i`` or both in the same positive block)."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        sl = slice(start, start + n)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        b = blocks[sl]
        ok = (j <= i) | ((b[:, None] == b[None, :]) & (b[:, None] > 0))
        if window is not None:
            ok &= j > i - window
        qd, kd, vd = (x[sl].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ok).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[7, 3, 12], [40, 1, 1, 2]], ids=["padded", "diagonal"])
@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("with_blocks", [False, True], ids=["causal", "image_blocks"])
def test_window_and_image_blocks_match_the_dense_rule(lens, window, with_blocks) -> None:
    torch.manual_seed(1)
    T, H, Dh = sum(lens), 4, 8
    q, k, v = (torch.randn(T, h, Dh, dtype=torch.float64, requires_grad=True) for h in (H, 2, 2))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    blocks = torch.zeros(T, dtype=torch.long)
    if with_blocks:  # an image of 3 tokens in the first document, one of 5 in the last
        blocks[2:5] = 1
        blocks[T - 7 : T - 2] = 2
    out = packed_attention(
        q, k, v, cu, max(lens), window=window, blocks=blocks if with_blocks else None
    )
    ref = _masked_reference(q, k, v, lens, window, blocks)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_window_and_blocks_are_checked() -> None:
    q = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="window=0"):
        packed_attention(q, q, q, cu, 5, window=0)
    with pytest.raises(ValueError, match="blocks"):
        packed_attention(q, q, q, cu, 5, blocks=torch.zeros(4, dtype=torch.long))
