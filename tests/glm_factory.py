"""Test fixtures for GLM-4 MoE (`glm4_moe`): tiny checkpoints in the released layout, written by HF.

HF's `save_pretrained` writes the target model (routed experts as per-expert keys); MTP layer i is
added at `model.layers.{num_hidden_layers + i}.` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and a MoE decoder layer's keys, as GLM-4.5
ships it. The shared helpers (weights, MTP layer keys, saving, distilling) are tests/checkpoints.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

from compiled_mtp.models.checkpoint import load_model, save_checkpoint
from tests import checkpoints
from tests.strategies import draw_moe

# GLM-4.5's FP8 release quantizes every decoder linear but the router; k_proj and v_proj included.
FP8_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
_TINY: dict[str, Any] = dict(
    **checkpoints.TINY_MOE,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=True,
    use_qk_norm=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def glm_config(**overrides: Any) -> Glm4MoeConfig:
    """A tiny fp32 GLM-4 MoE config: 2 layers (dense, then MoE), GQA 4:2, q/k/v bias, qk-norm,
    half-rotary heads, 8 experts in 2 groups, one MTP layer."""
    return Glm4MoeConfig(**{**_TINY, **overrides}, dtype=torch.float32, attn_implementation="eager")


@st.composite
def glm_config_strategy(draw: st.DrawFn) -> Glm4MoeConfig:
    """Tiny configs over qk-norm on/off, bias on/off, partial rotary factors, GQA ratios, head sizes,
    group routing, dense/MoE mixes and a tied or separate LM head."""
    num_layers = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    return glm_config(
        **draw_moe(draw, num_layers, (1, 2)),
        num_attention_heads=kv_heads * draw(st.sampled_from([1, 2, 4])),
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([8, 16])),
        attention_bias=draw(st.booleans()),
        use_qk_norm=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": draw(st.sampled_from([10000.0, 1000000.0])),
            "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])),
        },
    )


def write_glm_checkpoint(
    path: str | Path,
    config: Glm4MoeConfig,
    *,
    seed: int = 0,
    num_mtp_layers: int = 1,
    max_shard_size: int | str | None = None,
    fp8: bool = False,
) -> Path:
    """Write a seeded random GLM-4 MoE checkpoint in the released layout with `num_mtp_layers` MTP
    layers. `fp8=True` stores the decoder linears as float8_e4m3fn with 128x128 block scales, as
    GLM-4.5-FP8 does (HF does not load it: compare with `checkpoints.dequantize_checkpoint`'s copy)."""
    return checkpoints.write_random(
        path,
        config,
        seed,
        num_mtp_layers,
        torch.float32,
        max_shard_size,
        FP8_WEIGHT if fp8 else None,
        (Glm4MoeForCausalLM, Glm4MoeDecoderLayer),
    )


def write_glm_distilled_checkpoint(
    path: str | Path, *, num_mtp_layers: int = 1, seed: int = 0, steps: int = 100, **overrides: Any
) -> Path:
    """A GLM checkpoint whose MTP layers draft often but not always right: one MoE target layer, each
    MTP layer a copy of it distilled on the target's distribution (checkpoints.write_distilled_checkpoint,
    for GLM-4 MoE)."""
    config = glm_config(num_hidden_layers=1, first_k_dense_replace=0, **overrides)
    write_glm_checkpoint(path, config, seed=seed, num_mtp_layers=num_mtp_layers)
    model = load_model(path)
    checkpoints._copy_target_into_mtp_(model, torch.Generator().manual_seed(seed + 11))
    checkpoints.distill_mtp(model, steps, seed)
    return save_checkpoint(model, json.loads((Path(path) / "config.json").read_text()), path)
