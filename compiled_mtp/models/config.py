"""DeepSeek-V3 model configuration, read from an HF-layout config.json, and what every family's config
shares: the error type, rope parameters, EOS ids and the FP8 block size."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: the message names the file and the key or field."""


@contextlib.contextmanager
def reading(source: str) -> Iterator[None]:
    """Around building a config from a dict: a missing or malformed field becomes a CheckpointError
    naming `source` and the field."""
    try:
        yield
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{source}: missing required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: malformed field ({e})") from None


def need(ok: bool, source: str, what: str) -> None:
    """A config check: if not `ok`, a CheckpointError naming `source` and saying `what` is wrong."""
    if not ok:
        raise CheckpointError(f"{source}: {what}")


def need_sizes(cfg: Any, source: str) -> None:
    """Every family's first config check: a vocabulary and a hidden size."""
    need(cfg.vocab_size > 0 and cfg.hidden_size > 0, source, "vocab_size and hidden_size must be positive")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `factor` > 1 with type "yarn" enables YaRN scaling."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float | None = None  # YaRN's cos/sin scale when given, else from the mscales


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a DeepSeek-V3 config.json that changes the computation."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Per-token MLA cache width: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        """Target layer `index` uses MoE; MTP layers always do (as DeepSeek-V3 ships them)."""
        return self.n_routed_experts is not None and index >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate and convert an HF config dict (its family checked by registry.family_of); errors
        name `source` and the field."""
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')"
            )
        with reading(source):
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                n_routed_experts=None
                if raw.get("n_routed_experts") is None
                else int(raw["n_routed_experts"]),
                n_shared_experts=int(raw.get("n_shared_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 1),
                n_group=int(raw.get("n_group") or 1),
                topk_group=int(raw.get("topk_group") or 1),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_dict(raw),
                rope_interleave=bool(raw.get("rope_interleave", True)),
                attention_bias=bool(raw.get("attention_bias", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
                eos_token_ids=eos_ids(raw),
                fp8_block_size=fp8_block_size(raw, source),
            )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        need_sizes(self, source)
        need(
            self.qk_rope_head_dim % 2 == 0,
            source,
            f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}",
        )
        if self.n_routed_experts is not None:
            check_router(
                source, self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok
            )


def check_router(
    source: str, n_routed_experts: int, n_group: int, topk_group: int, num_experts_per_tok: int
) -> None:
    """The group-limited top-k router's fields (layers.Router, shared by the families), or a
    CheckpointError naming the field."""
    need(
        n_routed_experts % n_group == 0,
        source,
        f"n_routed_experts {n_routed_experts} not divisible by n_group {n_group}",
    )
    need(
        1 <= topk_group <= n_group, source, f"topk_group must be in [1, n_group={n_group}], got {topk_group}"
    )
    per_group = n_routed_experts // n_group
    need(
        per_group >= 2,
        source,
        f"n_routed_experts / n_group must be >= 2 (the group score sums each group's top 2), got {per_group}",
    )
    need(
        1 <= num_experts_per_tok <= per_group * topk_group,
        source,
        f"num_experts_per_tok must be in [1, {per_group * topk_group}], got {num_experts_per_tok}",
    )


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id (one id, a list or none) as a tuple."""
    eos = raw.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)


def fp8_block_size(raw: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The FP8 weights' block size from quantization_config (None: not quantized)."""
    quant = raw.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{source}: quantization_config.quant_method {quant.get('quant_method')!r} is not supported (only 'fp8')"
        )
    block = quant.get("weight_block_size") or [128, 128]
    if not (
        isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b >= 1 for b in block)
    ):
        raise CheckpointError(
            f"{source}: quantization_config.weight_block_size must be two integers >= 1, got {block!r}"
        )
    return block[0], block[1]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; released DeepSeek configs use `rope_scaling` + `rope_theta`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    return rope_config(params, theta, raw, "config.json: rope")


def rope_config(
    params: dict[str, Any],
    theta: float,
    raw: dict[str, Any],
    what: str,
    attention_factor: float | None = None,
) -> RopeConfig:
    """A RopeConfig from HF rope parameters (`rope_type` default or yarn) at `theta`; `raw` is the
    whole config (its max_position_embeddings), `what` names the field in errors. A yarn
    `attention_factor` given in `params` wins over the argument."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise CheckpointError(f"{what} type {kind!r} is not supported (supported: default, yarn)")
    if kind == "default":
        return RopeConfig(theta=theta)
    factor = params.get("factor")
    original = int(params["original_max_position_embeddings"])
    given = params.get("attention_factor", attention_factor)
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(factor) if factor is not None else raw["max_position_embeddings"] / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if given is None else float(given),
    )
