"""DeepSeek-V3 target model and MTP layers, written for static shapes.

Every forward takes a [B, T] block of rows (B requests, T rows each) plus explicit positions, cache write
indices and cache slots, so one code path serves prefill chunks, verify blocks and draft steps, and
torch.compile can trace it whole: no data-dependent shapes, no `.item()`, no branching on tensor values.

Parameter names follow the checkpoint keys (`model.layers.3.self_attn.kv_b_proj.weight`), except routed
experts, which are stacked per layer (`mlp.experts.gate_proj` is [E, I, H]) so a token gathers its experts.
MTP layer i lives at `model.layers[num_hidden_layers + i]`, as in the checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig, yarn_mscale


class Linear(nn.Module):
    """y = x W^T (+ b). Its own class so a pass can recognise and repack every linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rope(nn.Module):
    """Rotary embedding on the qk_rope_head_dim slice, with optional YaRN frequency scaling."""

    inv_freq: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.interleave = cfg.rope_interleave
        inv_freq, self.attention_factor = _rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # Interleaved checkpoints rotate (x0, x1), (x2, x3), ...; either way the output is laid out
        # [rotated first halves | rotated second halves], identically for q and k, so dot products agree.
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_frequencies(cfg: ModelConfig) -> tuple[Tensor, float]:
    rope, dim = cfg.rope, cfg.qk_rope_head_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type != "yarn":
        return 1.0 / pos_freqs, 1.0
    if rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(factor)


class MLA(nn.Module):
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

    def forward(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, dn, dr, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, t, nh, cfg.qk_head_dim).split([dn, dr], dim=-1)
        q_pe = ctx.rope(q_pe, ctx.cos[:, :, None], ctx.sin[:, :, None])
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        entry = torch.cat([self.kv_a_layernorm(latent), ctx.rope(k_pe, ctx.cos, ctx.sin)], dim=-1)
        kv = ctx.store_and_read(layer, entry)  # [B, S, r + dr]
        w = self.kv_b_proj.weight.view(nh, dn + dv, r)
        q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w[:, :dn])
        out_latent = latent_attention(q_latent, q_pe, kv, ctx.visible, cfg.softmax_scale)
        out = torch.einsum("bthr,hvr->bthv", out_latent, w[:, dn:])
        return self.o_proj(out.reshape(b, t, nh * dv))


def latent_attention(q_latent: Tensor, q_pe: Tensor, kv: Tensor, visible: Tensor, scale: float) -> Tensor:
    """MLA's attention in the latent space: queries q_latent [B, T, H, r] and q_pe [B, T, H, dr] over
    cache entries kv [B, S, r + dr], row (b, t) attending to the entries where visible [B, T, S]
    holds -> [B, T, H, r]. A function of its own so a pass can find it (passes/live_attention.py)."""
    kv_latent, kv_pe = kv.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    scores = torch.einsum("bthr,bsr->bhts", q_latent, kv_latent) + torch.einsum("bthd,bsd->bhts", q_pe, kv_pe)
    scores = (scores.float() * scale).masked_fill(~visible[:, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv.dtype)
    return torch.einsum("bhts,bsr->bthr", probs, kv_latent)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts stacked per layer: [E, I, H] for gate/up, [E, H, I] for down."""

    def __init__(self, n: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, intermediate, hidden), requires_grad=False)
        self.up_proj = nn.Parameter(torch.empty(n, intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n, hidden, intermediate), requires_grad=False)

    def forward(self, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        """x [N, H], chosen experts idx [N, k] with weights [N, k] -> [N, H], in fixed shapes.

        Gathering each row's k experts reads only the experts in use and does k/E of the work of
        running every expert on every row. Inductor's CPU lowering turns each one-row product into a
        multiply-and-sum that reads the expert's weights in place, so nothing is copied; elsewhere
        the gathered weights are materialized, k copies per row, and only few rows gather. Measured
        on 2 CPU cores (16 experts, 4 per row, 768 x 256): gathering took 1.6 / 11.5 / 57 ms at
        4 / 128 / 512 rows, every expert masked 5.1 / 17.5 / 60 ms; so past 512 rows (training
        batches) the experts run masked.
        """
        rows, k = idx.shape
        if self.gathers(rows, k, x.device):
            return self.gathered(x, idx, weights)
        return self.masked(x, idx, weights)

    def gathers(self, n: int, k: int, device: torch.device) -> bool:
        """Whether `n` rows routed to `k` experts each gather their experts (else run all, masked)."""
        n_experts = self.gate_proj.shape[0]
        return n * k <= n_experts or (device.type == "cpu" and 4 * k <= n_experts and n <= 512)

    def gathered(self, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        return gathered_experts(x, idx, weights, self.gate_proj, self.up_proj, self.down_proj)

    def masked(self, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        dense = torch.zeros(x.shape[0], self.gate_proj.shape[0], dtype=weights.dtype, device=x.device).scatter_(1, idx, weights)
        act = F.silu(torch.einsum("nh,eih->nei", x, self.gate_proj)) * torch.einsum("nh,eih->nei", x, self.up_proj)
        return torch.einsum("nei,ehi,ne->nh", act, self.down_proj, dense)


def gathered_experts(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """Each row's k experts gathered and applied: x [N, H], idx / weights [N, k], gate / up [E, I, H],
    down [E, H, I] -> [N, H]."""
    act = F.silu(torch.einsum("nh,nkih->nki", x, gate[idx])) * torch.einsum("nh,nkih->nki", x, up[idx])
    return torch.einsum("nki,nkhi,nk->nh", act, down[idx], weights)


class Router(nn.Module):
    """Sigmoid scores; `e_score_correction_bias` steers selection only; group-limited top-k."""

    e_score_correction_bias: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None, "only MoE layers (ModelConfig.is_moe_layer) route"
        self.cfg = cfg
        self.n_experts = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(self.n_experts, cfg.hidden_size), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (expert indices [N, k], routing weights [N, k] float32)."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        n = x.shape[0]
        per_group = self.n_experts // cfg.n_group
        group_scores = choice.view(n, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(n, cfg.n_group, per_group).reshape(n, -1)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(self.gate.n_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.gate(flat)
        out = self.experts(flat, idx, weights.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)



class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.self_attn = MLA(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """Only the norm: the head itself is the target's lm_head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """h' = shared_head.norm(block(eh_proj(cat[enorm(embed(token)), hnorm(h)])))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, moe=cfg.n_routed_experts is not None)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds: Tensor, hidden: Tensor, ctx: Context, layer: int) -> Tensor:  # type: ignore[override]
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, ctx, layer))


