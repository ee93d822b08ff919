"""GLM-4 MoE (`glm4_moe`) through the family interface, with HF transformers as the oracle: target and
MTP logits, greedy output of the reference loop and of the Runtime at every depth and bucket, K=1
accepted counts against HF's generate(use_mtp=True), the loader's layouts and errors."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import Glm4MoeConfig as HFGlm4MoeConfig

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.hf_baseline import hf_mtp_generate, load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.config import CheckpointError
from compiled_mtp.models.registry import family_of
from compiled_mtp.reference import reference_generate
from tests import checkpoints, corruption
from tests import test_distribution as distribution
from tests import test_passes as passes
from tests.glm_factory import (
    glm_config,
    glm_config_strategy,
    write_glm_checkpoint,
    write_glm_distilled_checkpoint,
)
from tests.oracle import (
    assert_buckets_match_hf,
    assert_depth_switching_matches_hf,
    assert_reference_matches_hf,
    hf_greedy,
    hf_logits,
    hf_mtp_draft_logits,
)
from tests.test_engine import assert_padded_rows_write_only_scratch
from tests.test_models import ATOL, RTOL, engine_logits, engine_mtp_logits

NEW_TOKENS = 12
# Full rotary, no bias, no qk-norm, one KV head for four query heads, every layer MoE.
PLAIN = glm_config(
    num_attention_heads=4,
    num_key_value_heads=1,
    attention_bias=False,
    use_qk_norm=False,
    first_k_dense_replace=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory) -> object:
    """`write_glm_checkpoint(glm_config())`: 2 layers (dense + MoE), one random MTP layer."""
    return write_glm_checkpoint(tmp_path_factory.mktemp("glm"), glm_config(), seed=1)


@pytest.fixture(scope="module")
def glm_distilled_path(tmp_path_factory) -> object:
    """A GLM checkpoint whose drafts are accepted often but not always."""
    return write_glm_distilled_checkpoint(tmp_path_factory.mktemp("glm_distilled"))


@settings(max_examples=10)
@given(glm_config_strategy())
@example(glm_config())
@example(PLAIN)
@torch.no_grad()
def test_target_and_mtp_logits_match_hf(config):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_glm_checkpoint(tmp, config, seed=3)
        hf, ours = load_hf(path), load_model(path)
        tokens = _prompts(config.vocab_size, [11], seed=0)[0]
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(engine_logits(ours, tokens), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(engine_logits(ours, tokens, chunk=3), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(
            engine_mtp_logits(ours, tokens), hf_mtp_draft_logits(hf, tokens), atol=ATOL, rtol=RTOL
        )


@settings(max_examples=3)
@given(glm_config_strategy(), st.lists(st.integers(1, 9), min_size=1, max_size=2))
@example(glm_config(), [5])
def test_reference_greedy_equals_hf_generate_for_every_depth(config, lengths):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_glm_checkpoint(tmp, config, seed=5)
        assert_reference_matches_hf(path, _prompts(config.vocab_size, lengths, seed=len(lengths)), NEW_TOKENS)


@pytest.mark.parametrize("k", range(5))
def test_runtime_greedy_equals_hf_generate_on_buckets_1_2_4(glm_path, k):
    """Runtime.from_pretrained on an HF-written GLM checkpoint: four requests of different lengths
    finish at different steps, so the batch moves through buckets 4, 2 and 1."""
    assert_buckets_match_hf(glm_path, load_hf(glm_path), _prompts(97, [5, 1, 12, 9], seed=k), k)


def test_k1_accepted_counts_equal_hf_mtp(glm_distilled_path):
    """HF drafts one token per MTP layer, so its generate(use_mtp=True) is our K = 1: same tokens,
    same drafts accepted at every step, in the reference loop and in the Runtime."""
    hf = load_hf(glm_distilled_path)
    rt = Runtime.from_pretrained(
        glm_distilled_path,
        mtp_depth=1,
        batch_sizes=(1,),
        max_seq_len=64,
        compile_backend="eager",
        cache_dir=None,
    )
    ours = load_model(glm_distilled_path)
    steps = 0
    for prompt in _prompts(97, [3, 8, 5], seed=4):
        tokens, accepted = hf_mtp_generate(hf, prompt, 24)
        ref = reference_generate(ours, [prompt], 24, 1)[0]
        out = rt.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
        assert ref.token_ids == tokens == out.token_ids
        # Both loops may run one step past the end (its bonus beyond max_new_tokens): compare the steps HF ran.
        assert ref.accepted[: len(accepted)] == accepted == out.accepted_per_step[: len(accepted)]
        steps += len(accepted)
        assert 0 < sum(accepted) < len(accepted)  # a mix of accepted and rejected drafts
    assert steps >= 25


def test_fp8_and_sharded_checkpoints_load_like_the_dequantized_one(tmp_path):
    """A sharded checkpoint with FP8 block-scaled q/k/v/o and expert weights (128x128 blocks over
    160-wide weights: a partial block) loads as its dequantized single-file copy, which HF agrees with."""
    path = write_glm_checkpoint(
        tmp_path / "fp8", glm_config(hidden_size=160, head_dim=40), seed=2, fp8=True, max_shard_size="200KB"
    )
    assert len(list(path.glob("*.safetensors"))) > 1
    plain = load_model(checkpoints.dequantize_checkpoint(path, tmp_path / "fp32"))
    model = load_model(path)
    stored = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert stored["model.layers.1.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    tokens = _prompts(97, [8], seed=1)[0]
    torch.testing.assert_close(
        engine_logits(model, tokens), hf_logits(load_hf(tmp_path / "fp32"), tokens), atol=ATOL, rtol=RTOL
    )


def test_save_pretrained_output_serves_without_mtp(tmp_path):
    """HF's save_pretrained writes the target only: it serves at mtp_depth 0, and asking for MTP is
    one clear error."""
    hf = load_hf(write_glm_checkpoint(tmp_path / "released", glm_config(), seed=4))
    hf.save_pretrained(tmp_path / "saved")
    with pytest.raises(CheckpointError, match=r"no MTP layer keys \(model\.layers\.2\.\*\).*mtp_depth 0"):
        load_model(tmp_path / "saved")
    prompt = _prompts(97, [6], seed=2)[0]
    rt = Runtime.from_pretrained(
        tmp_path / "saved",
        mtp_depth=0,
        batch_sizes=(1,),
        max_seq_len=32,
        compile_backend="eager",
        cache_dir=None,
    )
    assert rt.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids == hf_greedy(
        hf, prompt, 8
    )


def test_unknown_model_type_lists_the_supported_ones(glm_path, tmp_path):
    path = corruption.copy_checkpoint(glm_path, tmp_path / "llama")
    checkpoints.set_config_fields(path, model_type="llama")
    with pytest.raises(
        CheckpointError,
        match=r"^\S*config\.json: model_type 'llama' is not supported "
        r"\(supported: deepseek_v3, glm4_moe, deepseek_v4\)$",
    ):
        load_model(path)


@pytest.fixture(scope="module")
def glm_markov(tmp_path_factory):
    """A one-layer GLM model (test_distribution._chain reads one layer) whose target and MTP layer are
    Markov chains over 12 tokens: every attention's o_proj is zero, so the next token depends only on
    the current one, and the MTP layer's eh_proj drops the hidden. Its drafts follow a chain of their
    own (0.3 from the target's in total variation), so rejections and residuals run. The LM head is
    halved so that every token is visited often enough for test_distribution's bound (seed 8: about
    800 transitions out of the rarest token, 700 needed)."""
    config = glm_config(vocab_size=distribution.VOCAB, num_hidden_layers=1, first_k_dense_replace=0)
    model = load_model(write_glm_checkpoint(tmp_path_factory.mktemp("glm_markov"), config, seed=8))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.model.layers[-1].eh_proj.weight[:, model.cfg.hidden_size :] = 0
        model.lm_head.weight *= 0.5
    return model


def test_sampled_tokens_follow_the_target_chain(glm_markov):
    """test_distribution.py's chi-square and convergence checks (false-failure rate 1e-6) on the GLM
    chain at K = 2 (one depth: the sampling itself is family-blind, test_distribution covers the rest)."""
    target, draft = (
        distribution._chain(glm_markov, target=True),
        distribution._chain(glm_markov, target=False),
    )
    pairs, depths = distribution._transitions(glm_markov, 2, seed=402)
    assert list(depths) == [2]
    distribution._assert_follows(pairs, target, draft, "GLM K=2")


def test_padded_rows_never_touch_live_or_free_slots(glm_distilled_path):
    assert_padded_rows_write_only_scratch(load_model(glm_distilled_path))


def test_inductor_graphs_through_the_capture_cache_equal_hf(glm_distilled_path, tmp_path, caplog):
    """Real Inductor graphs with every custom pass at one key (B=2, K=1) of a one-layer model, built
    into a capture cache, then loaded from it by a second runtime: both give HF's greedy tokens.
    live_attention finds no latent attention in GLM's graphs and skips them with one log line; no
    pass warns."""
    prompts = _prompts(97, [5, 3], seed=8)
    hf = load_hf(glm_distilled_path)
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    options = dict(
        mtp_depth=1, batch_sizes=(2,), max_seq_len=32, prefill_chunk=8, cache_dir=tmp_path / "cache"
    )
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="compiled_mtp.passes"):
        built = Runtime.from_pretrained(glm_distilled_path, **options)
        assert [o.token_ids for o in built.generate(prompts, params)] == expected
    loaded = Runtime.from_pretrained(glm_distilled_path, **options)
    assert [o.token_ids for o in loaded.generate(prompts, params)] == expected
    graphs = len(built.graphs.replays)
    assert built.graphs.compiles == graphs and loaded.graphs.loads == graphs and loaded.graphs.compiles == 0
    passes_log = {(r.levelname, r.getMessage()) for r in caplog.records if r.name == "compiled_mtp.passes"}
    assert ("INFO", "live_attention: skipped, the graph has no call of latent_attention") in passes_log
    assert not [m for level, m in passes_log if level != "INFO"]


def test_group_experts_takes_the_moe_layer_and_live_attention_nothing(glm_path):
    """In the post-grad graph of a GLM verify (B=2, K=1): the target's one MoE layer becomes the
    routed-experts op, no attention becomes live_attention, and the graph computes what it did."""
    model = load_model(glm_path)
    state = StaticState(model, num_slots=5, max_seq_len=32, max_depth=3)
    before, after = passes._graphs("target_verify", 2, 1, model, state, ("live_attention", "group_experts"))
    assert (
        passes._count(before, passes.ROUTED_EXPERTS) == 0 and passes._count(after, passes.ROUTED_EXPERTS) == 1
    )
    assert passes._count(after, passes.LIVE_ATTENTION) == 0
    passes._assert_same(before, after, state, model, "target_verify", 2, 1, exact=False)


def test_every_kind_traces_whole_and_matches_hf(glm_path):
    """Every graph kind, buckets 1 and 2, the depth switching: HF's greedy tokens (oracle.py)."""
    assert_depth_switching_matches_hf(glm_path, load_hf(glm_path), _prompts(97, [4, 7], seed=9))


