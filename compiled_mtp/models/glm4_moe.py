"""GLM-4 MoE (GLM-4.5 / 4.6, `glm4_moe`): grouped-query attention over a standard K/V cache, on the
shared blocks of layers.py.

As HF transformers defines it: q/k/v projections with `attention_bias` (o_proj has none), optional
per-head RMSNorm on q and k (`use_qk_norm`), rotary embedding on the leading
`partial_rotary_factor` share of each head (rotate-half), the sigmoid router with
`e_score_correction_bias` and group-limited top-k, shared experts, the first
`first_k_dense_replace` layers dense. The MTP layer is DeepSeek-V3's (layers.MTPLayer) with this
attention, always MoE, at `model.layers.{num_hidden_layers}` in the published checkpoints.

A cache entry is one token's keys and values, every KV head: [k heads | v heads], 2 x
num_key_value_heads x head_dim wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .config import (
    CheckpointError,
    RopeConfig,
    check_router,
    eos_ids,
    fp8_block_size,
    need,
    need_sizes,
    reading,
)
from .family import CausalLM
from .layers import Attention, Backbone, Context, Linear, RMSNorm, Rope


@dataclass(frozen=True)
class Glm4MoeConfig:
    """The subset of a GLM-4 MoE config.json that changes the computation."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    attention_bias: bool = False
    use_qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each head that rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def cache_dim(self) -> int:
        return 2 * self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Glm4MoeConfig:
        """Validate and convert an HF config dict; errors name `source` and the field."""
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')"
            )
        # transformers >= 5 writes `rope_parameters`; the released configs have top-level fields.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise CheckpointError(
                f"{source}: rope type {kind!r} is not supported for glm4_moe (supported: default)"
            )
        with reading(source):
            heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                n_routed_experts=int(raw["n_routed_experts"]),
                n_shared_experts=int(raw.get("n_shared_experts", 1)),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
                n_group=int(raw.get("n_group") or 1),
                topk_group=int(raw.get("topk_group") or 1),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                first_k_dense_replace=int(raw.get("first_k_dense_replace", 1)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
                ),
                attention_bias=bool(raw.get("attention_bias", False)),
                use_qk_norm=bool(raw.get("use_qk_norm", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
                num_nextn_predict_layers=int(
                    raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0
                ),
                eos_token_ids=eos_ids(raw),
                fp8_block_size=fp8_block_size(raw, source),
            )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        need_sizes(self, source)
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            source,
            f"num_attention_heads {self.num_attention_heads} not "
            f"divisible by num_key_value_heads {self.num_key_value_heads}",
        )
        need(
            self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
            source,
            "partial_rotary_factor must give an even rotary width in "
            f"[2, head_dim={self.head_dim}], got {self.rotary_dim}",
        )
        check_router(source, self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok)


class GQA(Attention):
    """Grouped-query attention: num_attention_heads query heads share num_key_value_heads K/V heads."""

    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(h, nh * hd, cfg.attention_bias)
        self.k_proj = Linear(h, nkv * hd, cfg.attention_bias)
        self.v_proj = Linear(h, nkv * hd, cfg.attention_bias)
        self.o_proj = Linear(nh * hd, h)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def entries(self, x: Tensor, ctx: Context) -> Tensor:
        """Each row's rotated keys and values of every KV head, [B, T, 2 * nkv * hd]."""
        b, t, _ = x.shape
        nkv, hd = self.cfg.num_key_value_heads, self.cfg.head_dim
        k = self.k_proj(x).view(b, t, nkv, hd)
        v = self.v_proj(x).view(b, t, nkv, hd)
        if self.cfg.use_qk_norm:
            k = self.k_norm(k)
        k = self._rotate(k, ctx.rope, ctx.cos[:, :, None], ctx.sin[:, :, None])
        return torch.cat([k.flatten(2), v.flatten(2)], dim=-1)

    def entry_modules(self) -> list[nn.Module]:
        return [self.k_proj, self.v_proj]

    def attend(self, x: Tensor, ctx: Context, kv: Tensor) -> Tensor:
        b, t, _ = x.shape
        nh, hd = self.cfg.num_attention_heads, self.cfg.head_dim
        q = self.q_proj(x).view(b, t, nh, hd)
        if self.cfg.use_qk_norm:
            q = self.q_norm(q)
        q = self._rotate(q, ctx.rope, ctx.cos[:, :, None], ctx.sin[:, :, None])
        out = kv_attention(q, kv, ctx.visible, hd**-0.5)
        return self.o_proj(out.reshape(b, t, nh * hd))

    def _rotate(self, x: Tensor, rope: Rope, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotary embedding on each head's leading rotary_dim channels; the rest pass through."""
        rd = self.cfg.rotary_dim
        return torch.cat([rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def kv_attention(q: Tensor, kv: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Queries q [B, T, H, D] over cache entries kv [B, S, 2 * G * D] ([keys | values] of G KV heads,
    each shared by H / G query heads), row (b, t) attending to the entries where visible [B, T, S]
    holds -> [B, T, H, D]."""
    b, t, h, d = q.shape
    g = kv.shape[-1] // (2 * d)
    keys, values = kv.view(kv.shape[0], kv.shape[1], 2, g, d).unbind(2)
    qg = q.view(b, t, g, h // g, d)
    scores = torch.einsum("btgrd,bsgd->bgrts", qg, keys)
    scores = (scores.float() * scale).masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    return torch.einsum("bgrts,bsgd->btgrd", probs, values).reshape(b, t, h, d)


class Glm4Moe(CausalLM):
    """GLM-4 MoE's target model T and MTP layers M. Caches: [layers, slots, max_seq_len, 2 x KV heads x head_dim]."""

    model_type = "glm4_moe"

    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__(cfg, Backbone(cfg, lambda: GQA(cfg), mtp_moe=True), cfg.cache_dim)

    def make_rope(self) -> Rope:
        return Rope(RopeConfig(theta=self.cfg.rope_theta), self.cfg.rotary_dim, interleave=False)

    def checkpoint_keys(self, name: str, param: Tensor) -> list[str]:
        """As DeepSeek-V3's, but a tied LM head is read from the embedding."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ["model.embed_tokens.weight"]
        return super().checkpoint_keys(name, param)