class Context:
    """What every layer of one forward shares: the cache, rope tables, where each row writes (slot,
    position), the rows' slots and the visibility mask."""

    def __init__(self, rope: Rope, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor, dtype: torch.dtype) -> None:
        self.rope = rope
        self.cos, self.sin = rope.cos_sin(positions, dtype)
        self.slots = slots
        self.cache = cache
        capacity = cache.shape[2]
        self.write_slot, self.write_position = write_index // capacity, write_index % capacity
        # Row (b, t) sees cache entries 0..positions[b, t] of its slot: the causal mask inside a block
        # falls out of the positions, since a block's rows are written before they are read.
        self.visible = torch.arange(capacity, device=positions.device) <= positions[..., None]

    def store_and_read(self, layer: int, entry: Tensor) -> Tensor:
        """Writes the rows' entries [B, T, D] to the cache of `layer`, then returns that layer's
        entries for the rows' slots [B, S, D].

        The write indexes the whole cache, not a view of it: Inductor writes a graph input in place
        only where the first of its writes is to the input itself. Written through `cache[layer]` (or a
        flat view), a compiled graph copied the whole cache, every layer, slot and position, and back
        on every call."""
        # One layer index per row, not a 0-dim one: Inductor wrote a folded 0-dim index to every layer.
        layers = torch.full_like(self.write_slot, layer)
        self.cache.index_put_((layers, self.write_slot, self.write_position), entry)
        return self.cache[layer][self.slots]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        target = [DecoderLayer(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
        mtp = [MTPLayer(cfg) for _ in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList([*target, *mtp])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3(nn.Module):
    """Target model T and MTP layers M. Caches are passed in: [layers, slots, max_seq_len, cache_dim]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = Rope(cfg)
        self.draft_head: Linear | None = None  # the LM head's rows for draft_ids (restrict_drafts)
        self.draft_ids: Tensor | None
        self.register_buffer("draft_ids", None)

    def restrict_drafts(self, token_ids: Tensor) -> None:
        """Draft only among `token_ids` (FR-Spec): the draft steps score those rows of the LM head,
        copied into a head of their own so a draft step reads only them."""
        w = self.lm_head.weight
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=w.device)
        self.draft_head = Linear(self.cfg.hidden_size, len(ids)).to(device=w.device, dtype=w.dtype)
        self.draft_head.weight.copy_(w[ids])
        self.draft_ids = ids

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary: every token, or draft_ids' when restricted."""
        head = self.lm_head if self.draft_head is None else self.draft_head
        return head(hidden).float()

    @property
    def num_mtp_layers(self) -> int:
        return self.cfg.num_nextn_predict_layers

    def new_cache(self, num_layers: int, num_slots: int, max_seq_len: int) -> Tensor:
        p = self.lm_head.weight
        return torch.zeros(num_layers, num_slots, max_seq_len, self.cfg.cache_dim, dtype=p.dtype, device=p.device)

    def context(self, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor) -> Context:
        return Context(self.rope, positions, write_index, slots, cache, self.lm_head.weight.dtype)

    def forward_target(self, tokens: Tensor, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor) -> Tensor:
        """T over a [B, T] block. Returns post-final-norm hiddens [B, T, H] and writes each row's latent
        to cache entry `write_index` (flat over slots x positions)."""
        ctx = self.context(positions, write_index, slots, cache)
        x = self.model.embed_tokens(tokens)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, ctx, i)
        return self.model.norm(x)

    def forward_mtp(self, layer: int, tokens: Tensor, hidden: Tensor, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor) -> Tensor:
        """MTP layer `layer` over a [B, T] block: row (b, t) takes the token at positions+1 and the hidden
        from positions. Returns its post-shared_head.norm hiddens; `cache` is the MTP cache."""
        ctx = self.context(positions, write_index, slots, cache)
        mtp = self.model.layers[self.cfg.num_hidden_layers + layer]
        return mtp(self.model.embed_tokens(tokens), hidden, ctx, layer)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
