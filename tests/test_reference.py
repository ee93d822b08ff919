"""The eager reference loop against HF generate: greedy tokens for K = 0..4, accepted counts at K = 1,
and at K = 2 with two MTP layers the acceptance of each step's first draft."""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from compiled_mtp.hf_baseline import hf_mtp_generate, load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate
from tests.checkpoints import write_checkpoint, write_echo_checkpoint
from tests.oracle import assert_reference_matches_hf
from tests.strategies import FULL_FEATURED_CONFIGS, config_strategy

NEW_TOKENS = 12


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


@settings(max_examples=6)
@given(config_strategy(), st.lists(st.integers(1, 9), min_size=1, max_size=3))
@example(FULL_FEATURED_CONFIGS[0], [5])
@example(FULL_FEATURED_CONFIGS[1], [7])
def test_greedy_equals_hf_generate_for_every_depth(config, lengths):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, config, seed=5)
        assert_reference_matches_hf(path, _prompts(config.vocab_size, lengths, seed=len(lengths)), NEW_TOKENS)


@pytest.mark.parametrize("mtp_noise", [0.0, 0.3, 0.5])
def test_k1_accepted_counts_equal_hf_mtp(tmp_path, mtp_noise):
    """HF drafts one token per MTP layer, so its generate(use_mtp=True) is our K = 1. The echo
    checkpoint with MTP noise gives a mix of accepted and rejected drafts."""
    path = write_echo_checkpoint(tmp_path, mtp_noise=mtp_noise, attn_scale=0.5, seed=2)
    hf, ours = load_hf(path), load_model(path)
    for prompt in _prompts(97, [3, 8], seed=4):
        tokens, accepted = hf_mtp_generate(hf, prompt, 24)
        ref = reference_generate(ours, [prompt], 24, 1)[0]
        assert ref.token_ids == tokens
        # Our loop may run one step past the end (its bonus falls beyond max_new_tokens);
        # compare the steps both ran.
        assert ref.accepted[: len(accepted)] == accepted
        if mtp_noise == 0.0:
            assert sum(accepted) >= 0.9 * len(accepted)
        else:
            assert 0 < sum(accepted) < len(accepted)


def _starts(accepted: list[int]) -> list[int]:
    """The generated-token index each step's drafts start at (token 0 is prefill's)."""
    starts = [1]
    for a in accepted[:-1]:
        starts.append(starts[-1] + a + 1)
    return starts


def test_k2_with_two_mtp_layers_against_hf_mtp(distilled2_checkpoint):
    """HF drafts one token per MTP layer, so on a checkpoint with two its generate(use_mtp=True) is
    our K = 2. Tokens are equal. Each step's first draft comes from MTP layer 0, whose cache holds
    every position in both, so at every step that starts at the same token both accept it or both
    reject it. The second draft comes from layer 1, whose cache HF fills at every position and the
    engine only at the positions it drafted at (docs/design.md), so its acceptance may differ."""
    hf, ours = load_hf(distilled2_checkpoint), load_model(distilled2_checkpoint)
    compared = 0
    for prompt in _prompts(97, [3, 8, 5], seed=4):
        tokens, accepted = hf_mtp_generate(hf, prompt, 24)
        ref = reference_generate(ours, [prompt], 24, 2)[0]
        assert ref.token_ids == tokens
        hf_first = {s: a > 0 for s, a in zip(_starts(accepted), accepted)}
        ref_first = {s: a > 0 for s, a in zip(_starts(ref.accepted), ref.accepted)}
        common = hf_first.keys() & ref_first.keys()
        assert {s: hf_first[s] for s in common} == {s: ref_first[s] for s in common}
        compared += len(common)
        assert max(accepted) == 2 and 0 in accepted
    assert compared >= 25
