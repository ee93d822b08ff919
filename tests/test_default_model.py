"""The shipped default model (compiled_mtp/default_model/, trained by scripts/train_default.py).

Fast checks, no training: it loads with the engine's loader, has the DeepSeek-V3 shape the issue asks for,
fits the size budget, its tokenizer round-trips Python, its MTP layer still drafts well (a regression
guard on greedy K=1 acceptance, deterministic), and compiled_mtp/corpus.py still holds out the files it
was measured on.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import compiled_mtp
from compiled_mtp import corpus
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.config import ModelConfig
from compiled_mtp.models.deepseek_v3 import MoE
from compiled_mtp.reference import reference_generate

tokenizers = pytest.importorskip("tokenizers")

DEFAULT = Path(compiled_mtp.__file__).parent / "default_model"
MAX_BYTES = 48_000_000
EOT = "<|endoftext|>"

# Not standard-library text (so held out whatever the Python version): the acceptance guard's prompt,
# the sample scripts/train_default.py generates from and records in the shipped training log.
LOG = json.loads((DEFAULT / "train_log.json").read_text())
PROMPT = LOG["samples"][0]["prompt"]
# Regression guards, half of what the shipped model measured (fp32 compute from its bf16 weights). On held-out
# stdlib prefixes scripts/train_default.py measured K=1 acceptance 0.896 (train_log.json). With the MTP layer
# re-initialised, or eh_proj's concat order swapped, both numbers fall below 0.05.
MEASURED_ON_PROMPT = 0.969  # K=1 greedy acceptance over 64 new tokens after PROMPT
MIN_ACCEPTANCE = 0.48
MEASURED_AGREEMENT = 0.874  # teacher-forced MTP/target argmax agreement on PROMPT itself
MIN_AGREEMENT = 0.44


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decode-sized ops are fastest on one thread (and far slower on two when the other core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT)


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(str(DEFAULT / "tokenizer.json"))


def test_shipped_files_fit_budget():
    names = {p.name for p in DEFAULT.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    total = sum(p.stat().st_size for p in DEFAULT.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"default model is {total / 1e6:.1f} MB, budget {MAX_BYTES / 1e6:.0f} MB"


def test_config_is_deepseek_v3_with_one_mtp_layer(tokenizer):
    raw = json.loads((DEFAULT / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3"
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_hidden_layers >= 8
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.q_lora_rank is not None and cfg.kv_lora_rank > 0
    assert cfg.n_routed_experts is not None and cfg.n_shared_experts >= 1
    assert cfg.first_k_dense_replace < cfg.num_hidden_layers  # at least one MoE target layer
    eot = tokenizer.token_to_id(EOT)
    assert eot is not None and raw["eos_token_id"] == eot and raw["bos_token_id"] == eot
    assert cfg.vocab_size == tokenizer.get_vocab_size()


def test_loads_with_engine_loader(model):
    cfg = model.cfg
    assert len(model.model.layers) == cfg.num_hidden_layers + 1
    assert isinstance(model.model.layers[cfg.num_hidden_layers].mlp, MoE)
    assert any(isinstance(layer.mlp, MoE) for layer in model.model.layers[: cfg.num_hidden_layers])
    with safe_open(str(DEFAULT / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            dtype = f.get_slice(key).get_dtype()
            if key.endswith("e_score_correction_bias"):
                assert dtype == "F32", key
            else:
                assert dtype in ("BF16", "F16"), (key, dtype)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tokenizer_round_trips_python(tokenizer):
    ids = tokenizer.encode(PROMPT).ids
    assert tokenizer.decode(ids) == PROMPT
    assert len(ids) < len(PROMPT) / 2  # BPE merges code, not bytes
    odd = "def f(x):\n\treturn {'é': x ** 2}  # ünïcödé ✓\r\n"
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd


@torch.no_grad()
def test_mtp_agrees_with_target_on_true_text(model, tokenizer):
    """Teacher-forced: MTP row i (h_i, t_{i+1}) predicts the same t_{i+2} as the target's row i+1."""
    tokens = torch.tensor([tokenizer.encode(PROMPT).ids])
    t = tokens.shape[1]
    slots, pos = torch.tensor([0]), torch.arange(t)[None]
    hidden = model.forward_target(tokens, pos, pos, slots, model.new_cache(model.cfg.num_hidden_layers, 1, t))
    mtp = model.forward_mtp(
        0, tokens[:, 1:], hidden[:, :-1], pos[:, :-1], pos[:, :-1], slots, model.new_cache(1, 1, t)
    )
    agree = (model.logits(mtp).argmax(-1) == model.logits(hidden[:, 1:]).argmax(-1)).float().mean().item()
    assert agree >= MIN_AGREEMENT, (
        f"teacher-forced agreement {agree:.3f} < {MIN_AGREEMENT} (measured {MEASURED_AGREEMENT})"
    )


def test_k1_greedy_acceptance_on_held_out_prompt(model, tokenizer):
    prompt = tokenizer.encode(PROMPT).ids
    out = reference_generate(model, [prompt], 64, 1)[0]
    rate = sum(out.accepted) / len(out.accepted)
    assert rate >= MIN_ACCEPTANCE, (
        f"K=1 acceptance {rate:.3f} < {MIN_ACCEPTANCE} (measured {MEASURED_ON_PROMPT})"
    )


@pytest.mark.skipif(
    platform.python_version() != LOG["python"], reason=f"the stdlib text is Python {LOG['python']}'s"
)
def test_corpus_split_is_the_one_the_model_was_trained_on(tokenizer):
    """File and held-out token counts, the acceptance prompts found and the first one's text (the log's
    second sample), as the training log records them."""
    train, held = corpus.split(corpus.stdlib_files())
    assert {"train": len(train), "held_out": len(held)} == LOG["files"]
    assert (
        sum(1 + len(tokenizer.encode(text).ids) for _, text in held) == LOG["tokens"]["held_out"]
    )  # + <|endoftext|>
    prompts = corpus.acceptance_prompts(
        lambda text: tokenizer.encode(text).ids, held, LOG["acceptance"]["prompts"], 64
    )
    assert len(prompts) == LOG["acceptance"]["prompts"]
    assert tokenizer.decode(prompts[0]) == LOG["samples"][1]["prompt"]
