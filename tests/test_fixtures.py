"""The test helpers are what they claim: tests/checkpoints.py (layout, HF loading, echo, FP8, sharding),
tests/oracle.py (HF conventions the oracle relies on), tests/strategies.py (drawn configs write and load)
and tests/corruption.py (each breaks what it says and nothing else)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from safetensors import SafetensorError, safe_open
from transformers import DeepseekV3ForCausalLM
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from compiled_mtp.hf_baseline import hf_mtp_generate, load_hf, wrapped
from tests.checkpoints import (
    FP8_BLOCK,
    dequantize_checkpoint,
    read_state_dict,
    set_config_fields,
    tiny_config,
    write_checkpoint,
    write_echo_checkpoint,
)
from tests.corruption import (
    add_key,
    copy_checkpoint,
    delete_key,
    file_of,
    reshape_key,
    truncate_file,
    write_garbage,
)
from tests.oracle import hf_greedy, hf_logits, hf_mtp_draft_logits
from tests.strategies import FULL_FEATURED_CONFIGS, config_strategy


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _file_keys(path: Path) -> dict[str, str]:
    """key -> file name over all safetensors files of a checkpoint."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out |= dict.fromkeys(f.keys(), file.name)
    return out


def _expected_mtp_keys(config, layer: int) -> set[str]:
    p = f"model.layers.{layer}."
    keys = {
        p + k
        for k in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias",
        )
    }
    attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    attn += ["q_proj"] if config.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    keys |= {f"{p}self_attn.{n}.weight" for n in attn}
    keys |= {f"{p}mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    keys |= {
        f"{p}mlp.experts.{e}.{n}.weight"
        for e in range(config.n_routed_experts)
        for n in ("gate_proj", "up_proj", "down_proj")
    }
    return keys


# ----------------------------------------------------------------------------- checkpoints: layout and loading


