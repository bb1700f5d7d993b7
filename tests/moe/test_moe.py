"""Sorted MoE dispatch: same numbers as the loops it replaces, no host sync, fullgraph compiles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from examples.vlm import MoEFeedForward
from lightning_vlmbalance.moe import (
    combine,
    dispatch,
    grouped_mlp,
    grouped_mm,
    load_balancing_loss,
    native_grouped_mm_supported,
    patch_moe_modules,
    route,
    unpatch_moe_modules,
    unsupported_moe_modules,
)

RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


pytestmark = pytest.mark.usefixtures("one_thread")


def _compare(original: torch.nn.Module, x: torch.Tensor, compile_kwargs=None) -> list:
    """Patches a copy of ``original``; returns relative errors of output, input grad, params."""
    patched = copy.deepcopy(original)
    records = patch_moe_modules(patched, compile_kwargs=compile_kwargs)
    assert records
    outs = []
    for m in (original, patched):
        xi = x.detach().clone().requires_grad_()
        y = m(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in m.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    errs = [_rel(y1, y0), _rel(gx1, gx0)]
    errs += [_rel(a, b) for a, b in zip(gp1, gp0) if b is not None and b.abs().max() > 0]
    unpatch_moe_modules(records)
    return errs


@pytest.mark.parametrize("compiled", [False, True])
def test_example_moe_matches_the_loop(compiled) -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(32, 64, experts=8, topk=2)
    kwargs = {"backend": "aot_eager", "fullgraph": True} if compiled else None
    assert max(_compare(moe, torch.randn(40, 32), kwargs)) < RTOL


@pytest.mark.parametrize(
    ("experts", "topk", "tokens", "case"),
    [
        (8, 2, 3, "some experts get no token"),
        (4, 4, 16, "top-k equals the number of experts"),
        (8, 2, 1, "a batch of one token"),
        (8, 1, 32, "all tokens to one expert"),
    ],
)
def test_edge_cases(experts, topk, tokens, case) -> None:
    torch.manual_seed(1)
    moe = MoEFeedForward(16, 32, experts=experts, topk=topk)
    if case == "all tokens to one expert":
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[5] = 1.0
        x = torch.rand(tokens, 16) + 0.1  # positive: expert 5 wins for every token
        d = dispatch(route(moe.router(x), topk)[1], experts)
        assert d.counts.tolist() == [0] * 5 + [tokens] + [0] * (experts - 6)
    else:
        x = torch.randn(tokens, 16)
    assert max(_compare(moe, x)) < RTOL, case


def test_dispatch_sorts_counts_and_inverts() -> None:
    experts_NK = torch.tensor([[2, 0], [2, 1], [0, 2]])
    d = dispatch(experts_NK, num_experts=4)
    assert d.expert.tolist() == [0, 0, 1, 2, 2, 2]
    assert d.token.tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order within an expert
    assert d.counts.tolist() == [2, 1, 3, 0] and d.offsets.tolist() == [2, 3, 6, 6]
    assert d.counts.dtype == d.offsets.dtype == torch.int32
    y = torch.arange(6.0).unsqueeze(1)  # row i of the sorted order carries the value i
    out = combine(y, d, torch.ones(3, 2))
    # token 0: sorted rows 0 (expert 0) and 3 (expert 2); token 1: rows 2 and 4; token 2: 1 and 5
    assert out.squeeze(1).tolist() == [3.0, 6.0, 6.0]


def test_sigmoid_routing_bias_only_selects() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    bias = torch.tensor([10.0, 0.0, 0.0])
    weights, experts, _ = route(logits, 1, score="sigmoid", bias_E=bias)
    assert experts.tolist() == [[0]]  # the bias picked expert 0
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[0.0]])))  # unbiased weight
    weights, experts, _ = route(logits, 2, score="softmax", renormalize=True)
    assert experts.tolist() == [[2, 1]] and torch.allclose(weights.sum(), torch.tensor(1.0))


def test_grouped_mm_paths_agree_and_check_offsets() -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    w = torch.randn(3, 8, 16)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    ref = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    assert torch.allclose(grouped_mm(x, w, offsets), ref, atol=1e-6)
    assert torch.allclose(torch._grouped_mm(x, w, offs=offsets), ref, atol=1e-6)
    with pytest.raises(ValueError, match="offsets end at 6 but x has 10 rows"):
        grouped_mm(x, w, torch.tensor([2, 4, 6], dtype=torch.int32))


def test_load_balancing_loss_matches_hugging_face() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(24, 8)
    _, experts, scores = route(logits, 2)
    ours = load_balancing_loss(scores, dispatch(experts, 8).counts)
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert transformers and torch.allclose(ours, theirs, rtol=1e-6)


def test_routing_compiles_fullgraph_float32() -> None:
    def routing(logits: torch.Tensor):
        weights, experts, scores = route(logits, 2, renormalize=True)
        d = dispatch(experts, 8)
        return weights, d.counts, d.offsets, d.inverse, load_balancing_loss(scores, d.counts)

    logits = torch.randn(64, 8)
    got = torch.compile(routing, fullgraph=True, backend="aot_eager")(logits)
    for a, b in zip(got, routing(logits)):
        assert torch.equal(a, b)


def test_moe_forward_backward_compiles_fullgraph_bfloat16_without_graph_break() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(32, 64, experts=8, topk=2).to(torch.bfloat16)
    x = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
    assert native_grouped_mm_supported(x, torch.randn(8, 32, 64, dtype=torch.bfloat16))
    torch._dynamo.utils.counters.clear()
    records = patch_moe_modules(moe, compile_kwargs={"backend": "aot_eager", "fullgraph": True})
    moe(x).float().square().mean().backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert x.grad is not None and all(p.grad is not None for p in moe.parameters())
    unpatch_moe_modules(records)


def _tiny_hf(kind: str):
    transformers = pytest.importorskip("transformers")
    common = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
        "experts_implementation": "eager",  # the per-expert loop is the reference
    }
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=8, **common)
        return transformers.MixtralForCausalLM(cfg)
    cfg = transformers.Qwen3MoeConfig(
        num_experts=8, moe_intermediate_size=16, norm_topk_prob=True, head_dim=8, **common
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hugging_face_moe_matches(kind) -> None:
    model = _tiny_hf(kind)
    ids = torch.randint(0, 96, (2, 12))
    patched = copy.deepcopy(model)
    records = patch_moe_modules(patched, compile_kwargs={"backend": "aot_eager", "fullgraph": True})
    assert [r.kind for r in records] == ["fused_experts"] * 2
    assert all(r.router is not None and r.score == "softmax" for r in records)
    out = []
    for m in (model, patched):
        res = m(ids, labels=ids)
        res.loss.backward()
        out.append((res.logits.detach(), [p.grad for p in m.parameters()]))
    assert _rel(out[1][0], out[0][0]) < RTOL
    for a, b in zip(out[1][1], out[0][1]):
        if b is not None and b.abs().max() > 0:
            assert _rel(a, b) < RTOL
    lb = records[0].load_balancing_loss()
    assert lb is not None and lb.item() >= 1.0  # at least 1 (K=2: 2 when balanced)


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_mlp_custom_op_matches_the_composition(gated) -> None:
    """The per-expert fused op (float32 path) against grouped products + activation, with an
    expert that gets no rows; opcheck validates the op's fake and autograd registrations."""
    from lightning_vlmbalance.moe.grouped import _grouped_mlp

    torch.manual_seed(0)
    E, H, Fh = 4, 8, 12
    O1 = 2 * Fh if gated else Fh
    x = torch.randn(10, H, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(E, O1, H, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(E, O1, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(E, H, Fh, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(E, H, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1: no rows
    expert = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])

    def reference():
        h = torch.einsum("sh,soh->so", x, w1[expert]) + b1[expert]
        if gated:
            g, u = h.chunk(2, dim=-1)
            a = torch.nn.functional.gelu(g) * u
        else:
            a = torch.nn.functional.gelu(h)
        return torch.einsum("sf,shf->sh", a, w2[expert]) + b2[expert]

    params = [x, w1, b1, w2, b2]
    probe = torch.randn(10, H, dtype=torch.float64)
    ref = reference()
    ref_grads = torch.autograd.grad((ref * probe).sum(), params)
    got = grouped_mlp(x, w1, b1, w2, b2, offsets, act="gelu", gated=gated)
    got_grads = torch.autograd.grad((got * probe).sum(), params)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.equal(got_grads[1][1], torch.zeros_like(w1[1]))  # no rows: zero gradient
    torch.library.opcheck(_grouped_mlp, (x, w1, b1, w2, b2, offsets, "gelu", gated))


def test_lookalikes_are_left_alone() -> None:
    """Only modules whose computation is known are patched: a MoEFeedForward-shaped module that
    does not declare it, one with a router bias, and fused experts with their own gating."""
    torch.manual_seed(0)

    class Undeclared(MoEFeedForward):
        vlmbalance_moe = None

    biased = MoEFeedForward(16, 32, experts=4, topk=2)
    biased.router = torch.nn.Linear(16, 4, bias=True)
    assert patch_moe_modules(Undeclared(16, 32, experts=4, topk=2)) == []
    assert patch_moe_modules(biased) == []

    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ClampedExperts(MixtralExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=1.0)) * up

    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4)
    assert patch_moe_modules(MixtralExperts(cfg))  # the default gating is recognised
    assert patch_moe_modules(ClampedExperts(cfg)) == []


def test_unsupported_moe_modules_name_the_reason() -> None:
    """Every MoE-looking module that is left alone is named with why; patched ones and dense
    MLPs (2-D ``down_proj``) are not."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class Undeclared(MoEFeedForward):
        vlmbalance_moe = None

    class ClampedExperts(MixtralExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=1.0)) * up

    biased = MoEFeedForward(16, 32, experts=4, topk=2)
    biased.router = torch.nn.Linear(16, 4, bias=True)
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4)
    root = torch.nn.ModuleDict(
        {
            "ok": MoEFeedForward(16, 32, experts=4, topk=2),
            "undeclared": Undeclared(16, 32, experts=4, topk=2),
            "biased": biased,
            "mixtral": MixtralExperts(cfg),
            "clamped": ClampedExperts(cfg),
            "dense": torch.nn.Sequential(torch.nn.Linear(16, 16)),
        }
    )
    skipped = unsupported_moe_modules(root)
    assert set(skipped) == {"undeclared", "biased", "clamped"}
    assert "does not declare `vlmbalance_moe" in skipped["undeclared"]
    assert skipped["biased"] == "a router bias is not supported"
    assert skipped["clamped"] == "its own gating (`ClampedExperts._apply_gate`) is not supported"
    assert [p.name for p in patch_moe_modules(root)] == ["ok", "mixtral"]
    dcfg = transformers.DeepseekV3Config(
        hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, n_group=1, topk_group=1
    )
    assert unsupported_moe_modules(DeepseekV3MoE(dcfg)) == {}  # shared experts are dense


def _tiny_deepseek_v3_moe():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=16,
        moe_intermediate_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():  # the router starts at zero, the experts uninitialised
            p.normal_(std=0.5)
    return moe


def test_sigmoid_router_load_balancing_loss_uses_its_sigmoid_scores() -> None:
    """DeepSeek-V3's router scores with a sigmoid: ``lb_loss`` must be the Switch formula over
    the per-token normalised sigmoid scores, not over a softmax of its logits."""
    moe = _tiny_deepseek_v3_moe()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        logits_NE, _, experts_NK = moe.gate(x)
        y_ref = moe(x)
    [p] = patch_moe_modules(moe)
    assert p.score == "sigmoid"
    with torch.no_grad():
        y = moe(x)
    assert _rel(y, y_ref) < RTOL  # the block's own routing is kept

    N, E = logits_NE.shape
    counts_E = torch.bincount(experts_NK.reshape(-1), minlength=E).float()
    assert torch.equal(p.counts.float(), counts_E)
    sig_NE = logits_NE.sigmoid()
    sig_NE = sig_NE / sig_NE.sum(dim=-1, keepdim=True)
    expected = E * (counts_E / N * sig_NE.mean(dim=0)).sum()
    softmax = E * (counts_E / N * logits_NE.softmax(dim=-1).mean(dim=0)).sum()
    lb = p.load_balancing_loss()
    assert lb is not None and torch.allclose(lb, expected, rtol=1e-6)
    assert not torch.allclose(lb, softmax, rtol=1e-3)

    moe.config.scoring_func = "sqrtsoftplus"  # declared, and neither softmax nor sigmoid
    unpatch_moe_modules([p])
    [p] = patch_moe_modules(moe)
    moe(x)
    assert p.score is None and p.load_balancing_loss() is None
    unpatch_moe_modules([p])


def test_a_copy_of_a_patched_moe_computes_with_its_own_weights() -> None:
    """A deep copy of a patched module (a frozen reference or teacher copied after the callback's
    ``setup``) must compute with its own weights and keep its own statistics, however the
    original's weights move; unpatching the original must restore the copy too."""
    torch.manual_seed(0)
    moe = MoEFeedForward(16, 32, experts=4, topk=2)
    [record] = patch_moe_modules(moe)
    frozen = copy.deepcopy(moe).requires_grad_(False)
    optimizer = torch.optim.SGD(moe.parameters(), lr=1.0)
    x = torch.randn(12, 16)
    moe(x).square().sum().backward()
    optimizer.step()  # the policy moves on, the frozen copy must not follow it
    with torch.no_grad():
        moe(x)
        assert _rel(frozen(x[:5]), MoEFeedForward.forward(frozen, x[:5])) < RTOL
        assert _rel(moe(x), MoEFeedForward.forward(moe, x)) < RTOL
    assert int(record.counts.sum()) == 12 * 2  # the copy's 5 tokens went to its own record
    unpatch_moe_modules([record])
    for m in (moe, frozen):
        assert "forward" not in m.__dict__
        assert m.forward.__func__ is MoEFeedForward.forward


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_copy_of_a_patched_hugging_face_moe_computes_with_its_own_weights(kind) -> None:
    """The same for Hugging Face fused experts: the copy's experts use its own weights, its
    routers record into its own statistics, and unpatching the original removes the copy's
    forwards and router hooks as well."""
    model = _tiny_hf(kind)
    unpatched = copy.deepcopy(model)
    records = patch_moe_modules(model)
    frozen = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))  # the policy moves on
    unpatched.load_state_dict(frozen.state_dict())
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        model(ids)
        assert _rel(frozen(ids[:1]).logits, unpatched(ids[:1]).logits) < RTOL
    for r in records:
        assert r.logits.shape[0] == 24 and int(r.counts.sum()) == 24 * 2  # the policy's batch
    unpatch_moe_modules(records)
    for m in (*model.modules(), *frozen.modules()):
        assert "forward" not in m.__dict__ and not m._forward_hooks, type(m).__name__


