"""Acceptance parity: per request and decode step, the engine drafts and accepts exactly what the
eager reference loop does, on checkpoints whose MTP layers read the target's hidden and attend over
their own cache (tests.checkpoints.write_distilled_checkpoint). Greedy tokens do not depend on the
drafts, so only these counts show a wrong draft: a draft at the wrong position or from the wrong
hidden lowers acceptance without changing a token."""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate

MAX_NEW = [2, 12, 24, 40]  # requests finish at different steps: the batch runs in buckets 4, 2 and 1


def prompts_for(vocab: int, lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_acceptance_parity(
    rt: Runtime, model, k: int, prompts: list[list[int]], max_new: list[int]
) -> None:
    """Greedy tokens, drafted and accepted counts per request and step equal reference_generate's;
    and the drafts are a mix of accepted and rejected (else the counts would show nothing)."""
    outs = rt.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new])
    refs = [reference_generate(model, [p], n, k)[0] for p, n in zip(prompts, max_new)]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.accepted_per_step for o in outs] == [r.accepted for r in refs]
    assert [o.num_draft_tokens for o in outs] == [k * len(r.accepted) for r in refs]
    accepted = [a for r in refs for a in r.accepted]
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)


@pytest.fixture(scope="module")
def distilled(distilled_checkpoint):
    return load_model(distilled_checkpoint)


@pytest.fixture(scope="module")
def distilled2(distilled2_checkpoint):
    return load_model(distilled2_checkpoint)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("model_name", ["distilled", "distilled2"])
def test_accepted_counts_equal_the_reference_on_every_bucket(model_name, k, request):
    model = request.getfixturevalue(model_name)
    rt = Runtime(
        model, mtp_depth=k, batch_sizes=(1, 2, 4), max_seq_len=64, compile_backend="eager", prefill_chunk=8
    )
    assert_acceptance_parity(rt, model, k, prompts_for(97, [5, 1, 12, 9], seed=k), MAX_NEW)
    assert {key.split("/")[1] for key in rt.stats()["graph_replays"] if "verify" in key} == {"B1", "B2", "B4"}
