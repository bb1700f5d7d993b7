"""Encoder balancing on the Hugging Face families, with a real ``all_to_all`` on 2 gloo ranks.

Each rank builds the same tiny float64 model and the same two packs, trains its own pack, and
encodes the images a hand-made route gives it: its kept images and the other rank's moved ones
(their fields sliced the way the loader ships them). The loss of every pack and the gradient
summed over the ranks must equal the run where every rank encodes its own images, for every
supported family: Qwen-VL grids and window attention, Qwen3-VL deepstack features, LLaVA-OneVision
tiles, Idefics3 tiles as units. Scenario ``text_only``: rank 1's pack has no image and encodes
all of rank 0's, rank 0 encodes nothing (its dummy image keeps the tower in its graph).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from harness.ranks import run_ranks
from lightning_vlmbalance.hf.check import FLOAT32_NORMS
from lightning_vlmbalance.hf.synthetic import TINY_FAMILIES

# seed 1: items 0, 1, 2 have images and 3 is text-only, in every family
PACKS = {"swap": ([0, 3], [1, 2]), "text_only": ([0, 1], [3])}


class CallsForward(torch.nn.Module):
    """A wrapper whose forward calls the model's ``.forward`` directly, skipping the model's
    own module hooks (as some adapter libraries' wrappers do)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model.forward(**kwargs)


def _wrapped(model: torch.nn.Module, wrap: str) -> torch.nn.Module:
    if wrap == "calls_forward":
        return CallsForward(model)
    if wrap == "peft":
        import peft

        config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        wrapped = peft.get_peft_model(model, config)
        for name, p in wrapped.named_parameters():  # LoRA starts at B = 0: give it a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return wrapped
    return model


def _route_job(rank: int, world: int, family: str, scenario: str, wrap: str = "none") -> dict:
    import torch.distributed as dist
    import transformers as tf

    import lightning_vlmbalance.hf as vbhf
    from lightning_vlmbalance.balance.encoder import ReturnChannel, route_for
    from lightning_vlmbalance.hf.synthetic import SyntheticProcessed, tiny_config
    from lightning_vlmbalance.loaders.rebalancing import image_payload_fields

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = tiny_config(family)
    # the MoE's grouped matmul has no float64 kernel: its experts run as a plain loop
    model = tf.AutoModelForImageTextToText.from_config(config, experts_implementation="eager")
    model = _wrapped(model.double().train(), wrap)
    data = SyntheticProcessed(
        config, 4, seed=1, text_share=0.3, max_images=1 if family == "llava_onevision" else 2
    )
    lengths = vbhf.item_lengths(data, config).total_tokens
    collate = vbhf.HFPackCollator(
        config, seq_len=max(int(lengths[ids].sum()) for ids in PACKS[scenario]) + 8
    )
    packs = [collate([data[i] for i in ids]) for ids in PACKS[scenario]]
    for pack in packs:
        for k, v in pack["image_fields"].items():
            if v.is_floating_point():
                pack["image_fields"][k] = v.double()
    sizes = [[int(s) for s in p["meta"]["image_sizes"]] for p in packs]
    assert sizes[0], "rank 0's pack must have images"
    # the plan: swap: rank 0's first image to rank 1, rank 1's last image to rank 0;
    # text_only: every image of rank 0 to rank 1
    encoder = [[r] * len(s) for r, s in enumerate(sizes)]  # at home, then the moves
    if scenario == "swap":
        encoder[0][0], encoder[1][-1] = 1, 0
    else:
        encoder[0] = [1] * len(sizes[0])
    channel = ReturnChannel()  # the world group

    def routed(r: int) -> dict:
        batch = dict(packs[r])
        other = 1 - r
        moved = [i for i, e in enumerate(encoder[other]) if e == r]
        batch["encoder_route"] = route_for(
            group=channel,
            rank=r,
            world=world,
            own_sizes=sizes[r],
            own_encoder=encoder[r],
            foreign=[(other, sizes[other][i]) for i in moved],
        )
        fields = image_payload_fields(packs[other])
        batch["encoder_fields"] = {
            name: torch.cat([t[a[i] : a[i + 1]] for i in moved]) if moved else t[:0]
            for name, (t, a) in fields.items()
        }
        return batch

    def loss_and_grad(batch: dict) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=False)
        # the inputs of the transformers model inside the wrapper: the wrapper calls it
        inner = model.model if wrap == "calls_forward" else model
        loss = model(**vbhf.model_inputs(inner, batch)).loss
        loss.backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        grad = torch.cat([p.grad.reshape(-1) for p in trained])
        dist.all_reduce(grad)
        return float(loss.detach()), grad

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    home_loss, home_grad = loss_and_grad(packs[rank])
    loss, grad = loss_and_grad(routed(rank))
    rel = float((grad - home_grad).norm() / home_grad.norm())
    return {
        "loss": (home_loss, loss),
        "grad_rel": rel,
        "moved": sum(e != rank for e in encoder[rank]),
        "images": len(sizes[rank]),
    }


