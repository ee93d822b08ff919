"""Edges of the engine's contract, run eager: the cache's end, a stop token sampled by prefill,
checkpoints without MTP layers, bfloat16, text prompts, generate() beside streamed requests,
identical seeded requests and top_k at its limits."""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate
from tests.checkpoints import tiny_config, write_checkpoint
from tests.test_acceptance import assert_acceptance_parity, prompts_for


@pytest.fixture(scope="module")
def distilled(distilled_checkpoint):
    return load_model(distilled_checkpoint)


def runtime(model, k=2, buckets=(1, 2, 4), max_seq_len=64, **kw) -> Runtime:
    return Runtime(
        model,
        mtp_depth=k,
        batch_sizes=buckets,
        max_seq_len=max_seq_len,
        compile_backend="eager",
        prefill_chunk=8,
        **kw,
    )


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("k", [2, 4])
def test_drafts_past_the_cache_end_write_nowhere(distilled, k):
    """prompt + max_new_tokens = max_seq_len: the last steps draft and verify past the cache's end.
    Those rows must go to the scratch slot, not wrap into the next slot: slot 1, whose request has
    most of its tokens still to generate from the positions there."""
    cap = 32
    prompts = prompts_for(97, [20, 4], seed=k)
    rt = runtime(distilled, k, buckets=(2,), max_seq_len=cap)
    assert_acceptance_parity(rt, distilled, k, prompts, [cap - 20, cap - 4])


def test_stop_token_sampled_by_prefill(distilled):
    """The first token (prefill's) is a stop token or EOS: the request ends there, its slot is freed
    and the queued request after it runs normally."""
    prompt, other = prompts_for(97, [6, 4], seed=3)
    first = reference_generate(distilled, [prompt], 1, 0)[0].token_ids[0]
    rt = runtime(distilled, 2, buckets=(1,))
    stopped, after = rt.generate(
        [prompt, other], [SamplingParams(max_new_tokens=10, stop_token_ids=(first,)), greedy(10)]
    )
    assert (stopped.token_ids, stopped.finish_reason, stopped.num_draft_tokens) == ([first], "stop", 0)
    assert after.token_ids == reference_generate(distilled, [other], 10, 0)[0].token_ids
    rt.eos_ids = frozenset({first})
    (eos,) = rt.generate([prompt], SamplingParams(max_new_tokens=10))
    assert (eos.token_ids, eos.finish_reason) == ([first], "stop")
    assert not rt.has_unfinished() and sorted(rt._free) == [0]


def test_depth_zero_on_a_checkpoint_without_mtp_layers(tmp_path):
    path = write_checkpoint(tmp_path, tiny_config(), num_mtp_layers=0)
    rt = Runtime.from_pretrained(
        path, mtp_depth=0, batch_sizes=(1, 2), max_seq_len=32, compile_backend="eager", prefill_chunk=8
    )
    prompts = prompts_for(97, [3, 8], seed=1)
    outs = rt.generate(prompts, greedy(10))
    model = load_model(path, with_mtp=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference_generate(model, prompts, 10, 0)]
    assert rt.state.mtp_cache.numel() == 0 and rt.state.lag_window == 0
    with pytest.raises(
        ValueError, match=r"^mtp_depth: 1 needs MTP layers, but the model has none \(use 0\)$"
    ):
        Runtime(model, mtp_depth=1, compile_backend="eager")


@pytest.mark.parametrize("k", [0, 3])
def test_bfloat16_generation_equals_the_bfloat16_reference(distilled_checkpoint, k):
    rt = Runtime.from_pretrained(
        distilled_checkpoint,
        mtp_depth=k,
        batch_sizes=(1,),
        max_seq_len=48,
        dtype="bfloat16",
        compile_backend="eager",
        prefill_chunk=8,
    )
    assert rt.model.lm_head.weight.dtype == torch.bfloat16 and rt.state.target_cache.dtype == torch.bfloat16
    prompts = prompts_for(97, [5, 9], seed=8)
    outs = rt.generate(prompts, greedy(20))
    refs = reference_generate(load_model(distilled_checkpoint, dtype=torch.bfloat16), prompts, 20, k)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.accepted_per_step for o in outs] == [r.accepted for r in refs]


def test_text_prompts_and_output_text():
    rt = Runtime.from_pretrained(
        DEFAULT_MODEL, mtp_depth=2, batch_sizes=(2,), max_seq_len=64, compile_backend="eager", prefill_chunk=8
    )
    texts = ["def add(a, b):\n", "import os\n"]
    outs = rt.generate(texts, greedy(8))
    for text, out in zip(texts, outs):
        assert out.prompt_token_ids == rt.tokenizer.encode(text)
        assert out.text == rt.tokenizer.decode(out.token_ids) and out.text
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in rt.generate([o.prompt_token_ids for o in outs], greedy(8))
    ]


def test_text_prompt_needs_a_tokenizer(distilled):
    with pytest.raises(
        ValueError, match=r"^prompt: must be a list of token ids \(this checkpoint has no tokenizer\)$"
    ):
        runtime(distilled).add_request("hello")


def test_generate_beside_streamed_requests_loses_none_of_their_tokens(distilled):
    prompts = prompts_for(97, [5, 3, 8], seed=6)
    rt = runtime(distilled, 2)
    streamed = {rt.add_request(p, greedy(n)): [] for p, n in zip(prompts[:2], (6, 30))}
    finished = {}

    def collect(outputs):
        for out in outputs:
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.output

    collect(rt.step())
    (direct,) = rt.generate([prompts[2]], greedy(12))  # both streamed requests run (one finishes) meanwhile
    while rt.has_unfinished():
        collect(rt.step())
    expected = [r.token_ids for r in reference_generate(distilled, prompts, 30, 0)]
    assert list(streamed.values()) == [expected[0][:6], expected[1]]
    assert [finished[i].token_ids for i in streamed] == list(streamed.values())
    assert direct.token_ids == expected[2][:12]


def test_identical_seeded_requests_in_one_batch(distilled):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    prompt = prompts_for(97, [6], seed=2)[0]
    alone = runtime(distilled, 3).generate([prompt], params)[0].token_ids
    outs = runtime(distilled, 3).generate([prompt] * 3, params)
    assert [o.token_ids for o in outs] == [alone] * 3


def test_top_k_one_is_greedy_and_top_k_past_the_vocabulary_is_no_limit(distilled):
    prompts = prompts_for(97, [4, 9], seed=5)
    rt = runtime(distilled, 3)
    ones = rt.generate(
        prompts,
        [
            SamplingParams(max_new_tokens=15, temperature=1.5, top_k=1, seed=s, ignore_eos=True)
            for s in (1, 2)
        ],
    )
    assert [o.token_ids for o in ones] == [r.token_ids for r in reference_generate(distilled, prompts, 15, 0)]
    sampled = [
        [
            SamplingParams(max_new_tokens=15, temperature=1.5, top_k=top_k, seed=s, ignore_eos=True)
            for s in (1, 2)
        ]
        for top_k in (0, 97, 1000)
    ]
    none, vocab, beyond = ([o.token_ids for o in rt.generate(prompts, p)] for p in sampled)
    assert none == vocab == beyond and none != [o.token_ids for o in ones]