def test_a_subclass_that_overrides_forward_does_not_inherit_the_opt_in() -> None:
    """``vlmbalance_moe`` declares what one forward computes: a subclass with its own forward is
    left alone (and named) unless it declares it again; one that keeps the forward is patched."""
    torch.manual_seed(0)

    class Halved(MoEFeedForward):
        def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
            return 0.5 * super().forward(x_TD)

    class Renamed(MoEFeedForward):
        pass

    class Redeclared(Halved):  # its author vouches again, for the forward it runs
        vlmbalance_moe = {"act": "gelu", "renormalize": True}  # noqa: RUF012

        def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
            return MoEFeedForward.forward(self, x_TD)

    root = torch.nn.ModuleDict(
        {
            "halved": Halved(16, 32, experts=4, topk=2),
            "renamed": Renamed(16, 32, experts=4, topk=2),
            "redeclared": Redeclared(16, 32, experts=4, topk=2),
        }
    )
    x = torch.randn(10, 16)
    y_ref = root["halved"](x)
    skipped = unsupported_moe_modules(root)
    assert list(skipped) == ["halved"]
    assert "its forward (`" in skipped["halved"] and "Halved.forward`)" in skipped["halved"]
    assert (
        "is not `MoEFeedForward.forward`, the forward `MoEFeedForward.vlmbalance_moe` describes"
        in skipped["halved"]
    )
    assert [p.name for p in patch_moe_modules(root)] == ["renamed", "redeclared"]
    assert torch.equal(root["halved"](x), y_ref)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hugging_face_experts_with_their_own_forward_are_left_alone(kind) -> None:
    """Fused experts are patched only while their forward is transformers' own: a subclass that
    overrides it is named with the reason, and the model's outputs stay its own."""
    model = _tiny_hf(kind)
    base = type(model.model.layers[0].mlp.experts)

    class HalvedExperts(base):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return 0.5 * super().forward(*args)

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = HalvedExperts
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    skipped = unsupported_moe_modules(model)
    assert set(skipped) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    for why in skipped.values():
        assert "HalvedExperts.forward`) is not a transformers experts forward" in why
    assert patch_moe_modules(model) == []
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_fused_experts_outside_transformers_are_left_alone() -> None:
    """3-D ``gate_up_proj`` / ``down_proj`` and a ``config.hidden_act`` are only a shape: a
    module of its own (not a transformers experts class) may compute anything, and is named."""

    class OwnExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"hidden_act": "silu"})()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, hidden, top_k_index, top_k_weights):
            return hidden  # anything but the experts' product

    skipped = unsupported_moe_modules(torch.nn.ModuleDict({"own": OwnExperts()}))
    assert list(skipped) == ["own"]
    assert "OwnExperts.forward`) is not a transformers experts forward" in skipped["own"]
    assert patch_moe_modules(OwnExperts()) == []


def test_a_transformers_experts_forward_replaced_by_another_library_is_left_alone(
    monkeypatch,
) -> None:
    """A function from elsewhere assigned to a transformers experts class (as kernel libraries
    patch Hugging Face classes) is not transformers' forward: the experts are named and kept."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    own = MixtralExperts.forward

    def halved(self, *args: torch.Tensor) -> torch.Tensor:
        return 0.5 * own(self, *args)

    monkeypatch.setattr(MixtralExperts, "forward", halved)
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4)
    skipped = unsupported_moe_modules(torch.nn.ModuleDict({"experts": MixtralExperts(cfg)}))
    assert "halved`) is not a transformers experts forward" in skipped["experts"]
    assert patch_moe_modules(MixtralExperts(cfg)) == []
