"""A small vision-language model (ViT-style encoder, projector, decoder) as a LightningModule.

It consumes ``PackedBatch`` dicts from :class:`~lightning_vlmbalance.PackCollator`: the vision
encoder attends within each image (``image_cu_seqlens``), the projected image tokens replace the
image placeholders in the token embeddings (``image_positions``), and the decoder attends causally
within each document (``cu_seqlens``), all through :func:`~lightning_vlmbalance.packed_attention`
with the metadata built once per batch. An optional MoE feed-forward routes each token to
``moe_topk`` of ``moe_experts`` experts with the classic loop over experts.

Legend for tensor suffixes: T tokens of the pack, I image tokens, D model dim, H heads, E experts,
V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_vlmbalance import encode_images, packed_attention, packed_cross_entropy
from lightning_vlmbalance.attention import mark_pack_dynamic

# the example VLM at the size the multi-process tests and the Trainer battery train (8-dim
# patches, 64-token vocabulary): ``ToyVLM(**SMALL_VLM, max_positions=...)``
SMALL_VLM = {
    "vocab_size": 64,
    "patch_dim": 8,
    "dim": 16,
    "heads": 2,
    "llm_layers": 1,
    "moe_experts": 2,
}


@dataclass(kw_only=True, slots=True)
class ToyVLMConfig:
    vocab_size: int = 256
    patch_dim: int = 32
    dim: int = 64
    heads: int = 4
    vision_layers: int = 1
    vision_dim: int = 0  # width of the vision encoder (0: ``dim``); its cost grows with it
    llm_layers: int = 2
    max_positions: int = 512
    moe_experts: int = 0  # 0: dense feed-forward in the decoder
    moe_topk: int = 2
    grad_checkpoint: bool = False  # recompute each block in backward (non-reentrant checkpoint)
    lr: float = 3e-3

    def __post_init__(self) -> None:
        if (self.vision_dim or self.dim) % self.heads:
            raise ValueError(
                f"`ToyVLMConfig(vision_dim={self.vision_dim}, heads={self.heads})`: heads must"
                " divide vision_dim"
            )
        if self.dim % self.heads:
            raise ValueError(
                f"`ToyVLMConfig(dim={self.dim}, heads={self.heads})`: heads must divide dim"
            )
        if self.moe_experts and not 1 <= self.moe_topk <= self.moe_experts:
            raise ValueError(
                f"`ToyVLMConfig(moe_topk={self.moe_topk})` must be in"
                f" [1, moe_experts={self.moe_experts}]"
            )


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEFeedForward(nn.Module):
    """Top-k routed experts, computed with one ``torch.where`` per expert (the common baseline)."""

    # tells CompiledMoERouting what this forward computes, so it may swap in the sorted dispatch
    vlmbalance_moe = {"act": "gelu", "renormalize": True}  # noqa: RUF012

    def __init__(self, dim: int, hidden: int, experts: int, topk: int) -> None:
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim, hidden) for _ in range(experts))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        probs_TE = self.router(x_TD).softmax(dim=-1)
        weight_TK, expert_TK = probs_TE.topk(self.topk, dim=-1)
        weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(expert_TK == e)
            # run even with no token so every expert is in the graph (DDP needs every parameter)
            y = expert(x_TD[token]) * weight_TK[token, slot, None]
            out_TD = out_TD.index_add(0, token, y.to(out_TD.dtype))  # bf16 under autocast
        return out_TD


class Block(nn.Module):
    """Pre-norm transformer block over a packed sequence."""

    def __init__(self, dim: int, heads: int, causal: bool, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = ffn if ffn is not None else MLP(dim, 4 * dim)

    def forward(
        self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        T, D = x_TD.shape
        q, k, v = self.qkv(self.norm1(x_TD)).view(T, 3, self.heads, D // self.heads).unbind(1)
        a_THd = packed_attention(q, k, v, cu_seqlens, max_seqlen, causal=self.causal)
        x_TD = x_TD + self.proj(a_THd.reshape(T, D))
        return x_TD + self.ffn(self.norm2(x_TD))


def run_block(
    block: Block, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, recompute: bool
) -> torch.Tensor:
    """``block(x, ...)``, under a non-reentrant activation checkpoint when ``recompute``."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, cu_seqlens, max_seqlen, use_reentrant=False)
    return block(x, cu_seqlens, max_seqlen)


