"""Test fixtures for GLM-4 MoE (`glm4_moe`): tiny checkpoints in the released layout, written by HF.

HF's `save_pretrained` writes the target model (routed experts as per-expert keys); MTP layer i is
added at `model.layers.{num_hidden_layers + i}.` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and a MoE decoder layer's keys, as GLM-4.5
ships it. The shared helpers (weights, MTP layer keys, saving, distilling) are tests/checkpoints.py's.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor
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
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
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


def _random_mtp_state(model: Glm4MoeForCausalLM, num_mtp_layers: int, seed: int) -> dict[str, Tensor]:
    """Seeded random MTP layers (MoE blocks, random norms and eh_proj) for `model`."""
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    config, hidden = model.config, model.config.hidden_size
    state: dict[str, Tensor] = {}
    for i in range(num_mtp_layers):
        block = Glm4MoeDecoderLayer(config.get_mtp_config(), layer_idx=0)
        checkpoints._randomize_(block, gen)
        norms = {n: torch.rand(hidden, generator=gen) + 0.5 for n in ("enorm", "hnorm", "shared_head.norm")}
        eh_proj = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)
        state |= checkpoints._mtp_layer_state(
            model, block.state_dict(), norms, eh_proj, config.num_hidden_layers + i
        )
    return state


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
    config = copy.deepcopy(config)
    config.num_nextn_predict_layers = num_mtp_layers
    model = Glm4MoeForCausalLM(config).eval()
    checkpoints._randomize_(model, torch.Generator().manual_seed(seed))
    mtp_state = _random_mtp_state(model, num_mtp_layers, seed)
    path = checkpoints._save(
        Path(path), model, mtp_state, dtype=torch.float32, max_shard_size=max_shard_size, fp8=False
    )
    if fp8:
        checkpoints.rewrite_tensors(path, lambda _, tensors: _quantize(tensors))
        checkpoints.set_config_fields(path, quantization_config=checkpoints.FP8_QUANTIZATION_CONFIG)
    return path


def _quantize(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for key, value in tensors.items():
        if FP8_WEIGHT.match(key):
            out[key], out[f"{key}_scale_inv"] = checkpoints.quantize_fp8(value)
        else:
            out[key] = value
    return out


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
