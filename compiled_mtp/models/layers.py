"""The building blocks every model family shares: linears, norms, rotary embedding, the MoE with its
sigmoid group-limited router, decoder and MTP layers around a family's attention, the row cache
and the per-forward context. A family (deepseek_v3.py, glm4_moe.py) adds its attention and config.

Every forward takes a [B, T] block of rows (B requests, T rows each) plus explicit positions, cache
write indices and cache slots, so one code path serves prefill chunks, verify blocks and draft
steps, and torch.compile can trace it whole: no data-dependent shapes, no `.item()`, no branching on
tensor values. The fixed-shape experts (`gathered_experts`) are found by name by passes/group_experts.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import RopeConfig, yarn_mscale


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
    """Rotary embedding over `dim` channels, with optional YaRN frequency scaling."""

    inv_freq: Tensor

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool) -> None:
        super().__init__()
        self.interleave = interleave
        inv_freq, self.attention_factor = _rope_frequencies(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(
            dtype
        )

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # Interleaved checkpoints rotate (x0, x1), (x2, x3), ...; either way the output is laid out
        # [rotated first halves | rotated second halves], identically for q and k, so dot products agree.
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_frequencies(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type != "yarn":
        return 1.0 / pos_freqs, 1.0
    if rope.attention_factor is not None:
        factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

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


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return dense_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def dense_mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """SwiGLU: x [..., H], gate / up [I, H], down [H, I] -> [..., H]. A function of its own, so that a
    pass can find its calls (passes/fuse_dense_mlp.py)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


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
        the gathered weights are materialized, k copies per row, and only few rows gather; past 512
        rows (training batches) the experts run masked (docs/design.md, "The decode loop as graphs").
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
        dense = torch.zeros(
            x.shape[0], self.gate_proj.shape[0], dtype=weights.dtype, device=x.device
        ).scatter_(1, idx, weights)
        act = F.silu(torch.einsum("nh,eih->nei", x, self.gate_proj)) * torch.einsum(
            "nh,eih->nei", x, self.up_proj
        )
        return torch.einsum("nei,ehi,ne->nh", act, self.down_proj, dense)


def gathered_experts(
    x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor
) -> Tensor:
    """Each row's k experts gathered and applied: x [N, H], idx / weights [N, k], gate / up [E, I, H],
    down [E, H, I] -> [N, H]."""
    act = F.silu(torch.einsum("nh,nkih->nki", x, gate[idx])) * torch.einsum("nh,nkih->nki", x, up[idx])
    return torch.einsum("nki,nkhi,nk->nh", act, down[idx], weights)


class Router(nn.Module):
    """Sigmoid scores; `e_score_correction_bias` steers selection only; group-limited top-k."""

    e_score_correction_bias: Tensor

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (expert indices [N, k], routing weights [N, k] float32)."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        n = x.shape[0]
        per_group = cfg.n_routed_experts // cfg.n_group
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
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.gate(flat)
        out = self.experts(flat, idx, weights.to(x.dtype)).view(shape)
        if self.shared_experts is not None:
            # On x's own shape: on the flat rows, Inductor joins the last product to this sum (addmm),
            # and fuse_dense_mlp no longer finds the whole MLP.
            out = out + self.shared_experts(x)
        return out


