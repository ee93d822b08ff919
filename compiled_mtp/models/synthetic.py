"""Random checkpoints of the registered families' shapes (DeepSeek-V3, GLM-4 MoE, DeepSeek-V4), for demos and
benchmarks that need a model of a shape rather than a trained one. Acceptance measured on these
means nothing: drafts are random."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import save_checkpoint
from .registry import family_of

_COMMON = {
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}
_DEEPSEEK_V3 = {
    **_COMMON,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_theta": 10000.0,
}
_GLM4_MOE = {
    **_COMMON,
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    "attention_bias": True,
    "use_qk_norm": False,
}
_DEEPSEEK_V4 = {
    **_COMMON,
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "scoring_func": "sqrtsoftplus",
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
}

# The tiny presets' sizes and router, whatever the family: a few MB, 8 experts in 2 groups.
_TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
}

PRESETS: dict[str, dict] = {
    # A few MB: the demo before a trained default exists, and quick checks.
    "tiny": {
        **_DEEPSEEK_V3,
        **_TINY,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
    # About 250M parameters with DeepSeek-V3's proportions and its 129280-token vocabulary.
    "250m": {
        **_DEEPSEEK_V3,
        "vocab_size": 129280,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096,
    },
    # DeepSeek-V3's draft-to-target proportion: one draft step (the MTP layer, eh_proj and the LM head)
    # reads 0.057 of the weight bytes a target forward reads (DeepSeek-V3: about 0.04), through 30
    # MoE layers; 1.0B parameters, 4.1 GB at float32.
    "dsv3-proportions": {
        **_DEEPSEEK_V3,
        "vocab_size": 8192,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096,
    },
    # GLM-4.5's layout at the tiny preset's size: GQA with 4 query heads on 2 KV heads of 32 channels,
    # half of each rotated, q/k/v bias, the first layer dense.
    "glm-tiny": {**_GLM4_MOE, **_TINY, "num_key_value_heads": 2, "head_dim": 32},
    # DeepSeek-V4's layout at the tiny preset's size: one sliding-window layer with hash routing,
    # then CSA, HCA and CSA layers (windows of 4 and 16 positions, a 16-position sliding window).
    "v4-tiny": {
        **_DEEPSEEK_V4,
        **{k: _TINY[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers")},
        **{k: _TINY[k] for k in ("num_attention_heads", "n_routed_experts", "num_experts_per_tok")},
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 4096,
        "num_key_value_heads": 1,  # one KV head, shared by every query head
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 48,
        "o_groups": 2,
        "o_lora_rank": 32,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "sliding_window": 16,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 4,
    },
}


def preset_config(name: str) -> dict:
    """The full config.json dict of a preset."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    config = dict(PRESETS[name])
    config.setdefault(
        "num_key_value_heads", config["num_attention_heads"]
    )  # MLA: every head has its own key and value
    return config


@torch.no_grad()
def write_random_checkpoint(
    path: str | Path, config: dict, *, seed: int = 0, std: float = 0.05, dtype: torch.dtype = torch.float32
) -> Path:
    """Write a seeded random checkpoint of `config` in its family's released layout."""
    family = family_of(config)
    gen = torch.Generator().manual_seed(seed)
    model = family.model(family.config.from_dict(config))
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.01 * torch.randn(tensor.shape, generator=gen))
        elif not tensor.is_floating_point():  # V4's hash routing: token id -> expert ids
            tensor.copy_(torch.randint(config["n_routed_experts"], tensor.shape, generator=gen))
        else:
            tensor.copy_(std * torch.randn(tensor.shape, generator=gen))
    return save_checkpoint(model, config, path, dtype=dtype)