# every family swaps images; the text-only scenario (the dummy image on a rank that encodes
# nothing) runs for one family of each layout, Qwen3-VL's deepstack among them
# a model wrapped for fine-tuning: PEFT's LoRA, and a wrapper that calls the model's
# ``.forward`` (not the module), which skips the model's own hooks
CASES = (
    [(f, "swap", "none") for f in TINY_FAMILIES]
    + [
        (f, "text_only", "none")
        for f in ("qwen3_vl", "llava_onevision", "idefics3", "gemma4", "mistral3", "qwen3_5")
    ]
    + [("qwen2_5_vl", "swap", "peft"), ("idefics3", "text_only", "calls_forward")]
    + [("qwen3_vl", "swap", "calls_forward")]
)


@pytest.mark.parametrize(("family", "scenario", "wrap"), CASES)
def test_encoder_balancing_gives_the_gradients_of_encoding_at_home(
    family: str, scenario: str, wrap: str
) -> None:
    if wrap == "peft":
        pytest.importorskip("peft")
    results = run_ranks(
        _route_job, 2, family, scenario, wrap, timeout=240, start_method="forkserver"
    )
    assert all(status == "ok" for status, _ in results.values()), results
    got = [results[r][1] for r in (0, 1)]
    assert sum(g["moved"] for g in got) > 0
    if scenario == "text_only":
        assert got[1]["images"] == 0 and got[0]["moved"] == got[0]["images"]
    else:  # each rank keeps some images and encodes one of the other's
        assert all(g["moved"] == 1 and g["images"] >= 1 for g in got), got
    for g in got:
        home, routed = g["loss"]
        assert abs(routed - home) <= 1e-10 * abs(home), g
        # Gemma's and Qwen3.5's RMSNorm reduce their weights' gradients in float32
        assert g["grad_rel"] <= (1e-6 if family in FLOAT32_NORMS else 1e-10), g


def test_images_waiting_for_a_forward_are_never_left_for_another_batch() -> None:
    """``model_inputs`` of a routed batch hands its images to the next forward: preparing
    another batch first, or a forward on other ``input_ids``, is refused by name (the images
    were once left for whichever forward came next)."""
    import transformers as tf

    import lightning_vlmbalance.hf as vbhf
    from lightning_vlmbalance.balance.encoder import ReturnChannel, route_for
    from lightning_vlmbalance.hf.synthetic import SyntheticProcessed, tiny_config

    config = tiny_config("qwen2_5_vl")
    model = tf.AutoModelForImageTextToText.from_config(config).train()
    data = SyntheticProcessed(config, 4, seed=1, text_share=0.3, max_images=2)
    collate = vbhf.HFPackCollator(config, seq_len=512)
    packs = [collate([data[i]]) for i in (0, 1)]
    for pack in packs:
        sizes = [int(s) for s in pack["meta"]["image_sizes"]]
        pack["encoder_route"] = route_for(
            group=ReturnChannel(),
            rank=0,
            world=1,
            own_sizes=sizes,
            own_encoder=[0] * len(sizes),
            foreign=[],
        )
    vbhf.model_inputs(model, packs[0])
    with pytest.raises(RuntimeError, match="still wait for the forward"):
        vbhf.model_inputs(model, packs[1])
    inputs = vbhf.model_inputs(model, packs[1])  # the refused call left nothing behind
    inputs["input_ids"] = inputs["input_ids"].clone()
    with pytest.raises(RuntimeError, match="got other `input_ids`"):
        model(**inputs)
