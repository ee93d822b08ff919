"""DeepSeek-V4 (`deepseek_v4`): shared-KV multi-query attention with a sliding window plus compressed
long-range entries, hash- and score-routed MoE, and hyper-connections, as HF transformers defines it.

- Attention: `wq_a -> q_norm -> wq_b`, a weightless per-head RMSNorm, one KV head (`wkv -> norm`) read as
  both key and value, a learned per-head sink in the softmax, interleaved RoPE on each head's trailing
  `qk_rope_head_dim` channels (the output's rope slice rotated back), and a grouped output projection
  (`wo_a` per group of heads, then `wo_b`). Every layer attends to its last `sliding_window` positions;
  a `compressed_sparse_attention` (CSA) layer also to pooled entries of overlapping windows of m
  positions, of which a lightning indexer keeps the top `index_topk` per query; a
  `heavily_compressed_attention` (HCA) layer to pooled entries of disjoint windows, all of them. Query t
  sees compressed entry w only if w < (t + 1) // m. Compressed layers use the `compress` rope.
- MoE: sqrtsoftplus (or sigmoid) scores, top-k over score + bias, or the experts `tid2eid[token]` on the
  first (`hash_moe`) layers, so the target needs each row's token id; SwiGLU clamped at `swiglu_limit`.
- Hyper-connections: the residual is `hc_mult` streams; each block mixes them in and out with sigmoid
  pre/post weights and a Sinkhorn-normalised matrix, and `hc_head` collapses them before the final norm.
- The MTP layer (`mtp.{i}.*`): e_proj(enorm(embed(token))) + h_proj(hnorm(h)) over the target's
  streams h, one block with sliding attention and score-routed MoE, and its own hc_head and norm
  before the shared head. `forward_target` and `forward_mtp` return the streams flattened
  ([.., hc_mult * hidden_size], `hidden_width`); `logits` and `draft_logits` collapse them.

Parameters carry the names HF's `save_pretrained` writes (DeepSeek's own: `attn.wq_a`, `ffn.experts.{e}.w1`,
`hc_attn_fn`, `head.weight`, ...); routed experts are stacked per layer as for the other families. The
checkpoints DeepSeek publishes differ in a few names (`PUBLISHED_LAYOUT`) and come quantized: FP8
block-scaled linears and FP8 or FP4 routed experts, their scales in `*.scale` (checkpoint.py).

The cache keeps one row per position per layer (a `RowCache`): the rotated KV head, and on compressed
layers the compressor's (and the indexer's) projected values and gate logits of that position. The
compressed entries are pooled from those rows inside attention on every forward, for the whole slot,
and entry w is only visible to queries at positions >= (w + 1) * m - 1, so it reads rows <= t only.
This recomputes the pooling (O(max_seq_len) per layer and step, as the attention over the cache
already is) instead of storing compressed entries, overlap state and partial-window buffers: the
rows are the only state, a verify row rejected or padded is overwritten before any later step reads
it, and no compressed state can be stale or half-written. Rows are as wide as the widest layer's
(sliding layers and the MTP layer use the first `head_dim` numbers of theirs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import (
    CheckpointError,
    RopeConfig,
    eos_ids,
    fp8_block_size,
    need,
    need_sizes,
    reading,
    rope_config,
)
from .family import CausalLM, KeyLayout
from .layers import Context, Linear, RMSNorm, Rope, RowCache, gather_rows

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the released configs' `compress_ratios`
_SCORE_FUNCTIONS = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}
# config.json's expert_dtype: how a quantized checkpoint stores its routed experts.
_EXPERT_DTYPES = ("fp8", "fp4")

# The keys DeepSeek publishes, from the names HF's save_pretrained writes (transformers'
# conversion_mapping "deepseek_v4", read backwards: HF renames `kv_norm` to `norm`, and keeps the
# top-level keys under `model.`). The published MTP layer may carry copies of the embedding
# (`mtp.{i}.emb.*`) and head, which DeepSeek's own loader drops for the shared ones; so does this one.
PUBLISHED_LAYOUT = KeyLayout(
    marker="embed.weight",
    renames=(
        (r"^model\.embed_tokens\.", "embed."),
        (r"^model\.norm\.", "norm."),
        (r"^model\.hc_head\.hc_", "hc_head_"),
        (r"^model\.layers\.", "layers."),
        (r"\.attn\.norm\.", ".attn.kv_norm."),
    ),
    scale=(r"\.weight$", ".scale"),
    copies=r"^mtp\.\d+\.(emb\..*|head\.weight)$",
)


@dataclass(frozen=True)
class DeepseekV4Config:
    """The subset of a DeepSeek-V4 config.json that changes the computation."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int = 4
    hca_rate: int = 128
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    rope_theta: float = 10000.0
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None

    def compress_rate(self, layer_type: str) -> int:
        """m of a layer type: the positions pooled into one compressed entry (0: sliding only)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[layer_type]

    def cache_width(self, layer_type: str) -> int:
        """A cache row of a layer of this type: the KV head, then the compressor's projected values
        and gate logits ([kv | gate], twice as wide for CSA's two overlapping series), then the
        indexer's."""
        hd, ci = self.head_dim, self.index_head_dim
        return {SLIDING: hd, CSA: hd + 4 * hd + 4 * ci, HCA: hd + 2 * hd}[layer_type]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DeepseekV4Config:
        """Validate and convert an HF config dict; errors name `source` and the field."""
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')"
            )
        _check_expert_dtype(raw, source)
        with reading(source):
            n = int(raw["num_hidden_layers"])
            head_dim = int(raw["head_dim"])
            partial = raw.get("partial_rotary_factor")
            rope_dim = int(head_dim * float(partial)) if partial else int(raw.get("qk_rope_head_dim") or 64)
            rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                num_hidden_layers=n,
                num_attention_heads=int(raw["num_attention_heads"]),
                head_dim=head_dim,
                q_lora_rank=int(raw["q_lora_rank"]),
                qk_rope_head_dim=rope_dim,
                n_routed_experts=int(raw["n_routed_experts"]),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                layer_types=_layer_types(raw, n),
                mlp_layer_types=_mlp_layer_types(raw, n),
                csa_rate=int(rates[CSA]),
                hca_rate=int(rates[HCA]),
                scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
                rope_theta=_main_rope_theta(raw),
                compress_rope=_compress_rope(raw, source),
                hc_mult=int(raw.get("hc_mult", 4)),
                hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(raw.get("hc_eps", 1e-6)),
                swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
                sliding_window=int(raw.get("sliding_window", 128)),
                o_groups=int(raw.get("o_groups", 8)),
                o_lora_rank=int(raw.get("o_lora_rank", 1024)),
                index_n_heads=int(raw.get("index_n_heads", 64)),
                index_head_dim=int(raw.get("index_head_dim", 128)),
                index_topk=int(raw.get("index_topk", 512)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
                num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
                eos_token_ids=eos_ids(raw),
                fp8_block_size=fp8_block_size(raw, source),
            )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        need_sizes(self, source)
        for name, types, allowed in (
            ("layer_types", self.layer_types, (SLIDING, CSA, HCA)),
            ("mlp_layer_types", self.mlp_layer_types, ("hash_moe", "moe")),
        ):
            need(
                len(types) == self.num_hidden_layers,
                source,
                f"{name} must have num_hidden_layers={self.num_hidden_layers} entries, got {len(types)}",
            )
            bad = sorted(set(types) - set(allowed))
            need(not bad, source, f"{name} entries must be in {list(allowed)}, got {bad}")
        rd = self.qk_rope_head_dim
        need(
            rd % 2 == 0 and 0 < rd <= min(self.head_dim, self.index_head_dim),
            source,
            f"the rotary width (head_dim x partial_rotary_factor) must be even and in "
            f"[2, {min(self.head_dim, self.index_head_dim)}] (head_dim, index_head_dim), got {rd}",
        )
        need(
            self.num_attention_heads * self.head_dim % self.o_groups == 0,
            source,
            f"o_groups must divide num_attention_heads x head_dim, got {self.o_groups}",
        )
        need(
            self.scoring_func in _SCORE_FUNCTIONS,
            source,
            f"scoring_func must be in {list(_SCORE_FUNCTIONS)}, got {self.scoring_func!r}",
        )
        need(
            1 <= self.num_experts_per_tok <= self.n_routed_experts,
            source,
            f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
            f"got {self.num_experts_per_tok}",
        )
        need(self.csa_rate >= 1 and self.hca_rate >= 1, source, "compress_rates must be >= 1")
        need(self.sliding_window >= 1, source, f"sliding_window must be >= 1, got {self.sliding_window}")
        need(self.index_topk >= 1, source, f"index_topk must be >= 1, got {self.index_topk}")
        # draft_logits collapses the streams with the MTP layer's own hc_head, and the published
        # checkpoints have one MTP layer.
        need(
            self.num_nextn_predict_layers <= 1,
            source,
            f"num_nextn_predict_layers must be in [0, 1] for deepseek_v4, got {self.num_nextn_predict_layers}",
        )