class Attention(nn.Module):
    """A family's attention, split at the cache: `entries` gives what each row writes to the cache,
    `attend` each row's output from the entries its slot holds. An MTP layer writes the entries of
    every row of a block but attends from the rows whose output is used only."""

    def forward(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        return self.attend(x, ctx, ctx.store_and_read(layer, self.entries(x, ctx)))

    def entries(self, x: Tensor, ctx: Context) -> Tensor:
        """The rows' cache entries [B, T, D] from the normed input x [B, T, H]."""
        raise NotImplementedError

    def entry_modules(self) -> list[nn.Module]:
        """The modules whose weights `entries` multiplies each row by."""
        raise NotImplementedError

    def attend(self, x: Tensor, ctx: Context, kv: Tensor) -> Tensor:
        """The rows' attention output [B, T, H] over their slots' cache entries kv [B, S, D]."""
        raise NotImplementedError


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `attention` is the family's."""

    def __init__(self, cfg: Any, attention: Attention, moe: bool) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """Only the norm: the head itself is the target's lm_head."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """h' = shared_head.norm(block(eh_proj(cat[enorm(embed(token)), hnorm(h)])))."""

    def __init__(self, cfg: Any, attention: Attention, moe: bool) -> None:
        super().__init__(cfg, attention, moe)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)

    def forward(  # type: ignore[override]
        self, embeds: Tensor, hidden: Tensor, ctx: Context, layer: int, rows: Tensor | None = None
    ) -> Tensor:
        """h' for every row of the [B, T] block, [B, T, H]; with `rows` ([B] long) for row rows[b] of
        each request only, [B, H], though every row still writes its cache entry."""
        x = self._input(embeds, hidden)
        if rows is None:
            return self.shared_head.norm(super().forward(x, ctx, layer))
        return self.shared_head.norm(self._block_at(x, ctx, layer, rows))

    def every_row_modules(self) -> list[nn.Module]:
        """The modules forward runs on every row of a block, also where `rows` picks one a request:
        the input projection and the attention's cache entries' (norms aside, which multiply nothing)."""
        return [self.eh_proj, *self.self_attn.entry_modules()]

    def write_entries(self, embeds: Tensor, hidden: Tensor, ctx: Context, layer: int) -> None:
        """Every row's cache entry, as forward writes it, and nothing past it (the slots' entries it
        reads back go unused, and a compiled graph drops the read)."""
        self._entries(self._input(embeds, hidden), ctx, layer)

    def _input(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def _entries(self, x: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        """The block's normed input and, once every row's entry is written, its slots' entries."""
        normed = self.input_layernorm(x)
        return normed, ctx.store_and_read(layer, self.self_attn.entries(normed, ctx))

    def _block_at(self, x: Tensor, ctx: Context, layer: int, rows: Tensor) -> Tensor:
        """The block's output at rows[b] of each request, [B, H], after writing every row's cache
        entry. A catch-up or extend block uses one row of its 16 or K + 1 and a prefill chunk one of
        64, so the query, attention, MLP and norms run on that row alone."""
        normed, kv = self._entries(x, ctx, layer)
        x = gather_rows(x, rows)[:, None]
        x = x + self.self_attn.attend(gather_rows(normed, rows)[:, None], ctx.at(rows), kv)
        return (x + self.mlp(self.post_attention_layernorm(x)))[:, 0]


class RowCache:
    """The cache layout of a family whose attention keeps one entry of `width` numbers per token:
    a tensor [layers, slots, max_seq_len, width]. DeepSeek-V3's entry is its MLA latent and rope
    key, GLM-4 MoE's its keys and values of every KV head."""

    def __init__(self, width: int) -> None:
        self.width = width

    def allocate(
        self, num_layers: int, num_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.zeros(num_layers, num_slots, max_seq_len, self.width, dtype=dtype, device=device)

    def store_and_read(
        self,
        cache: Tensor,
        layer: int,
        entry: Tensor,
        write_slot: Tensor,
        write_position: Tensor,
        slots: Tensor,
    ) -> Tensor:
        """Writes the rows' entries [B, T, D] to the cache of `layer` at (write_slot, write_position),
        then returns that layer's entries for the rows' slots [B, S, D].

        The write indexes the whole cache, not a view of it: Inductor writes a graph input in place
        only where the first of its writes is to the input itself. Written through `cache[layer]` (or a
        flat view), a compiled graph copied the whole cache, every layer, slot and position, and back
        on every call."""
        # One layer index per row, not a 0-dim one: Inductor wrote a folded 0-dim index to every layer.
        layers = torch.full_like(write_slot, layer)
        cache.index_put_((layers, write_slot, write_position), entry)
        return cache[layer][slots]


class Context:
    """What every layer of one forward shares: the cache and its layout, rope tables, where each row
    writes (slot, position), the rows' slots and the visibility mask."""

    def __init__(
        self,
        rope: Rope,
        layout: RowCache,
        positions: Tensor,
        write_index: Tensor,
        slots: Tensor,
        cache: Tensor,
        dtype: torch.dtype,
    ) -> None:
        self.rope = rope
        self.cos, self.sin = rope.cos_sin(positions, dtype)
        self.layout = layout
        self.slots = slots
        self.cache = cache
        capacity = cache.shape[2]
        self.write_slot, self.write_position = write_index // capacity, write_index % capacity
        # Row (b, t) sees cache entries 0..positions[b, t] of its slot: the causal mask inside a block
        # falls out of the positions, since a block's rows are written before they are read.
        self.visible = torch.arange(capacity, device=positions.device) <= positions[..., None]

    def store_and_read(self, layer: int, entry: Tensor) -> Tensor:
        """Writes the rows' entries [B, T, D] to the cache of `layer`, then returns that layer's
        entries for the rows' slots [B, S, D]."""
        return self.layout.store_and_read(
            self.cache, layer, entry, self.write_slot, self.write_position, self.slots
        )

    def at(self, rows: Tensor) -> Context:
        """This context at row rows[b] of each request b, as a [B, 1] block: those rows' rope angles
        and visibility. For attending only: the whole block's entries are written through `self`."""
        # Field by field, not copy.copy or __dict__.update, which Dynamo before torch 2.13 cannot trace.
        row = Context.__new__(Context)
        for name in ("rope", "layout", "slots", "cache", "write_slot", "write_position"):
            setattr(row, name, getattr(self, name))
        row.cos, row.sin, row.visible = (
            gather_rows(t, rows)[:, None] for t in (self.cos, self.sin, self.visible)
        )
        return row


class Backbone(nn.Module):
    """Embedding, the target's layers, then the MTP layers (`model.layers[num_hidden_layers + i]`, as
    checkpoints number them), and the final norm. `attention()` builds one layer's attention."""

    def __init__(self, cfg: Any, attention: Callable[[], Attention], mtp_moe: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        target = [DecoderLayer(cfg, attention(), cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
        mtp = [MTPLayer(cfg, attention(), mtp_moe) for _ in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList([*target, *mtp])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, ...], index [B] -> x[b, index[b]] as [B, ...]."""
    shape = (x.shape[0], 1) + x.shape[2:]
    idx = index.view(-1, *([1] * (x.dim() - 1))).expand(shape)
    return x.gather(1, idx).squeeze(1)
