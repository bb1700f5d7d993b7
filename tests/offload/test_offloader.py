"""ActivationOffloader in test mode: the full hook machinery on the CPU, gradients bitwise equal."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_vlmbalance as vb
from examples.vlm import ToyVLM
from lightning_vlmbalance.offload import ActivationOffloader, offload_activations
from lightning_vlmbalance.synthetic import SyntheticVLMDataset, synthetic_length_table


def _packed_batches(n: int, seq_len: int = 128, dtype=torch.float32) -> list[dict]:
    table = synthetic_length_table(64, tile_tokens=8, max_text_tokens=64, seed=1)
    ds = SyntheticVLMDataset(table, vocab_size=64, patch_dim=8)
    sampler = vb.PackingSampler(table.total_tokens, table.image_tokens, seq_len=seq_len, seed=0)
    loader = vb.PackedDataLoader(ds, sampler, vb.PackCollator(seq_len, image_feature_shape=(8,)))
    out = []
    for batch in loader:
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        batch["global_loss_tokens"] = batch["loss_tokens"]
        out.append(batch)
        if len(out) == n:
            break
    return out


def _grads(model: nn.Module, loss_fn, offloader: ActivationOffloader | None) -> list:
    model.zero_grad(set_to_none=True)
    if offloader is None:
        loss = loss_fn()
    else:
        with offloader:
            loss = loss_fn()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_bitwise(a: list, b: list) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_example_vlm_gradients_are_bitwise_equal(dtype, grad_checkpoint) -> None:
    torch.manual_seed(0)
    model = ToyVLM(
        vocab_size=64, patch_dim=8, dim=32, heads=2, moe_experts=4, grad_checkpoint=grad_checkpoint
    ).to(dtype)
    batch = _packed_batches(1, dtype=dtype)[0]
    off = ActivationOffloader(test_mode=True, min_bytes=0, exclude=model.parameters())
    ref = _grads(model, lambda: model.loss(batch), None)
    got = _grads(model, lambda: model.loss(batch), off)
    _assert_bitwise(ref, got)
    assert off.stats()["offloaded_tensors"] > (5 if grad_checkpoint else 50)
    assert off.stats()["reloaded_tensors"] > 0 and off.stats()["prefetched_tensors"] > 0


def test_checkpoint_mode_offloads_one_tensor_per_block() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)
    )
    x = torch.randn(8, 16, requires_grad=True)
    off = ActivationOffloader(mode="checkpoint", test_mode=True, min_bytes=0)

    def loss() -> torch.Tensor:
        h = x * 1.0
        for block in blocks:
            off.mark(h)  # the callback does this with a forward pre-hook
            h = checkpoint(block, h, use_reentrant=False)
        return h.square().sum()

    ref = _grads(blocks, loss, None)
    got = _grads(blocks, loss, off)
    _assert_bitwise(ref, got)
    assert off.stats()["offloaded_tensors"] == 4


def test_tricky_saved_tensors() -> None:
    """Views sharing storage, transposes, non-contiguous slices, a tensor saved twice."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 24).double()
    x = torch.randn(12, 24, dtype=torch.float64, requires_grad=True)

    def loss() -> torch.Tensor:
        h = lin(x)
        t = h.t()  # a transpose: dense, other strides
        s = h[:, ::3]  # a strided slice: not dense
        v = h.view(6, 48)  # a view of the same storage
        y = (t @ h).sin()  # h saved (by mm) next to its transpose
        z = s.exp() * s  # s saved twice
        w = v.tanh() * v.cos()
        return y.sum() + z.sum() + w.sum()

    off = ActivationOffloader(test_mode=True, min_bytes=0, exclude=lin.parameters())
    ref = [*_grads(lin, loss, None), x.grad.clone()]
    x.grad = None
    got = [*_grads(lin, loss, off), x.grad.clone()]
    _assert_bitwise(ref, got)
    stats = off.stats()
    assert stats["live_handles"] == 0 and stats["pool_in_use_bytes"] == 0


def test_tensor_saved_twice_is_offloaded_once() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    off = ActivationOffloader(test_mode=True, min_bytes=0)
    with off:
        h = x * 2
        y = h.sin() + h.cos()  # h saved by sin and by cos
    y.sum().backward()
    assert off.stats()["offloaded_tensors"] == 1
    assert torch.equal(x.grad, 2 * (torch.cos(2 * x.detach()) - torch.sin(2 * x.detach())))