def test_checkpoint_layout(tiny_checkpoint: Path) -> None:
    config = tiny_config()
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["model_type"] == "deepseek_v3"
    assert "quantization_config" not in cfg
    sd = read_state_dict(tiny_checkpoint)
    L = config.num_hidden_layers
    mtp = {k for k in sd if k.startswith(f"model.layers.{L}.")}
    assert mtp == _expected_mtp_keys(config, L)
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in sd)
    assert sd[f"model.layers.{L}.eh_proj.weight"].shape == (config.hidden_size, 2 * config.hidden_size)
    assert torch.equal(sd[f"model.layers.{L}.shared_head.head.weight"], sd["lm_head.weight"])
    assert torch.equal(sd[f"model.layers.{L}.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    for key, value in sd.items():  # norms and biases are not trivially ones / zeros
        if key.endswith("norm.weight"):
            assert (value - 1).abs().max() > 0.2, key
        if key.endswith("e_score_correction_bias"):
            assert value.abs().min() > 0 and value.std() > 0.03, key
    # the MTP block differs from the target's MoE layer (it is its own random layer)
    assert not torch.equal(
        sd[f"model.layers.{L}.mlp.gate.weight"], sd[f"model.layers.{L - 1}.mlp.gate.weight"]
    )


def test_hf_loads_target_and_mtp(tiny_checkpoint: Path, tiny_hf: DeepseekV3ForCausalLM) -> None:
    sd = read_state_dict(tiny_checkpoint)
    L = tiny_hf.config.num_hidden_layers
    assert DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected == [r"model\.layers\.61.*"]  # restored
    experts = tiny_hf.model.layers[1].mlp.experts
    assert torch.equal(
        experts.gate_up_proj[3],
        torch.cat(
            [
                sd["model.layers.1.mlp.experts.3.gate_proj.weight"],
                sd["model.layers.1.mlp.experts.3.up_proj.weight"],
            ]
        ),
    )
    assert torch.equal(tiny_hf.lm_head.weight, sd["lm_head.weight"])
    mtp = MtpModel.from_pretrained(tiny_hf)
    layer, p = mtp.layers[0], f"model.layers.{L}."
    assert torch.equal(layer.enorm.weight, sd[p + "enorm.weight"])
    assert torch.equal(layer.hnorm.weight, sd[p + "hnorm.weight"])
    assert torch.equal(layer.eh_proj.weight, sd[p + "eh_proj.weight"])
    assert torch.equal(layer.post_norm.weight, sd[p + "shared_head.norm.weight"])
    assert torch.equal(
        layer.mtp_block.mlp.gate.e_score_correction_bias, sd[p + "mlp.gate.e_score_correction_bias"]
    )
    assert torch.equal(layer.mtp_block.mlp.experts.down_proj[5], sd[p + "mlp.experts.5.down_proj.weight"])
    assert torch.equal(
        layer.mtp_block.mlp.experts.gate_up_proj[5][: tiny_hf.config.moe_intermediate_size],
        sd[p + "mlp.experts.5.gate_proj.weight"],
    )
    assert torch.equal(layer.mtp_block.self_attn.kv_b_proj.weight, sd[p + "self_attn.kv_b_proj.weight"])


def test_hidden_states_last_is_post_final_norm(tiny_hf: DeepseekV3ForCausalLM) -> None:
    captured = []
    hook = tiny_hf.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        with torch.no_grad():
            out = tiny_hf(torch.tensor([_tokens(9, 97, 0)]), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    pre = captured[0]
    assert torch.equal(out.hidden_states[-1], tiny_hf.model.norm(pre))
    assert not torch.allclose(out.hidden_states[-1], pre)


def test_logits_well_conditioned(tiny_hf: DeepseekV3ForCausalLM) -> None:
    """Top-2 gaps: median ~0.8, about 1% below 1e-2 (fp32 engine error is ~1e-5)."""
    logits = torch.cat([hf_logits(tiny_hf, _tokens(48, 97, s)) for s in range(4)])
    gaps = logits.topk(2, -1).values.diff(dim=-1).neg()
    assert gaps.min() > 1e-4 and (gaps < 1e-2).float().mean() < 0.03 and gaps.median() > 0.3
    assert 0.2 < logits.softmax(-1).amax(-1).mean() < 0.8  # neither near-uniform nor one-hot


# ----------------------------------------------------------------------------- oracle


def test_hf_greedy_is_argmax_and_ignores_eos(tiny_checkpoint: Path) -> None:
    model = load_hf(tiny_checkpoint)  # own copy: its generation_config is changed below
    prompt = _tokens(5, 97, 1)
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    assert hf_greedy(model, prompt, 12) == seq[len(prompt) :]
    model.generation_config.eos_token_id = seq[len(prompt) + 2]  # an eos that greedy emits early
    assert hf_greedy(model, prompt, 12) == seq[len(prompt) :]


def test_mtp_draft_logits_shape_causality_and_concat_order(
    tiny_checkpoint: Path, tiny_hf: DeepseekV3ForCausalLM
) -> None:
    tokens = _tokens(12, 97, 2)
    draft = hf_mtp_draft_logits(tiny_hf, tokens)
    assert draft.shape == (11, 97) and torch.isfinite(draft).all()
    changed = hf_mtp_draft_logits(tiny_hf, tokens[:-1] + [(tokens[-1] + 1) % 97])
    torch.testing.assert_close(changed[:-1], draft[:-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed[-1], draft[-1])
    # row 0 attends only to itself, so it can be rebuilt from the file's weights:
    # logits = head(shared_head.norm(block(eh_proj @ [enorm(embed(t1)); hnorm(h0)])))
    sd, L = read_state_dict(tiny_checkpoint), tiny_hf.config.num_hidden_layers
    p = f"model.layers.{L}."

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + tiny_hf.config.rms_norm_eps)

    with torch.no_grad():
        h0 = tiny_hf(torch.tensor([tokens[:1]]), output_hidden_states=True).hidden_states[-1][0, 0]
        e1 = sd[p + "embed_tokens.weight"][tokens[1]]
        x = sd[p + "eh_proj.weight"] @ torch.cat(
            [rms(e1, sd[p + "enorm.weight"]), rms(h0, sd[p + "hnorm.weight"])]
        )
        block = MtpModel.from_pretrained(tiny_hf).layers[0].mtp_block
        pos = torch.tensor([[1]])
        y = block(
            x[None, None], position_embeddings=tiny_hf.model.rotary_emb(x[None, None], pos), position_ids=pos
        )
        logits = sd[p + "shared_head.head.weight"] @ rms(y[0, 0], sd[p + "shared_head.norm.weight"])
    torch.testing.assert_close(logits, draft[0], rtol=1e-4, atol=1e-4)


def test_mtp_draft_logits_match_hf_generator_first_draft(tiny_hf: DeepseekV3ForCausalLM) -> None:
    """The prefill draft of HF's MTPCandidateGenerator is the last row of hf_mtp_draft_logits."""
    prompt = _tokens(7, 97, 3)
    seen = []
    with wrapped(MTPCandidateGenerator, "get_candidates", lambda r, *a, **k: seen.append(r)):
        generated, _ = hf_mtp_generate(tiny_hf, prompt, 2)
    first_draft = next(logits for _, logits in seen if logits is not None)[0, 0]
    draft = hf_mtp_draft_logits(tiny_hf, prompt + generated[:1])
    torch.testing.assert_close(draft[-1], first_draft, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["tiny", "echo"])
def test_hf_mtp_generate_matches_greedy(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(f"{which}_hf")
    prompt, n = _tokens(6, 97, 4), 23
    hf_counts = []

    def record(_, _self, _ids, scores, num_matches):
        if scores.shape[1] > 1:
            hf_counts.append(int(num_matches))

    with wrapped(MTPCandidateGenerator, "update_candidate_strategy", record):
        tokens, accepted = hf_mtp_generate(model, prompt, n)
    assert tokens == hf_greedy(model, prompt, n)
    assert all(a in (0, 1) for a in accepted)
    # one token from the prefill, then a+1 per step; the last step may lose its bonus token
    assert 1 + sum(a + 1 for a in accepted) in (n, n + 1)
    assert hf_counts[:-1] == accepted[:-1] and hf_counts[-1] in (accepted[-1], accepted[-1] - 1)
    if which == "echo":
        assert sum(accepted) >= 0.9 * len(accepted)
    else:
        assert sum(accepted) < len(accepted)


def test_two_mtp_layers(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, tiny_config(), seed=3, num_mtp_layers=2)
    config = tiny_config()
    keys = _file_keys(path)
    for i in (0, 1):
        assert {k for k in keys if k.startswith(f"model.layers.{2 + i}.")} == _expected_mtp_keys(
            config, 2 + i
        )
    model = load_hf(path)
    prompt = _tokens(5, 97, 5)
    tokens, accepted = hf_mtp_generate(model, prompt, 9)
    assert tokens == hf_greedy(model, prompt, 9) and all(0 <= a <= 2 for a in accepted)


def test_no_mtp_checkpoint(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, tiny_config(), num_mtp_layers=0)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not any(k.startswith("model.layers.2.") for k in _file_keys(path))
    assert hf_logits(load_hf(path), [3, 4, 5]).shape == (3, 97)


# ----------------------------------------------------------------------------- checkpoints: echo


def test_echo_draft_equals_target_next_token(echo_checkpoint: Path, echo_hf: DeepseekV3ForCausalLM) -> None:
    tokens = _tokens(80, 97, 6)
    draft = hf_mtp_draft_logits(echo_hf, tokens).argmax(-1)
    target = hf_logits(echo_hf, tokens)[1:].argmax(-1)
    assert (draft == target).float().mean() >= 0.95
    sd = read_state_dict(echo_checkpoint)
    torch.testing.assert_close(sd["model.embed_tokens.weight"].pow(2).mean(-1), torch.ones(97))
    # the MTP block (experts unfused by write_echo_checkpoint) is the target layer (experts unfused by HF)
    block = {k.removeprefix("model.layers.0."): v for k, v in sd.items() if k.startswith("model.layers.0.")}
    assert len(block) > 30
    for key, value in block.items():
        assert torch.equal(sd[f"model.layers.1.{key}"], value), key
    assert torch.equal(sd["model.layers.1.shared_head.norm.weight"], sd["model.norm.weight"])
    assert not sd["model.layers.0.self_attn.o_proj.weight"].any()


def test_echo_successor_map_is_one_cycle(echo_hf: DeepseekV3ForCausalLM) -> None:
    with torch.no_grad():
        succ = echo_hf(torch.arange(97)[:, None]).logits[:, 0].argmax(-1).tolist()
    assert sorted(succ) == list(range(97))
    x, seen = 0, set()
    while x not in seen:
        seen.add(x)
        x = succ[x]
    assert len(seen) == 97
    chain = hf_greedy(echo_hf, [5, 17], 40)
    assert len(set(chain)) == 40


def test_echo_noise_and_attention_lower_agreement(tmp_path: Path) -> None:
    tokens = _tokens(80, 97, 7)
    for name, kwargs, low, high in (
        ("noise", {"mtp_noise": 0.5}, 0.4, 0.85),
        ("attn", {"attn_scale": 2.0}, 0.8, 0.99),
    ):
        model = load_hf(write_echo_checkpoint(tmp_path / name, **kwargs))
        draft = hf_mtp_draft_logits(model, tokens).argmax(-1)
        agree = (draft == hf_logits(model, tokens)[1:].argmax(-1)).float().mean()
        assert low < agree < high, (name, agree)


# ---------------------------------------------------------------- checkpoints: storage variants; strategies


def test_fp8_block_quantization(tmp_path: Path) -> None:
    config = tiny_config(intermediate_size=272, moe_intermediate_size=136)  # several and partial blocks
    ref = read_state_dict(write_checkpoint(tmp_path / "f32", config, seed=4))
    path = write_checkpoint(tmp_path / "fp8", config, seed=4, fp8=True)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]
    with safe_open(path / "model.safetensors", "pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    quantized = [k for k in raw if raw[k].dtype == torch.float8_e4m3fn]
    assert (
        "model.layers.0.mlp.down_proj.weight" in quantized
        and "model.layers.2.self_attn.o_proj.weight" in quantized
    )
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in quantized
    for key in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.2.eh_proj.weight",
        "model.layers.2.shared_head.head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.kv_a_layernorm.weight",
    ):
        assert raw[key].dtype == torch.float32, key
    assert raw["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 3)
    assert raw["model.layers.2.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 1)
    deq = read_state_dict(path)
    assert deq.keys() == ref.keys()
    for key in quantized:
        w, d = ref[key], deq[key]
        scale = raw[f"{key}_scale_inv"].float()
        assert scale.dtype == torch.float32
        s = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[: w.shape[0], : w.shape[1]]
        # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal spacing 2^-9 times the block scale
        assert ((d - w).abs() <= 2**-4 * w.abs() + 2**-10 * s + 1e-7).all(), key
        assert not torch.equal(d, w)
    for key in set(ref) - set(quantized):
        assert torch.equal(ref[key], deq[key]), key
    model = load_hf(dequantize_checkpoint(path, tmp_path / "deq"))
    assert torch.isfinite(hf_mtp_draft_logits(model, [1, 2, 3, 4])).all()


def test_sharded_and_bf16(tmp_path: Path) -> None:
    config, tokens = tiny_config(), _tokens(10, 97, 8)
    single = write_checkpoint(tmp_path / "single", config, seed=5)
    sharded = write_checkpoint(tmp_path / "sharded", config, seed=5, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert index["weight_map"] == _file_keys(sharded)
    assert set(index["weight_map"]) == set(_file_keys(single))
    assert "model.layers.2.eh_proj.weight" in index["weight_map"]
    a, b = load_hf(single), load_hf(sharded)
    assert torch.equal(hf_logits(a, tokens), hf_logits(b, tokens))
    assert torch.equal(hf_mtp_draft_logits(a, tokens), hf_mtp_draft_logits(b, tokens))
    bf16 = write_checkpoint(tmp_path / "bf16", config, seed=5, dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(bf16 / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.2.mlp.experts.0.up_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    torch.testing.assert_close(hf_logits(load_hf(bf16), tokens), hf_logits(a, tokens), rtol=0.1, atol=0.3)


@given(config_strategy())
@example(FULL_FEATURED_CONFIGS[0])
@example(FULL_FEATURED_CONFIGS[1])
def test_strategy_configs_write_and_load(config) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, config, seed=1)
        model = load_hf(path)
        for field in (
            "rope_parameters",
            "rope_interleave",
            "n_group",
            "topk_group",
            "num_experts_per_tok",
            "first_k_dense_replace",
            "q_lora_rank",
            "norm_topk_prob",
            "routed_scaling_factor",
            "vocab_size",
        ):
            assert getattr(model.config, field) == getattr(config, field), field
        tokens = _tokens(7, config.vocab_size, 9)
        assert torch.isfinite(hf_logits(model, tokens)).all()
        assert hf_mtp_draft_logits(model, tokens).shape == (6, config.vocab_size)


# ----------------------------------------------------------------------------- corruption


def test_bad_checkpoint_helpers(tmp_path: Path) -> None:
    good = write_checkpoint(tmp_path / "good", tiny_config(), max_shard_size="40KB")
    index = lambda p: json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731

    bad = copy_checkpoint(good, tmp_path / "deleted")
    delete_key(bad, "model.layers.2.hnorm.weight")
    assert "model.layers.2.hnorm.weight" not in _file_keys(
        bad
    ) and "model.layers.2.hnorm.weight" not in index(bad)
    assert len(_file_keys(bad)) == len(_file_keys(good)) - 1

    bad = copy_checkpoint(good, tmp_path / "added")
    add_key(bad, "model.layers.0.mlp.bogus.weight")
    assert index(bad)["model.layers.0.mlp.bogus.weight"] == _file_keys(bad)["model.layers.0.mlp.bogus.weight"]

    bad = copy_checkpoint(good, tmp_path / "reshaped")
    reshape_key(bad, "model.layers.2.eh_proj.weight", (32, 33))
    with safe_open(file_of(bad, "model.layers.2.eh_proj.weight"), "pt") as f:
        assert f.get_slice("model.layers.2.eh_proj.weight").get_shape() == [32, 33]

    for name, breaker in {"truncated": truncate_file, "garbage": write_garbage}.items():
        bad = copy_checkpoint(good, tmp_path / name)
        file = file_of(bad, "lm_head.weight")
        breaker(file)
        with pytest.raises(SafetensorError), safe_open(file, "pt") as f:
            f.get_tensor("lm_head.weight")

    bad = copy_checkpoint(good, tmp_path / "config")
    set_config_fields(
        bad,
        remove=("rope_interleave",),
        num_nextn_predict_layers=0,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
    )
    cfg = json.loads((bad / "config.json").read_text())
    assert (
        cfg["num_nextn_predict_layers"] == 0 and cfg["model_type"] == "llama" and "rope_interleave" not in cfg
    )
    # the source is untouched
    assert index(good) == _file_keys(good) and "model.layers.2.hnorm.weight" in index(good)
    assert json.loads((good / "config.json").read_text())["model_type"] == "deepseek_v3"
