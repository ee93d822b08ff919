"""Hypothesis strategies over tiny DeepSeek-V3 configs, and the configs every strategy test adds by hand."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from transformers import DeepseekV3Config

from tests.checkpoints import TINY_YARN, tiny_config


def draw_moe(draw: st.DrawFn, num_layers: int, groups: tuple[int, ...]) -> dict[str, Any]:
    """What every MoE family's drawn configs share: vocabulary, width, depth, the group-limited router
    (n_group from `groups`) and the dense/MoE mix."""
    n_group = draw(st.sampled_from(groups))
    per_group = draw(st.integers(2, 4))  # the group score sums each group's top-2 experts
    topk_group = draw(st.integers(1, n_group))
    return dict(
        vocab_size=2 * draw(st.integers(25, 150)) + 1,
        hidden_size=draw(st.sampled_from([16, 32])),
        num_hidden_layers=num_layers,
        n_routed_experts=n_group * per_group,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=draw(st.integers(1, topk_group * per_group)),
        n_shared_experts=draw(st.sampled_from([1, 2])),
        first_k_dense_replace=draw(st.integers(0, num_layers)),
        norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([0.5, 1.0, 2.5])),
    )


@st.composite
def config_strategy(draw: st.DrawFn) -> DeepseekV3Config:
    """Hypothesis strategy over tiny configs: MLA ranks, YaRN, rope layout, group routing, dense/MoE mix."""
    num_layers = draw(st.integers(1, 3))
    moe = draw_moe(draw, num_layers, (1, 2, 4))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 50000.0]))}
    if draw(st.booleans()):
        rope |= {
            "rope_type": "yarn",
            "factor": draw(st.floats(2.0, 8.0)),
            "original_max_position_embeddings": draw(st.sampled_from([32, 64, 128])),
            "mscale": draw(st.sampled_from([0.707, 1.0])),
            "mscale_all_dim": draw(st.sampled_from([0.0, 0.707, 1.0])),
            "beta_fast": 32,
            "beta_slow": 1,
        }
    return tiny_config(
        **moe,
        intermediate_size=draw(st.sampled_from([24, 48])),
        moe_intermediate_size=draw(st.sampled_from([8, 16])),
        num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        q_lora_rank=draw(st.one_of(st.none(), st.sampled_from([12, 24]))),
        kv_lora_rank=draw(st.sampled_from([8, 16])),
        qk_nope_head_dim=draw(st.sampled_from([4, 8])),
        qk_rope_head_dim=draw(st.sampled_from([4, 8])),
        v_head_dim=draw(st.sampled_from([4, 12])),
        rope_parameters=rope,
        rope_interleave=draw(st.booleans()),
    )


# q_lora, MoE layers and YaRN together, in two layouts. Ten derandomized draws of config_strategy
# (the "ci" profile) need not contain such a config, so its users add these as explicit @example()s.
FULL_FEATURED_CONFIGS = (
    tiny_config(),  # first layer dense, then MoE; interleaved rope; mscale = mscale_all_dim
    tiny_config(
        num_hidden_layers=3,
        first_k_dense_replace=0,
        num_attention_heads=2,
        q_lora_rank=12,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_parameters={
            **TINY_YARN,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 0.0,
        },
    ),
)