class VisionEncoder(nn.Module):
    """ViT-style: patch features -> tokens, attention within each image."""

    def __init__(self, cfg: ToyVLMConfig) -> None:
        super().__init__()
        width = cfg.vision_dim or cfg.dim
        self.embed = nn.Linear(cfg.patch_dim, width)
        self.blocks = nn.ModuleList(
            Block(width, cfg.heads, causal=False) for _ in range(cfg.vision_layers)
        )
        self.norm = nn.LayerNorm(width)
        self.grad_checkpoint = cfg.grad_checkpoint

    def forward(
        self, pixels_IP: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        x_ID = self.embed(pixels_IP)
        for block in self.blocks:
            x_ID = run_block(block, x_ID, cu_seqlens, max_seqlen, self.grad_checkpoint)
        return self.norm(x_ID)


class LanguageModel(nn.Module):
    """Decoder over the packed sequence, causal within each document."""

    def __init__(self, cfg: ToyVLMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_positions, cfg.dim)
        hidden = 4 * cfg.dim
        self.blocks = nn.ModuleList(
            Block(
                cfg.dim,
                cfg.heads,
                causal=True,
                ffn=MoEFeedForward(cfg.dim, hidden, cfg.moe_experts, cfg.moe_topk)
                if cfg.moe_experts
                else None,
            )
            for _ in range(cfg.llm_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.grad_checkpoint = cfg.grad_checkpoint

    def forward(
        self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        for block in self.blocks:
            x_TD = run_block(block, x_TD, cu_seqlens, max_seqlen, self.grad_checkpoint)
        return self.head(self.norm(x_TD))


class ToyVLM(L.LightningModule):
    """The example VLM. The loss is :func:`~lightning_vlmbalance.packed_cross_entropy`.

    ``vision_frozen = True`` runs the vision encoder without gradients (a frozen tower: no
    backward through it, its parameters get none) until set back to ``False`` (unfrozen: its
    backward appears). Under DDP give the strategy ``find_unused_parameters=True`` for it: the
    parameters stay registered with DDP and are synchronised again once they have gradients.
    """

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = ToyVLMConfig(**config)
        self.vision = VisionEncoder(self.cfg)
        self.vision_frozen = False
        width = self.cfg.vision_dim or self.cfg.dim
        self.projector = nn.Sequential(
            nn.Linear(width, self.cfg.dim), nn.GELU(), nn.Linear(self.cfg.dim, self.cfg.dim)
        )
        self.llm = LanguageModel(self.cfg)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        input_ids_T = batch["input_ids"].reshape(-1)
        position_ids_T = batch["position_ids"].reshape(-1)
        if int(input_ids_T.numel()) > self.cfg.max_positions:
            raise ValueError(
                f"packs of {input_ids_T.numel()} tokens exceed"
                f" `max_positions={self.cfg.max_positions}`"
            )
        # the encoder call; with encoder balancing (``RebalanceConfig(encoder=True)``) this rank
        # encodes its planned images and the pack's embeddings come back from where they ran
        with torch.no_grad() if self.vision_frozen else contextlib.nullcontext():
            image_ID = encode_images(self.vision, batch)
        x_TD = self.llm.embed(input_ids_T) + self.llm.pos(position_ids_T)
        # under autocast the projector runs in bf16 while the embeddings stay float32
        image_ID = self.projector(image_ID).to(x_TD.dtype)
        x_TD = x_TD.index_put((batch["image_positions"],), image_ID)
        return self.llm(x_TD, batch["cu_seqlens"], batch["max_seqlen"])  # (T, V)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # under `trainer.fit(torch.compile(model))`: the sizes that vary from pack to pack are
        # dynamic from the first compilation on (at most 2 in all); a no-op in eager runs
        return mark_pack_dynamic(batch) if isinstance(batch, dict) else batch

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """The pack's summed token loss times its ``loss_weight``: the gradient of every optimizer
        step is that of the token-mean loss over the whole global batch (see
        :mod:`lightning_vlmbalance.loss`)."""
        return packed_cross_entropy(self(batch), batch, module=self).loss

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        out = packed_cross_entropy(self(batch), batch, module=self)
        if out.mean is not None:  # a padding pack has no target: nothing to log
            # shown: the pack's mean token loss; batch_size weighs epoch means by tokens
            self.log("train/loss", out.mean, prog_bar=True, batch_size=out.loss_tokens)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr)

    def configure_model(self) -> None:
        """Under ``"fsdp_vlmbalance"`` (or any ``ModelParallelStrategy``): FSDP2 over the
        data-parallel mesh (:meth:`shard`); under other strategies nothing."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            self.shard(self.device_mesh["data_parallel"])

    def shard(self, mesh: Any) -> None:
        """FSDP2 over ``mesh`` (the data-parallel mesh): every vision and language block and the
        embeddings (called outside the language model's forward) a unit of their own, the rest
        of the model the root unit, whose forward comes first. Call it from
        ``configure_model`` under ``"fsdp_vlmbalance"`` / ``ModelParallelStrategy``."""
        from torch.distributed.fsdp import fully_shard

        for block in [*self.vision.blocks, *self.llm.blocks, self.llm.embed, self.llm.pos]:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
