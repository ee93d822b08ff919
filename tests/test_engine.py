"""The Runtime over the step functions (run uncompiled here; test_compiled.py traces and compiles them)
against the eager reference loop, and every invariant of DESIGN.md."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate
from tests.factory import write_echo_checkpoint

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def echo(echo_checkpoint):
    """Every greedy draft is accepted: blocks of K + 1 tokens per step."""
    return load_model(echo_checkpoint)


@pytest.fixture(scope="module")
def noisy_echo(tmp_path_factory):
    """About 84% of drafts accepted: a mix of full, partial and empty accepts."""
    return load_model(write_echo_checkpoint(tmp_path_factory.mktemp("noisy"), mtp_noise=0.3, attn_scale=0.5, seed=1))


def runtime(model, k=2, buckets=(1, 2, 4), **kw) -> Runtime:
    kw.setdefault("compile_backend", "eager")
    return Runtime(model, mtp_depth=k, batch_sizes=buckets, max_seq_len=kw.pop("max_seq_len", 64), prefill_chunk=kw.pop("prefill_chunk", 8), **kw)


def prompts_for(vocab: int, lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompts, max_new) -> list[list[int]]:
    return [reference_generate(model, [p], n, 0)[0].token_ids for p, n in zip(prompts, max_new)]


@pytest.mark.parametrize("k", range(5))
def test_greedy_equals_reference_on_every_bucket(tiny, noisy_echo, k):
    # Different lengths finish at different steps, so the batch moves through buckets 4, 2 and 1.
    for model in (tiny, noisy_echo):
        prompts = prompts_for(model.cfg.vocab_size, [5, 1, 12, 9], seed=k)
        max_new = [3, 7, 12, 16]
        rt = runtime(model, k)
        outs = rt.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new])
        assert [o.token_ids for o in outs] == reference(model, prompts, max_new)
        assert {key.split("/")[1] for key in rt.stats()["graph_replays"] if "verify" in key} == {"B1", "B2", "B4"}


@settings(max_examples=8)
@given(
    k=st.integers(0, 3),
    schedule=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 14), st.integers(0, 6)), min_size=1, max_size=6),
)
def test_greedy_parity_under_join_and_leave(noisy_echo, k, schedule):
    """Requests join between steps (more than there are slots: the rest queue) and leave when done."""
    prompts = prompts_for(97, [n for n, _, _ in schedule], seed=len(schedule))
    rt = runtime(noisy_echo, k, buckets=(1, 2, 4))
    got: dict[int, list[int]] = {}
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(schedule) or rt.has_unfinished():
        for i, (_, max_new, join) in enumerate(schedule):
            if join == step and i not in ids:
                ids[i] = rt.add_request(prompts[i], SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        for out in rt.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    expected = reference(noisy_echo, prompts, [m for _, m, _ in schedule])
    assert [got[ids[i]] for i in range(len(schedule))] == expected


@settings(max_examples=8)
@given(k=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.7, 1.3]), seed=st.integers(0, 2**31))
def test_accept_counts_stay_in_range(noisy_echo, k, temperature, seed):
    rt = runtime(noisy_echo, k)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, top_k=30, seed=seed, ignore_eos=True)
    ids = [rt.add_request(p, params) for p in prompts_for(97, [4, 7, 2], seed=seed % 1000)]
    while rt.has_unfinished():
        for out in rt.step():
            assert 1 <= len(out.new_token_ids) <= k + 1 or out.finished
            if out.finished:
                assert out.output.num_accepted_tokens <= out.output.num_draft_tokens
                assert len(out.output.token_ids) == 20
    stats = rt.stats()
    assert all(0.0 <= r <= 1.0 for r in stats["acceptance_rate_per_position"])
    assert 1.0 <= stats["acceptance_length"] <= k + 1
    assert len(ids) == 3


def _full_acceptance_run(echo, k, max_new, stop=()):
    rt = runtime(echo, k, buckets=(1,))
    out = rt.generate([[5, 6, 7]], SamplingParams(max_new_tokens=max_new, stop_token_ids=stop, ignore_eos=True))[0]
    return rt, out


@pytest.mark.parametrize("k", [2, 3])
def test_stop_token_inside_an_accepted_block(echo, k):
    _, plain = _full_acceptance_run(echo, k, 1 + 6 * (k + 1))  # prefill's token, then six whole blocks
    assert plain.num_accepted_tokens == plain.num_draft_tokens  # every draft accepted: blocks of k + 1
    # Token 0 comes from prefill; step s emits tokens 1 + (s-1)(k+1) .. s(k+1). Index k + 3 sits
    # inside the second block, with more accepted tokens after it.
    cut = k + 3
    stop = plain.token_ids[cut]
    assert stop not in plain.token_ids[:cut]
    rt, out = _full_acceptance_run(echo, k, 30, stop=(stop,))
    assert out.token_ids == plain.token_ids[: cut + 1]
    assert out.finish_reason == "stop"
    # Only committed-and-emitted drafts count: k in the first block, then the two before the stop.
    assert out.num_accepted_tokens == k + 2
    assert rt.stats()["accepted_tokens"] == k + 2


@pytest.mark.parametrize("max_new", range(1, 10))
def test_max_new_tokens_is_exact_when_the_bonus_overruns(echo, max_new):
    _, plain = _full_acceptance_run(echo, 3, 16)
    _, out = _full_acceptance_run(echo, 3, max_new)
    assert out.token_ids == plain.token_ids[:max_new]
    assert out.finish_reason == "length"
    assert out.num_accepted_tokens <= max_new - 1


def test_eos_stops_unless_ignored(echo):
    _, plain = _full_acceptance_run(echo, 2, 20)
    eos = plain.token_ids[4]
    rt = runtime(echo, 2)
    rt.eos_ids = frozenset({eos})
    stopped, ignored = rt.generate([[5, 6, 7]] * 2, [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, ignore_eos=True)])
    assert stopped.token_ids == plain.token_ids[:5] and stopped.finish_reason == "stop"
    assert ignored.token_ids == plain.token_ids


@pytest.mark.parametrize("k", [0, 2, 3])
def test_seeded_request_is_independent_of_its_batch(noisy_echo, k):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = [11, 22, 33, 44]
    alone = runtime(noisy_echo, k).generate([prompt], params)[0].token_ids
    rt = runtime(noisy_echo, k)
    others = [SamplingParams(max_new_tokens=n, temperature=t, seed=s) for n, t, s in [(5, 1.0, 1), (20, 0.0, None), (9, 0.5, 7)]]
    rt.add_request([1, 2, 3], others[0])
    rt.step()
    rt.add_request([9] * 7, others[1])
    target = rt.add_request(prompt, params)
    rt.add_request([4, 4], others[2])
    got: list[int] = []
    while rt.has_unfinished():
        for out in rt.step():
            if out.request_id == target:
                got += out.new_token_ids
    assert got == alone


def test_padded_rows_never_touch_live_or_free_slots(noisy_echo):
    """A request left alone in a bucket of 4 (after three finished) runs with three padded rows:
    they may write only the scratch slot."""
    rt = runtime(noisy_echo, 3, buckets=(4,))
    prompts = prompts_for(97, [6, 3, 4, 8], seed=9)
    for p, n in zip(prompts, [2, 2, 2, 30]):
        rt.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    while len(rt._running) != 1 or rt._waiting:
        rt.step()
    (live,) = rt._running.values()
    state = rt.state
    before = {name: buf.clone() for name, buf in state.named_buffers()}
    written = live.seq_len
    got = []
    while rt.has_unfinished():
        got += [t for o in rt.step() for t in o.new_token_ids]
    for name, buf in state.named_buffers():
        slot_axis = 1 if name.endswith("cache") else 0  # caches are [layers, slots, ...]
        for slot in range(state.num_slots):
            if slot == live.slot:
                continue
            assert torch.equal(buf.select(slot_axis, slot), before[name].select(slot_axis, slot)), (name, slot)
    # The live slot's cache below what it had written is untouched too (only new positions change).
    for name in ("target_cache", "mtp_cache"):
        assert torch.equal(getattr(state, name)[:, live.slot, : written - 1], before[name][:, live.slot, : written - 1])
    assert rt.stats()["graph_replays"]["target_verify/B4/K3"] > 0
    full = reference(noisy_echo, [prompts[3]], [30])[0]
    assert full[-len(got):] == got


def test_depth_can_change_between_steps(noisy_echo):
    rt = runtime(noisy_echo, 1, mtp_depths=(0, 1, 3))
    prompt = prompts_for(97, [6], seed=3)[0]
    rt.add_request(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    got, depths = [], [1, 3, 0, 3, 1]
    step = 0
    while rt.has_unfinished():
        rt.mtp_depth = depths[step % len(depths)]
        got += [t for o in rt.step() for t in o.new_token_ids]
        step += 1
    assert got == reference(noisy_echo, [prompt], [24])[0]
    keys = rt.stats()["graph_replays"]
    assert any("K3" in key for key in keys) and any("K0" in key for key in keys)


BAD_INPUT = [
    ([], SamplingParams(), r"^prompt: must not be empty$"),
    ([1, 97], SamplingParams(), r"^prompt\[1\]: token id 97 outside \[0, 97\)$"),
    ([1, -1], SamplingParams(), r"^prompt\[1\]: token id -1 outside \[0, 97\)$"),
    ([1] * 125, SamplingParams(max_new_tokens=5), r"^max_new_tokens: prompt length 125 \+ max_new_tokens 5 exceeds max_seq_len 128$"),
    ([1], SamplingParams(max_new_tokens=0), r"^max_new_tokens: must be >= 1, got 0$"),
    ([1], SamplingParams(temperature=-0.5), r"^temperature: must be >= 0, got -0.5$"),
    ([1], SamplingParams(top_p=0.0), r"^top_p: must be in \(0, 1\], got 0.0$"),
    ([1], SamplingParams(top_p=1.5), r"^top_p: must be in \(0, 1\], got 1.5$"),
    ([1], SamplingParams(top_k=-1), r"^top_k: must be >= 0 \(0 = no limit\), got -1$"),
    ([1], SamplingParams(stop_token_ids=(500,)), r"^stop_token_ids: token id 500 outside \[0, 97\)$"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_INPUT)
def test_bad_input_is_rejected_and_the_batch_goes_on(noisy_echo, prompt, params, message):
    rt = runtime(noisy_echo, 2, max_seq_len=128)
    good = prompts_for(97, [5], seed=2)[0]
    rt.add_request(good, GREEDY)
    got = [t for o in rt.step() for t in o.new_token_ids]
    with pytest.raises(ValueError, match=message):
        rt.add_request(prompt, params)
    with pytest.raises(ValueError, match=message.replace("^prompt", "^prompts\\[1\\]")):
        rt.generate([good, prompt], params)  # validated before anything runs
    while rt.has_unfinished():
        got += [t for o in rt.step() for t in o.new_token_ids]
    assert got == reference(noisy_echo, [good], [12])[0]


def test_bad_depth_and_options(noisy_echo):
    rt = runtime(noisy_echo, 2, mtp_depths=(0, 2))
    with pytest.raises(ValueError, match=r"^mtp_depth: 3 is not one of the captured depths \[0, 2\]$"):
        rt.mtp_depth = 3
    with pytest.raises(ValueError, match=r"^mtp_depth: must be >= 0, got -1$"):
        runtime(noisy_echo, -1)
    with pytest.raises(ValueError, match=r"^compile_backend: must be one of"):
        runtime(noisy_echo, 1, compile_backend="tvm")
    with pytest.raises(ValueError, match=r"^batch_sizes: must be positive integers"):
        runtime(noisy_echo, 1, buckets=(0, 2))


def test_more_requests_than_slots_queue(noisy_echo):
    prompts = prompts_for(97, [3, 5, 2, 8, 4, 6, 1], seed=4)
    rt = runtime(noisy_echo, 2, buckets=(1, 2))
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference(noisy_echo, prompts, [12] * len(prompts))
