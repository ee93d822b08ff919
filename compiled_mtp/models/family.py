"""The interface between a model family and the engine.

The graphs (graphs/steps.py), StaticState, the reference loop, Runtime and the CLI see a model only
through `CausalLM`: `forward_target` and `forward_mtp` (with `rows` where one row per request
is used) over explicit positions, write indices and slots, `logits` / `draft_logits`, `new_cache`
(the family's `RowCache` layout), `num_mtp_layers` and `hidden_width`. A family module
(deepseek_v3.py, glm4_moe.py, deepseek_v4.py) subclasses it with its backbone (attention, blocks)
and config, and registers a `Family` in registry.py: its config class, its model class and its
checkpoint's key names. Nothing outside `models/` names a family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from .layers import Context, Linear, MTPLayer, Rope, RowCache

# Stacked routed experts (one [E, ...] parameter) come from per-expert checkpoint keys.
STACKED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class KeyLayout:
    """How a checkpoint names its tensors, relative to the names `checkpoint_keys` gives (HF's):
    `renames` (regex, replacement) pairs applied in order, the name of a quantized weight's scale
    (`scale`, a pair applied to the weight's key), and `copies`, keys the loader skips (copies of
    shared weights). A family's other layouts are told apart by `marker`, a key only they have."""

    marker: str = ""
    renames: tuple[tuple[str, str], ...] = ()
    scale: tuple[str, str] = (r"$", "_scale_inv")
    copies: str | None = None

    def key(self, name: str) -> str:
        """The file's key for checkpoint key `name`."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def is_copy(self, key: str) -> bool:
        return self.copies is not None and re.match(self.copies, key) is not None

    def scale_key(self, key: str) -> str | None:
        """The key of the block scales of the file's quantized weight `key` (None: it has none)."""
        scale, found = re.subn(self.scale[0], self.scale[1], key, count=1)
        return scale if found else None


# The layout HF's save_pretrained writes, and DeepSeek-V3 and GLM-4.5 publish: FP8 weights'
# scales are `<key>_scale_inv`.
HF_LAYOUT = KeyLayout()


class FamilyConfig(Protocol):
    """The config fields the engine reads outside a family's own module."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    num_experts_per_tok: int
    eos_token_ids: tuple[int, ...]
    fp8_block_size: tuple[int, int] | None


class CausalLM(nn.Module):
    """Target model T and MTP layers M of one family. Caches are passed in, allocated by `new_cache`.

    Parameter names follow the checkpoint keys (`model.layers.3.self_attn.q_proj.weight`), except
    routed experts, which are stacked per layer (`mlp.experts.gate_proj` is [E, I, H]) so a token
    gathers its experts; `checkpoint_keys` maps one back to the keys it is read from."""

    model_type: ClassVar[str]
    # Layouts the family reads besides HF_LAYOUT, each told by its marker key.
    layouts: ClassVar[tuple[KeyLayout, ...]] = ()

    # The family's embedding, layers and final norm: layers.Backbone for DeepSeek-V3 and GLM-4 MoE.
    model: Any

    def __init__(self, cfg: Any, model: nn.Module, cache_width: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rope = self.make_rope()
        self.cache_layout = RowCache(cache_width)
        self.draft_head: Linear | None = None  # the LM head's rows for draft_ids (restrict_drafts)
        self.draft_ids: Tensor | None
        self.register_buffer("draft_ids", None)

    def make_rope(self) -> Rope:
        """The rotary tables (computed, not loaded: the loader rebuilds them off the meta device)."""
        raise NotImplementedError

    def checkpoint_keys(self, name: str, param: Tensor) -> list[str]:
        """The checkpoint keys parameter `name` is read from: one, or one per expert when stacked."""
        m = STACKED_EXPERT.match(name)
        if m:
            return [f"{m.group(1)}.{e}.{m.group(2)}.weight" for e in range(param.shape[0])]
        return [name]

    def float32_parameter(self, name: str) -> bool:
        """Whether floating parameter `name` stays float32 whatever the model's dtype: the routers'
        score biases, whose small differences pick the experts."""
        return name.endswith("e_score_correction_bias")

    def key_layout(self, keys: Collection[str]) -> KeyLayout:
        """The layout of a checkpoint holding `keys`: the first of `layouts` whose marker is among
        them, else HF_LAYOUT."""
        return next((layout for layout in self.layouts if layout.marker in keys), HF_LAYOUT)

    @property
    def num_mtp_layers(self) -> int:
        return self.cfg.num_nextn_predict_layers

    @property
    def hidden_width(self) -> int:
        """The width of the hiddens forward_target and forward_mtp return and take (StaticState keeps
        them between steps): hidden_size, unless the family passes more than its final hidden."""
        return int(self.cfg.hidden_size)

    def mtp_key_prefix(self, layer: int) -> str:
        """Where MTP layer `layer`'s keys sit in a checkpoint: after the target's layers, as released."""
        return f"model.layers.{self.cfg.num_hidden_layers + layer}."

    def mtp_shared_copies(self) -> dict[str, str]:
        """The copies of shared target weights a released MTP layer carries: the key under its
        prefix -> the parameter copied. Loading skips them (the target's are used)."""
        return {
            "shared_head.head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight",
        }

    def mtp_key(self, key: str) -> tuple[int, str] | None:
        """(MTP layer, the rest of the key) of a checkpoint key of an MTP layer, else None."""
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
        if m and int(m.group(1)) >= self.cfg.num_hidden_layers:
            return int(m.group(1)) - self.cfg.num_hidden_layers, m.group(2)
        return None

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

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def new_cache(self, num_layers: int, num_slots: int, max_seq_len: int) -> Tensor:
        """A zeroed cache of this family's layout for `num_layers` layers."""
        p = self.lm_head.weight
        return self.cache_layout.allocate(num_layers, num_slots, max_seq_len, p.dtype, p.device)

    def context(self, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor) -> Context:
        return Context(
            self.rope, self.cache_layout, positions, write_index, slots, cache, self.lm_head.weight.dtype
        )

    def forward_target(
        self, tokens: Tensor, positions: Tensor, write_index: Tensor, slots: Tensor, cache: Tensor
    ) -> Tensor:
        """T over a [B, T] block. Returns post-final-norm hiddens [B, T, H] and writes each row's
        cache entry to `write_index` (flat over slots x positions)."""
        ctx = self.context(positions, write_index, slots, cache)
        x = self.model.embed_tokens(tokens)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, ctx, i)
        return self.model.norm(x)

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
        """MTP layer `layer` over a [B, T] block: row (b, t) takes the token at positions+1 and the hidden
        from positions. Returns its post-shared_head.norm hiddens; `cache` is the MTP cache. With
        `rows` ([B] long), only row rows[b] of each request's, [B, H], though every row of the block
        writes its cache entry: the shared MTP layer (layers.MTPLayer) runs past its cache entries on
        those rows alone."""
        ctx = self.context(positions, write_index, slots, cache)
        return self.mtp_layer(layer)(self.model.embed_tokens(tokens), hidden, ctx, layer, rows)

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
        """The cache entries forward_mtp writes for the block, and nothing past them (no row's output):
        what keeps M's cache current where no draft is wanted."""
        mtp = self.mtp_layer(layer)
        assert isinstance(mtp, MTPLayer)  # a family with another MTP layer overrides this method
        ctx = self.context(positions, write_index, slots, cache)
        mtp.write_entries(self.model.embed_tokens(tokens), hidden, ctx, layer)

    def mtp_every_row_modules(self, layer: int) -> list[nn.Module]:
        """The modules of MTP layer `layer` that forward_mtp runs on every row of a block, also where
        `rows` picks one row a request (a draft extend's block); the rest runs on that row alone."""
        mtp = self.mtp_layer(layer)
        assert isinstance(mtp, MTPLayer)  # a family with another MTP layer overrides this method
        return mtp.every_row_modules()

    def mtp_layer(self, layer: int) -> nn.Module:
        """MTP layer `layer`'s module: for DeepSeek-V3 and GLM-4 MoE model.layers[num_hidden_layers + layer]."""
        return self.model.layers[self.cfg.num_hidden_layers + layer]


@dataclass(frozen=True)
class Family:
    """A registered model family: its name for people, the checkpoint's `model_type` and
    `architectures`, the config class (`from_dict(raw, source)`), the model class, HF
    transformers' class for it (the tests' oracle and the benchmark's baseline) and whether that
    class runs the checkpoint's MTP layers (`generate(use_mtp=True)`)."""

    name: str
    model_type: str
    architectures: tuple[str, ...]
    config: Any
    model: Callable[[Any], CausalLM]  # the model class, from the config
    hf_class: str
    hf_mtp: bool = True
