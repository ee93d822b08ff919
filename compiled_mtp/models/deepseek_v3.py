"""DeepSeek-V3: multi-head latent attention (MLA) over a latent cache, on the shared blocks of layers.py.

Each cache entry is one token's compressed kv latent and shared rope key (`cache_dim` wide), so the
cache is a `RowCache` of that width. MTP layer i lives at `model.layers[num_hidden_layers + i]`, as in
the checkpoint, and uses MoE whenever the model has routed experts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .family import CausalLM
from .layers import (
    MLP,
    Attention,
    Backbone,
    Context,
    Experts,
    Linear,
    MoE,
    RMSNorm,
    Rope,
    Router,
    gathered_experts,
)

__all__ = [
    "MLA",
    "MLP",
    "DeepseekV3",
    "Experts",
    "Linear",
    "MoE",
    "Router",
    "gathered_experts",
    "latent_attention",
]


class MLA(Attention):
    """Multi-head latent attention over a cache of (kv latent, rope key) per token.

    Attention runs in the absorbed form: q_nope is projected into the latent space through kv_b_proj's
    key half, and the output is projected out through its value half, so the cache is never expanded.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(h, cfg.cache_dim, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = Linear(nh * cfg.v_head_dim, h, cfg.attention_bias)

    def entries(self, x: Tensor, ctx: Context) -> Tensor:
        """Each row's normed kv latent and rotated rope key, [B, T, r + dr]."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1
        )
        return torch.cat([self.kv_a_layernorm(latent), ctx.rope(k_pe, ctx.cos, ctx.sin)], dim=-1)

    def entry_modules(self) -> list[nn.Module]:
        return [self.kv_a_proj_with_mqa]

    def attend(self, x: Tensor, ctx: Context, kv: Tensor) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, t, nh, cfg.qk_head_dim).split([dn, dr], dim=-1)
        q_pe = ctx.rope(q_pe, ctx.cos[:, :, None], ctx.sin[:, :, None])
        out = latent_attention(q_nope, q_pe, self.kv_b_proj.weight, kv, ctx.visible, cfg.softmax_scale)
        return self.o_proj(out.reshape(b, t, nh * dv))


def latent_attention(
    q_nope: Tensor, q_pe: Tensor, kv_b: Tensor, kv: Tensor, visible: Tensor, scale: float
) -> Tensor:
    """MLA's attention in the latent space: queries q_nope [B, T, H, dn] taken into it through each
    head's key half of kv_b_proj's weight kv_b [H * (dn + dv), r], and q_pe [B, T, H, dr], over cache
    entries kv [B, S, r + dr], row (b, t) attending to the entries where visible [B, T, S] holds; out
    through each head's value half -> [B, T, H, dv]. A function of its own so a pass can find it
    (passes/live_attention.py)."""
    heads, dn = q_nope.shape[2], q_nope.shape[3]
    w = kv_b.view(heads, -1, kv_b.shape[-1])
    q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w[:, :dn])
    kv_latent, kv_pe = kv.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    scores = torch.einsum("bthr,bsr->bhts", q_latent, kv_latent) + torch.einsum("bthd,bsd->bhts", q_pe, kv_pe)
    scores = (scores.float() * scale).masked_fill(~visible[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    out_latent = torch.einsum("bhts,bsr->bthr", probs, kv_latent)
    return torch.einsum("bthr,hvr->bthv", out_latent, w[:, dn:])


class DeepseekV3(CausalLM):
    """DeepSeek-V3's target model T and MTP layers M. Caches: [layers, slots, max_seq_len, cache_dim]."""

    model_type = "deepseek_v3"

    e_score_correction_bias: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg, Backbone(cfg, lambda: MLA(cfg), cfg.n_routed_experts is not None), cfg.cache_dim
        )

    def make_rope(self) -> Rope:
        return Rope(self.cfg.rope, self.cfg.qk_rope_head_dim, self.cfg.rope_interleave)