# A config.json shaped like GLM-4.5's release: rope fields at the top level (transformers 4 style), 92
# layers, so its MTP layer is model.layers.92 (one of the two numbers HF itself recognises).
RELEASED_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
    "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True,
    "attention_bias": True, "num_nextn_predict_layers": 1,
    "eos_token_id": [151329, 151336, 151338], "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


def test_released_config_reads_as_hf_reads_it():
    """A released-style config.json gives the rotary width, theta, head size and MTP layer count HF
    derives from it; a bad field is one error naming it."""
    family = family_of(RELEASED_CONFIG)
    cfg = family.config.from_dict(RELEASED_CONFIG)
    hf = HFGlm4MoeConfig.from_dict(RELEASED_CONFIG)
    assert family.hf_class == "Glm4MoeForCausalLM"
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.head_dim == hf.head_dim
    assert cfg.num_nextn_predict_layers == hf.num_mtp_layers == 1 and cfg.eos_token_ids == (
        151329,
        151336,
        151338,
    )
    assert [cfg.is_moe_layer(i) for i in (2, 3)] == [False, True] and cfg.cache_dim == 2 * 8 * 128
    with pytest.raises(
        CheckpointError,
        match=r"^config\.json: partial_rotary_factor must give an even rotary width in \[2, head_dim=128\], got 63$",
    ):
        family.config.from_dict({**RELEASED_CONFIG, "partial_rotary_factor": 63 / 128})
    with pytest.raises(
        CheckpointError,
        match=r"^config\.json: num_attention_heads 96 not divisible by num_key_value_heads 7$",
    ):
        family.config.from_dict({**RELEASED_CONFIG, "num_key_value_heads": 7})