def test_in_place_change_after_save_is_an_error_as_without_offload() -> None:
    """Hooks bypass autograd's version check; the offloader keeps it while the tensor lives."""
    x = torch.randn(100, requires_grad=True)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        y = (x * 2).exp()  # exp saves its result
        y.add_(1)
        return y, y.sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward()[1].backward()
    off = ActivationOffloader(test_mode=True, min_bytes=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with off:
            _alive, out = forward()  # y stays referenced
        out.backward()


def test_legal_in_place_ops_after_a_save() -> None:
    """In-place ops on tensors that were saved at an earlier version, or not saved, are fine."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).double()
    x = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)

    def loss() -> torch.Tensor:
        h = lin(x)  # saves x
        h.relu_()  # saves its result (the new version)
        g = h * 3.0  # saves nothing of h
        g.add_(1.0)
        k = g.sigmoid()  # saves its result
        return (k * h).sum()

    off = ActivationOffloader(test_mode=True, min_bytes=0, exclude=lin.parameters())
    ref = [*_grads(lin, loss, None), x.grad.clone()]
    x.grad = None
    got = [*_grads(lin, loss, off), x.grad.clone()]
    _assert_bitwise(ref, got)
    assert off.stats()["offloaded_tensors"] == 2  # h (after relu_) and k; x is a leaf


def test_compiled_submodule() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model[0] = torch.compile(model[0])
    x = torch.randn(16, 32)
    off = ActivationOffloader(test_mode=True, min_bytes=0, exclude=model.parameters())
    ref = _grads(model, lambda: model(x).square().sum(), None)
    got = _grads(model, lambda: model(x).square().sum(), off)
    _assert_bitwise(ref, got)
    assert off.stats()["offloaded_tensors"] >= 2


def test_parameters_and_small_tensors_stay_and_no_grad_saves_nothing() -> None:
    lin = nn.Linear(64, 64)
    x = torch.randn(4, 64)
    off = ActivationOffloader(test_mode=True, min_bytes=4 * 64 * 4 + 1, exclude=lin.parameters())
    with off, torch.no_grad():
        lin(x)
    assert off.stats()["offloaded_tensors"] == 0
    with off:
        y = torch.relu(lin(x)).sum()  # x: 1 KiB (< min_bytes), the weight: a parameter
    y.backward()
    assert off.stats()["offloaded_tensors"] == 0


def test_no_growth_over_1000_iterations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
    off = ActivationOffloader(test_mode=True, min_bytes=0, exclude=model.parameters())
    x = torch.randn(16, 32)
    seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add contention
    for i in range(1000):
        with offload_activations(off):
            loss = model(x).square().mean()
        loss.backward()
        if i in (100, 999):
            gc.collect()
            tensors = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
            seen.append((off.stats()["pool_bytes"], off.stats()["live_handles"], tensors))
    torch.set_num_threads(threads)
    assert seen[0][:2] == seen[1][:2]  # pool bytes and live handles: unchanged
    assert seen[1][1] == 0
    # live tensors: no growth (other tests' garbage may still be collected in between)
    assert seen[1][2] <= seen[0][2]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="mode='x'"):
        ActivationOffloader(mode="x", test_mode=True)
    with pytest.raises(ValueError, match="prefetch=-1"):
        ActivationOffloader(prefetch=-1, test_mode=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ActivationOffloader()
    off = ActivationOffloader(test_mode=True)
    with off, pytest.raises(RuntimeError, match="not re-entrant"):
        off.__enter__()


def test_pool_reuses_buffers_across_varying_sizes() -> None:
    """Vision activations change size with every pack: the pool must not pin a new buffer for
    each new size (best fit within 2x)."""
    from lightning_vlmbalance.offload import HostPool

    pool = HostPool(pin=False)
    rng = torch.Generator().manual_seed(0)
    peak, after_50 = 0, 0
    for step in range(200):
        if step == 50:
            after_50 = pool.allocated_bytes
        sizes = torch.randint(40_000, 60_000, (6,), generator=rng).tolist()
        bufs = [pool.take(n) for n in sizes]
        assert all(b.numel() >= n for b, n in zip(bufs, sizes))
        peak = max(peak, pool.in_use_bytes)
        for b in bufs:
            pool.give(b)
    assert pool.in_use_bytes == 0
    # not one buffer per distinct size (that was 1,200 buffers, ~60 MB): bounded and settled
    assert pool.allocated_bytes <= 3 * peak
    assert pool.allocated_bytes <= after_50 * 1.2
