"""The static-shape DeepSeek-V3 model against HF transformers, on hypothesis-drawn tiny configs."""

from __future__ import annotations

import tempfile

import torch
from hypothesis import example, given, settings

from compiled_mtp.hf_baseline import load_hf
from compiled_mtp.models.checkpoint import load_model
from tests.checkpoints import write_checkpoint
from tests.oracle import hf_logits, hf_mtp_draft_logits
from tests.strategies import FULL_FEATURED_CONFIGS, config_strategy

# fp32 on tiny models: both sides differ only in summation order (absorbed vs expanded MLA,
# gathered vs looped experts); observed differences are ~1e-6.
ATOL = RTOL = 1e-4


def engine_logits(model, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """Target logits [T, V], fed in chunks of `chunk` rows through the cache (all at once if None)."""
    n = len(tokens)
    chunk = chunk or n
    cache = model.new_cache(model.cfg.num_hidden_layers, 2, n + 1)
    slot = torch.tensor([1])  # not slot 0, so a slot-indexing slip shows
    out = []
    for start in range(0, n, chunk):
        pos = torch.arange(start, min(start + chunk, n))[None]
        ids = torch.tensor([tokens[start : start + chunk]])
        out.append(model.logits(model.forward_target(ids, pos, pos + (n + 1), slot, cache))[0])
    return torch.cat(out)


def engine_mtp_logits(model, tokens: list[int]) -> torch.Tensor:
    """Depth-1 MTP logits [T-1, V]: row i takes tokens[i+1] and T's hidden at position i."""
    n = len(tokens)
    cache = model.new_cache(model.cfg.num_hidden_layers, 1, n)
    pos = torch.arange(n)[None]
    slot = torch.tensor([0])
    hidden = model.forward_target(torch.tensor([tokens]), pos, pos, slot, cache)
    mtp_cache = model.new_cache(model.num_mtp_layers, 1, n)
    m = model.forward_mtp(
        0, torch.tensor([tokens[1:]]), hidden[:, :-1], pos[:, :-1], pos[:, :-1], slot, mtp_cache
    )
    return model.logits(m)[0]


@settings(max_examples=12)
@given(config_strategy())
@example(FULL_FEATURED_CONFIGS[0])
@example(FULL_FEATURED_CONFIGS[1])
@torch.no_grad()
def test_target_and_mtp_logits_match_hf(config):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, config, seed=3)
        hf, ours = load_hf(path), load_model(path)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(config.vocab_size, (11,), generator=gen).tolist()
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(engine_logits(ours, tokens), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(engine_logits(ours, tokens, chunk=3), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(
            engine_mtp_logits(ours, tokens), hf_mtp_draft_logits(hf, tokens), atol=ATOL, rtol=RTOL
        )


@torch.no_grad()
def test_moe_gathered_and_masked_experts_agree(tiny_checkpoint):
    """Rows that gather their experts' weights and rows that run every expert masked: same result."""
    model = load_model(tiny_checkpoint)
    moe = model.model.layers[1].mlp
    x = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    idx, weights = moe.gate(x)
    torch.testing.assert_close(
        moe.experts.gathered(x, idx, weights), moe.experts.masked(x, idx, weights), atol=1e-5, rtol=1e-5
    )