def _check_expert_dtype(raw: dict[str, Any], source: str) -> None:
    """expert_dtype (top level, as V4 has it, or in quantization_config, where V4.1 moves it) must
    name a storage the loader reads; which one each weight is, its own dtype tells."""
    quant = raw.get("quantization_config") or {}
    field_name = "quantization_config.expert_dtype" if "expert_dtype" in quant else "expert_dtype"
    value = quant.get("expert_dtype", raw.get("expert_dtype"))
    if value is not None and value not in _EXPERT_DTYPES:
        raise CheckpointError(
            f"{source}: {field_name} {value!r} is not supported (supported: {', '.join(_EXPERT_DTYPES)})"
        )


def _layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    """Explicit `layer_types`, else the released `compress_ratios`, else HF's default schedule."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if raw.get("compress_ratios"):
        return tuple(_RATIO_LAYER_TYPE.get(int(r), str(r)) for r in raw["compress_ratios"])[:n]
    return tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types"):
        return tuple(raw["mlp_layer_types"])
    hashed = int(raw.get("num_hash_layers", 3))
    return tuple(["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed))


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def _compress_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """The compressed layers' rope: `rope_parameters.compress` (as HF writes it), or a flat YaRN
    `rope_parameters` / `rope_scaling` at `compress_rope_theta`. YaRN scales cos/sin by
    `attention_factor`, 1 unless given (as HF sets it for V4)."""
    params = _rope_params(raw)
    theta = float(raw.get("compress_rope_theta", 160000.0))
    if isinstance(params.get("compress"), dict):
        params = dict(params["compress"])
        theta = float(params.get("rope_theta", theta))
    return rope_config(params, theta, raw, f"{source}: compress rope", attention_factor=1.0)


def _main_rope_theta(raw: dict[str, Any]) -> float:
    main = _rope_params(raw).get("main")
    return float((main if isinstance(main, dict) else {}).get("rope_theta", raw.get("rope_theta", 10000.0)))


# ----------------------------------------------------------------------------- rope and context


class V4Rope(Rope):
    """The `main` rope (sliding layers) with the `compress` one (compressed layers, their pooled
    entries and the indexer) beside it; both rotate adjacent pairs of the trailing channels."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(RopeConfig(theta=cfg.rope_theta), cfg.qk_rope_head_dim, interleave=True)
        self.compress = Rope(cfg.compress_rope, cfg.qk_rope_head_dim, interleave=True)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE on the trailing 2 x cos.shape[-1] channels of x, keeping their layout (the
    values of V4's attention are its rotated keys, so the output projection sees this layout): pair
    i of them rotates by angle i; the leading channels pass through. The rotation runs in float32 and is
    cast once."""
    rd = 2 * cos.shape[-1]
    x1, x2 = x[..., -rd::2].float(), x[..., -rd + 1 :: 2].float()
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


class V4Context(Context):
    """Context plus what V4's layers read: the rows' token ids (hash routing), the compress rope at
    the rows' positions, the sliding-window mask and the compress rope for pooled entries."""

    def __init__(
        self,
        rope: V4Rope,
        layout: RowCache,
        tokens: Tensor,
        positions: Tensor,
        write_index: Tensor,
        slots: Tensor,
        cache: Tensor,
        window: int,
    ) -> None:
        super().__init__(rope, layout, positions, write_index, slots, cache, cache.dtype)
        self.compress_rope = rope.compress
        self.tokens = tokens
        self.positions = positions
        self.compress_cos, self.compress_sin = rope.compress.cos_sin(positions, cache.dtype)
        keys = torch.arange(cache.shape[2], device=positions.device)
        self.window = self.visible & (keys > positions[..., None] - window)

    def entry_rope(self, entries: int, rate: int) -> tuple[Tensor, Tensor]:
        """The compress rope of pooled entries 0..entries-1, entry w at position w * rate."""
        positions = torch.arange(entries, device=self.positions.device) * rate
        return self.compress_rope.cos_sin(positions, self.cache.dtype)


# ----------------------------------------------------------------------------- attention


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(RMSNorm):
    """RMSNorm with a float32 weight (`DeepseekV4.float32_parameter`): it scales the float32
    normalised input, and the product is cast to the input's dtype once, at the end."""

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


class Compressor(nn.Module):
    """Pools windows of `rate` positions into one entry of `dim` numbers: a softmax over the window
    of gate logits plus a per-offset bias (`ape`) weighs the projected values, then `norm` and the
    compress rope at the window's first position. `overlap` (CSA): each position projects two
    series, and entry w pools window w - 1's first series with window w's second."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = Linear(hidden, series * dim)
        self.wgate = Linear(hidden, series * dim)
        self.ape = nn.Parameter(torch.empty(rate, series * dim), requires_grad=False)
        self.norm = V4RMSNorm(dim, eps)

    @property
    def width(self) -> int:
        """The numbers a position stores for it in its cache row."""
        return 2 * self.wkv.weight.shape[0]

    def project(self, x: Tensor) -> Tensor:
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def entries(self, rows: Tensor, ctx: V4Context) -> Tensor:
        """rows [B, S, width] (this compressor's part of a slot's cache rows) -> the S // rate
        entries [B, S // rate, dim]; entry w reads rows < (w + 1) * rate only."""
        b, s, _ = rows.shape
        n, m, d = s // self.rate, self.rate, self.dim
        half = self.width // 2
        kv = rows[:, : n * m, :half].reshape(b, n, m, half)
        gate = rows[:, : n * m, half:].reshape(b, n, m, half) + self.ape
        if self.overlap:
            # Window w - 1's first series joins window w's second; window 0 has no predecessor (a
            # zero value, gated out). [:, :n] keeps no window when the cache holds none.
            prev_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))[:, :n]
            prev_gate = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))[:, :n]
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        cos, sin = ctx.entry_rope(n, m)
        return rotate(self.norm(pooled), cos, sin)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor at `index_head_dim`, and per query the
    score sum_h w_h relu(q_h . k) over the visible entries, of which the top `index_topk` are kept."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.cfg = cfg
        h, ni, ci = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        self.compressor = Compressor(h, ci, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, ni * ci)
        self.weights_proj = Linear(h, ni)

    def select(self, x: Tensor, q_residual: Tensor, rows: Tensor, visible: Tensor, ctx: V4Context) -> Tensor:
        """The entries each query attends to: visible [B, T, E] narrowed to the top `index_topk`."""
        cfg = self.cfg
        b, t, _ = x.shape
        keys = self.compressor.entries(rows, ctx)  # [B, E, ci]
        q = self.wq_b(q_residual).view(b, t, cfg.index_n_heads, cfg.index_head_dim)
        q = rotate(q, ctx.compress_cos[:, :, None], ctx.compress_sin[:, :, None])
        scores = torch.einsum("bthd,bsd->bths", q.float(), keys.float()).relu() * cfg.index_head_dim**-0.5
        weights = self.weights_proj(x).float() * cfg.index_n_heads**-0.5
        scores = (scores * weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        top = scores.topk(min(cfg.index_topk, scores.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible


class Attention(nn.Module):
    """V4 attention of one layer type over its cache rows (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, layer_type: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.rate = cfg.compress_rate(layer_type)
        h, nh, hd, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.wq_a = Linear(h, cfg.q_lora_rank)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, nh * hd)
        self.wkv = Linear(h, hd)
        self.norm = V4RMSNorm(hd, eps)
        self.wo_a = Linear(nh * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, h)
        self.attn_sink = nn.Parameter(torch.empty(nh), requires_grad=False)
        self.compressor = Compressor(h, hd, self.rate, layer_type == CSA, eps) if self.rate else None
        self.indexer = Indexer(cfg) if layer_type == CSA else None

    def forward(self, x: Tensor, ctx: V4Context, layer: int) -> Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        cos, sin = self._rope(ctx)
        q_residual = self.q_norm(self.wq_a(x))
        q = unit_rms(self.wq_b(q_residual).view(b, t, nh, hd), cfg.rms_norm_eps)
        q = rotate(q, cos[:, :, None], sin[:, :, None])
        rows = ctx.store_and_read(layer, self._entry(x, ctx))
        keys, visible = rows[..., :hd], ctx.window
        if self.compressor is not None:
            end = hd + self.compressor.width
            pooled = self.compressor.entries(rows[..., hd:end], ctx)
            ready = (
                torch.arange(pooled.shape[1], device=x.device) < ((ctx.positions + 1) // self.rate)[..., None]
            )
            if self.indexer is not None:
                index_rows = rows[..., end : end + self.indexer.compressor.width]
                ready = self.indexer.select(x, q_residual, index_rows, ready, ctx)
            keys, visible = torch.cat([keys, pooled], dim=1), torch.cat([visible, ready], dim=-1)
        out = sink_attention(q, keys, visible, self.attn_sink, hd**-0.5)
        # Values are the rotated keys: rotating the output back at the query's position leaves each
        # entry's contribution a function of its distance to the query.
        out = rotate(out, cos[:, :, None], -sin[:, :, None])
        groups = out.reshape(b, t, cfg.o_groups, -1)
        w = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("btgi,goi->btgo", groups, w).flatten(2))

    def write_entries(self, x: Tensor, ctx: V4Context, layer: int) -> None:
        """Every row's cache row, as forward writes it, and nothing past it (the rows read back go
        unused, and a compiled graph drops the read)."""
        ctx.store_and_read(layer, self._entry(x, ctx))

    def _rope(self, ctx: V4Context) -> tuple[Tensor, Tensor]:
        return (ctx.compress_cos, ctx.compress_sin) if self.rate else (ctx.cos, ctx.sin)

    def _entry(self, x: Tensor, ctx: V4Context) -> Tensor:
        """The rows' cache rows: the rotated key, then the compressors' projections, padded to the width."""
        entry = rotate(self.norm(self.wkv(x)), *self._rope(ctx))
        if self.compressor is not None:
            entry = torch.cat([entry, self.compressor.project(x)], dim=-1)
        if self.indexer is not None:
            entry = torch.cat([entry, self.indexer.compressor.project(x)], dim=-1)
        return F.pad(entry, (0, ctx.layout.width - entry.shape[-1]))


def sink_attention(q: Tensor, kv: Tensor, visible: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """Queries q [B, T, H, D] over entries kv [B, S, D] (keys and values alike) where visible
    [B, T, S] holds, with a per-head sink logit in the softmax that takes no value -> [B, T, H, D]."""
    b, t, h, _ = q.shape
    scores = (torch.einsum("bthd,bsd->bhts", q, kv) * scale).float()
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(b, h, t, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhts,bsd->bthd", probs.to(kv.dtype), kv)


# ----------------------------------------------------------------------------- MoE


class Gate(nn.Module):
    """The router: scores from `scoring_func`; the experts from top-k over score + `bias`, or from
    `tid2eid[token]` on a hash layer; weights the chosen scores, normalised and scaled."""

    bias: Tensor
    tid2eid: Tensor

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.hashed = hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H], tokens [N] -> (expert indices [N, k], weights [N, k] in x's dtype). Scores are
        in x's dtype as HF's; only the selection adds the float32 bias."""
        cfg = self.cfg
        scores = _SCORE_FUNCTIONS[cfg.scoring_func](F.linear(x, self.weight))
        if self.hashed:
            idx = self.tid2eid[tokens]
        else:
            idx = (scores + self.bias).topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        return idx, weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """SwiGLU with the gate clamped above and the up projection on both sides at `limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(cfg.hidden_size, cfg.moe_intermediate_size)
        self.w2 = Linear(cfg.moe_intermediate_size, cfg.hidden_size)
        self.w3 = Linear(cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class Experts(nn.Module):
    """Routed experts stacked per layer: w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I]. Each
    row gathers its k experts' weights, in fixed shapes (layers.Experts measures the cost; unlike it,
    there is no masked path for batches of hundreds of rows)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, i, h), requires_grad=False)

    def forward(self, x: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        # Each expert's output is weighted in x's dtype before the k are summed, as HF does.
        gate = torch.einsum("nh,nkih->nki", x, self.w1[idx])
        up = torch.einsum("nh,nkih->nki", x, self.w3[idx])
        down = torch.einsum("nki,nkhi->nkh", clamped_swiglu(gate, up, self.limit), self.w2[idx])
        return (down * weights[..., None]).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: Tensor, tokens: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.gate(flat, tokens.reshape(-1))
        return (self.experts(flat, idx, weights) + self.shared_experts(flat)).view(x.shape)


# ----------------------------------------------------------------------------- hyper-connections


def hc_mix(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: DeepseekV4Config) -> tuple[Tensor, ...]:
    """The streams x [B, T, n, H] -> (post [B, T, n], comb [B, T, n, n], the block's input [B, T, H]):
    sigmoid pre and post weights and a Sinkhorn-normalised mixing matrix, from one projection of the
    normalised streams."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    mixes = F.linear(unit_rms(x.flatten(2).float(), cfg.rms_norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return post, comb, (pre[..., None] * x).sum(dim=2).to(x.dtype)


def hc_collapse(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: DeepseekV4Config) -> Tensor:
    """hc_head: the streams x [..., n, H] -> one [..., H], weighted by sigmoid(projection)."""
    mixes = F.linear(unit_rms(x.flatten(-2).float(), cfg.rms_norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + cfg.hc_eps
    return (pre[..., None] * x).sum(dim=-2).to(x.dtype)


def _stream_params(cfg: DeepseekV4Config, rows: int) -> tuple[nn.Parameter, nn.Parameter]:
    return (
        nn.Parameter(torch.empty(rows, cfg.hc_mult * cfg.hidden_size), requires_grad=False),
        nn.Parameter(torch.empty(rows), requires_grad=False),
    )


class HyperHead(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.hc_fn, self.hc_base = _stream_params(cfg, cfg.hc_mult)
        self.hc_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return hc_collapse(x, self.hc_fn, self.hc_base, self.hc_scale, self.cfg)


class Block(nn.Module):
    """A decoder block over the streams: attention, then MoE, each entered and left through its
    hyper-connection."""

    def __init__(self, cfg: DeepseekV4Config, layer_type: str, hashed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer_type)
        self.ffn = MoE(cfg, hashed)
        self.attn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rows = (2 + cfg.hc_mult) * cfg.hc_mult
        self.hc_attn_fn, self.hc_attn_base = _stream_params(cfg, rows)
        self.hc_ffn_fn, self.hc_ffn_base = _stream_params(cfg, rows)
        self.hc_attn_scale = nn.Parameter(torch.empty(3), requires_grad=False)
        self.hc_ffn_scale = nn.Parameter(torch.empty(3), requires_grad=False)

    def forward(self, x: Tensor, ctx: V4Context, layer: int) -> Tensor:
        post, comb, h = self._attn_mix(x)
        x = _recombine(x, post, comb, self.attn(self.attn_norm(h), ctx, layer))
        post, comb, h = hc_mix(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return _recombine(x, post, comb, self.ffn(self.ffn_norm(h), ctx.tokens))

    def _attn_mix(self, x: Tensor) -> tuple[Tensor, ...]:
        return hc_mix(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)


def _recombine(x: Tensor, post: Tensor, comb: Tensor, out: Tensor) -> Tensor:
    """The block's output spread over the streams by `post`, plus the streams mixed by comb^T."""
    return post.to(x.dtype)[..., None] * out[..., None, :] + comb.to(x.dtype).transpose(-1, -2) @ x


class MTPBlock(Block):
    """h' = block(e_proj(enorm(embed(token))) + h_proj(hnorm(h))) over the streams; its logits
    come from its own hc_head and norm (`collapse`)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg, SLIDING, hashed=False)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = Linear(h, h)
        self.h_proj = Linear(h, h)
        self.enorm = V4RMSNorm(h, eps)
        self.hnorm = V4RMSNorm(h, eps)
        self.norm = V4RMSNorm(h, eps)
        self.hc_head_fn, self.hc_head_base = _stream_params(cfg, cfg.hc_mult)
        self.hc_head_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, embeds: Tensor, streams: Tensor, ctx: V4Context, layer: int) -> Tensor:  # type: ignore[override]
        return super().forward(self._input(embeds, streams), ctx, layer)

    def write_entries(self, embeds: Tensor, streams: Tensor, ctx: V4Context, layer: int) -> None:
        """Every row's cache row, as forward writes it, and nothing past it."""
        h = self._attn_mix(self._input(embeds, streams))[2]
        self.attn.write_entries(self.attn_norm(h), ctx, layer)

    def _input(self, embeds: Tensor, streams: Tensor) -> Tensor:
        return self.e_proj(self.enorm(embeds))[:, :, None] + self.h_proj(self.hnorm(streams))

    def collapse(self, streams: Tensor) -> Tensor:
        return self.norm(
            hc_collapse(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        )


class Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            Block(cfg, kind, mlp == "hash_moe") for kind, mlp in zip(cfg.layer_types, cfg.mlp_layer_types)
        )
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4(CausalLM):
    """DeepSeek-V4's target model T and MTP layer M. Caches: [layers, slots, max_seq_len, the widest
    layer's row]."""

    model_type = "deepseek_v4"
    layouts = (PUBLISHED_LAYOUT,)

    def __init__(self, cfg: DeepseekV4Config) -> None:
        width = max(cfg.cache_width(kind) for kind in (*cfg.layer_types, SLIDING))
        super().__init__(cfg, Backbone(cfg), width)
        self.mtp = nn.ModuleList(MTPBlock(cfg) for _ in range(cfg.num_nextn_predict_layers))

    @property
    def hidden_width(self) -> int:
        return self.cfg.hc_mult * self.cfg.hidden_size

    def make_rope(self) -> Rope:
        return V4Rope(self.cfg)

    def float32_parameter(self, name: str) -> bool:
        """What V4 keeps in float32 (HF's `_keep_in_fp32_modules_strict`; DeepSeek's own code builds the
        MTP layer's alike): every norm's weight, the hyper-connections' `hc_*` (hc_head's too),
        the attention sinks, the compressors' position biases (`ape`) and the routers' biases."""
        owner, _, leaf = name.rpartition(".")
        module = self.get_submodule(owner)
        return (
            isinstance(module, V4RMSNorm)
            or leaf.startswith("hc_")
            or leaf in ("attn_sink", "ape")
            or (isinstance(module, Gate) and leaf == "bias")
        )

    def checkpoint_keys(self, name: str, param: Tensor) -> list[str]:
        """HF's save_pretrained names the head `head.weight` and each routed expert's weights
        `ffn.experts.{e}.w1.weight`."""
        if name == "lm_head.weight":
            return ["head.weight"]
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".ffn.experts"):
            return [f"{prefix}.{e}.{leaf}.weight" for e in range(param.shape[0])]
        return [name]

    def mtp_key_prefix(self, layer: int) -> str:
        return f"mtp.{layer}."

    def mtp_shared_copies(self) -> dict[str, str]:
        return {}  # V4's MTP layer shares the embedding and head without copies

    def mtp_key(self, key: str) -> tuple[int, str] | None:
        m = re.match(r"^mtp\.(\d+)\.(.*)$", key)
        return (int(m.group(1)), m.group(2)) if m else None

    def _context(
        self, tokens: Tensor, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor
    ) -> V4Context:
        assert isinstance(self.rope, V4Rope)
        return V4Context(
            self.rope,
            self.cache_layout,
            tokens,
            positions,
            write_index,
            slots,
            cache,
            self.cfg.sliding_window,
        )

    def forward_target(
        self, tokens: Tensor, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor
    ) -> Tensor:
        """T over a [B, T] block: the streams before hc_head, flattened [B, T, hc_mult * H]."""
        ctx = self._context(tokens, positions, write_index, slots, cache)
        x = self.model.embed_tokens(tokens)[:, :, None].expand(-1, -1, self.cfg.hc_mult, -1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, i)
        return x.flatten(2)

    def forward_mtp(
        self,
        layer: int,
        tokens: Tensor,
        hidden: Tensor,
        positions: Tensor,
        write_index: Tensor,
        slots: Tensor,
        cache: Tensor,
        rows: Tensor | None = None,
    ) -> Tensor:
        """M over a [B, T] block on T's (or its own) flattened streams; returns its streams, flattened,
        or with `rows` those of row rows[b] of each request: the V4 block is not split at its cache
        entries, so it runs on the whole block either way."""
        ctx = self._context(tokens, positions, write_index, slots, cache)
        mtp = self.mtp_layer(layer)
        m = mtp(self.model.embed_tokens(tokens), self._streams(hidden), ctx, layer).flatten(2)
        return m if rows is None else gather_rows(m, rows)

    def write_mtp_entries(
        self,
        layer: int,
        tokens: Tensor,
        hidden: Tensor,
        positions: Tensor,
        write_index: Tensor,
        slots: Tensor,
        cache: Tensor,
    ) -> None:
        ctx = self._context(tokens, positions, write_index, slots, cache)
        self.mtp_layer(layer).write_entries(
            self.model.embed_tokens(tokens), self._streams(hidden), ctx, layer
        )

    def mtp_every_row_modules(self, layer: int) -> list[nn.Module]:
        return [self.mtp_layer(layer)]  # the V4 block runs on every row (forward_mtp)

    def mtp_layer(self, layer: int) -> MTPBlock:
        mtp = self.mtp[layer]
        assert isinstance(mtp, MTPBlock)
        return mtp

    def _streams(self, hidden: Tensor) -> Tensor:
        return hidden.unflatten(-1, (self.cfg.hc_mult, self.cfg.hidden_size))

    def logits(self, hidden: Tensor) -> Tensor:
        return super().logits(self.model.norm(self.model.hc_head(self._streams(hidden))))

    def draft_logits(self, hidden: Tensor) -> Tensor:
        return super().draft_logits(self.mtp_layer(0).collapse(self._streams(hidden)))
