"""The Runtime over the step functions (run uncompiled here; test_compiled.py traces and compiles them)
against the eager reference loop, and every invariant the engine promises (docs/design.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.depth_policy import DepthPolicy
from compiled_mtp.graphs.state import LAG_WINDOW
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate
from tests.checkpoints import write_echo_checkpoint

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def echo(echo_checkpoint):
    """Every greedy draft is accepted: blocks of K + 1 tokens per step."""
    return load_model(echo_checkpoint)


@pytest.fixture(scope="module")
def noisy_echo_path(tmp_path_factory):
    return write_echo_checkpoint(tmp_path_factory.mktemp("noisy"), mtp_noise=0.3, attn_scale=0.5, seed=1)


@pytest.fixture(scope="module")
def noisy_echo(noisy_echo_path):
    """About 84% of drafts accepted: a mix of full, partial and empty accepts."""
    return load_model(noisy_echo_path)


def runtime(model, k=2, buckets=(1, 2, 4), **kw) -> Runtime:
    kw.setdefault("compile_backend", "eager")
    return Runtime(
        model,
        mtp_depth=k,
        batch_sizes=buckets,
        max_seq_len=kw.pop("max_seq_len", 64),
        prefill_chunk=kw.pop("prefill_chunk", 8),
        **kw,
    )


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
        assert {key.split("/")[1] for key in rt.stats()["graph_replays"] if "verify" in key} == {
            "B1",
            "B2",
            "B4",
        }


# A join-and-leave schedule: per request (prompt length, new tokens, the step it joins at).
JOIN_LEAVE = st.lists(
    st.tuples(st.integers(1, 10), st.integers(1, 14), st.integers(0, 6)), min_size=1, max_size=6
)


def assert_join_leave_parity(model, k: int, schedule: list[tuple[int, int, int]]) -> None:
    """Requests join between steps (more than there are slots: the rest queue) and leave when done;
    every one gets the reference loop's greedy tokens. `model` has a 97-token vocabulary."""
    prompts = prompts_for(97, [n for n, _, _ in schedule], seed=len(schedule))
    rt = runtime(model, k, buckets=(1, 2, 4))
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
    expected = reference(model, prompts, [m for _, m, _ in schedule])
    assert [got[ids[i]] for i in range(len(schedule))] == expected


@settings(max_examples=8)
@given(k=st.integers(0, 3), schedule=JOIN_LEAVE)
def test_greedy_parity_under_join_and_leave(noisy_echo, k, schedule):
    assert_join_leave_parity(noisy_echo, k, schedule)


@settings(max_examples=8)
@given(k=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.7, 1.3]), seed=st.integers(0, 2**31))
def test_accept_counts_stay_in_range(noisy_echo, k, temperature, seed):
    rt = runtime(noisy_echo, k)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, top_k=30, seed=seed, ignore_eos=True)
    ids = [rt.add_request(p, params) for p in prompts_for(97, [4, 7, 2], seed=seed % 1000)]
    finished = []
    while rt.has_unfinished():
        for out in rt.step():
            assert 1 <= len(out.new_token_ids) <= k + 1 or out.finished
            if out.finished:
                assert out.output.num_accepted_tokens <= out.output.num_draft_tokens
                assert len(out.output.token_ids) == 20
                finished.append(out.output)
    assert sorted(o.request_id for o in finished) == ids  # each request finished exactly once
    stats = rt.stats()
    assert all(0.0 <= r <= 1.0 for r in stats["acceptance_rate_per_position"])
    assert 1.0 <= stats["acceptance_length"] <= k + 1
    _assert_stats_add_up(rt, finished, prefills=3)


def _assert_stats_add_up(rt: Runtime, outputs: list, prefills: int) -> None:
    """The runtime's counters are the sums of its requests' (`outputs`: every request that ran; each
    prefill emits one token outside the decode statistics)."""
    stats = rt.stats()
    assert stats["draft_tokens"] == sum(o.num_draft_tokens for o in outputs)
    assert stats["accepted_tokens"] == sum(o.num_accepted_tokens for o in outputs)
    emitted = sum(len(o.token_ids) for o in outputs) - prefills
    assert stats["acceptance_length"] * stats["request_steps"] == pytest.approx(emitted)


def _full_acceptance_run(echo, k, max_new, stop=()):
    rt = runtime(echo, k, buckets=(1,))
    out = rt.generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=max_new, stop_token_ids=stop, ignore_eos=True)
    )[0]
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
    stopped, ignored = rt.generate(
        [[5, 6, 7]] * 2,
        [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, ignore_eos=True)],
    )
    assert stopped.token_ids == plain.token_ids[:5] and stopped.finish_reason == "stop"
    assert ignored.token_ids == plain.token_ids


@pytest.mark.parametrize("k", [0, 2, 3])
def test_seeded_request_is_independent_of_its_batch(noisy_echo, k):
    params = SamplingParams(
        max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True
    )
    prompt = [11, 22, 33, 44]
    alone = runtime(noisy_echo, k).generate([prompt], params)[0].token_ids
    rt = runtime(noisy_echo, k)
    others = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s)
        for n, t, s in [(5, 1.0, 1), (20, 0.0, None), (9, 0.5, 7)]
    ]
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


@pytest.mark.parametrize("k", [2, 3])
def test_a_held_depth_drafts_in_draft_extend(noisy_echo, k):
    """At a depth held from step to step, draft_extend drafts the next step's d_1..d_K: draft_decode
    runs only for a request's first step after its prefill (once per request here, one at a time),
    and the tokens stay the reference's."""
    prompts = prompts_for(97, [5, 9, 3], seed=k)
    rt = runtime(noisy_echo, k, buckets=(1,))
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference(noisy_echo, prompts, [GREEDY.max_new_tokens] * 3)
    stats = rt.stats()
    assert stats["graph_replays"][f"draft_decode/B1/K{k}"] == len(prompts)
    assert stats["graph_replays"][f"draft_extend/B1/K{k}"] == stats["decode_steps"] > 2 * len(prompts)


def test_padded_rows_never_touch_live_or_free_slots(noisy_echo):
    assert_padded_rows_write_only_scratch(noisy_echo)


def assert_padded_rows_write_only_scratch(model) -> None:
    """A request left alone in a bucket of 4 (after three finished) runs with three padded rows:
    they may write only the scratch slot. `model` has a 97-token vocabulary."""
    rt = runtime(model, 3, buckets=(4,))
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
            assert torch.equal(buf.select(slot_axis, slot), before[name].select(slot_axis, slot)), (
                name,
                slot,
            )
    # The live slot's cache below what it had written is untouched too (only new positions change).
    for name in ("target_cache", "mtp_cache"):
        assert torch.equal(
            getattr(state, name)[:, live.slot, : written - 1], before[name][:, live.slot, : written - 1]
        )
    assert rt.stats()["graph_replays"]["target_verify/B4/K3"] > 0
    full = reference(model, [prompts[3]], [30])[0]
    assert full[-len(got) :] == got


def test_catch_up_in_a_cache_shorter_than_its_window(noisy_echo):
    """max_seq_len 12, below the catch-up's window of LAG_WINDOW positions: its rows that run nowhere write
    scratch positions inside the cache (they ran past the scratch slot's end)."""
    rt = runtime(noisy_echo, 0, buckets=(1,), max_seq_len=12, mtp_depths=(0, 1))
    rt.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    got, schedule = [], iter((0, 0, 1))
    while rt.has_unfinished():
        rt.mtp_depth = next(schedule, 1)
        got += [t for o in rt.step() for t in o.new_token_ids]
    assert rt.stats()["graph_replays"]["mtp_catch_up/B1/K0"] == 1
    assert got == reference(noisy_echo, [[5, 6, 7]], [8])[0]


def test_abort_frees_the_slot_and_leaves_the_others_exact(noisy_echo):
    """Two slots. Aborted: a queued request, a running one after some decode steps, and one after
    the step it joined in (its whole prefill and first decode run inside that one step(), so no
    abort can fall between them). Each freed slot goes to the next request, whose greedy tokens are
    the reference's, as are the untouched request's; no step reports an aborted request again, and
    the statistics add up over what ran."""
    rt = runtime(noisy_echo, 2, buckets=(1, 2))
    prompts = prompts_for(97, [5, 3, 7, 4, 6], seed=12)
    keep, decoded, queued = (rt.add_request(p, GREEDY) for p in prompts[:3])
    got: dict[int, list[int]] = {}
    finished = []

    def step():
        for out in rt.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished.extend([out.output] * out.finished)

    def slot_of(request_id):
        (slot,) = [s for s, r in rt._running.items() if r.out.request_id == request_id]
        return slot

    for _ in range(3):
        step()
    assert queued not in got  # both slots taken
    dropped = rt.abort(queued)
    assert dropped.token_ids == [] and dropped.finish_reason == "abort"
    freed = slot_of(decoded)
    partial = rt.abort(decoded)
    assert partial.finish_reason == "abort" and partial.token_ids == got[decoded]
    at_abort = {decoded: list(got[decoded])}
    assert rt.abort(decoded) is None and rt.abort(queued) is None and rt.abort(999) is None  # no-ops
    fresh = rt.add_request(prompts[3], GREEDY)
    step()
    assert slot_of(fresh) == freed
    cut = rt.abort(fresh)
    at_abort[fresh] = list(got[fresh])
    late = rt.add_request(prompts[4], GREEDY)
    step()
    assert slot_of(late) == freed
    while rt.has_unfinished():
        step()
    assert {i: got[i] for i in at_abort} == at_abort == {
        decoded: partial.token_ids,
        fresh: cut.token_ids,
    } and queued not in got
    expected = reference(noisy_echo, prompts, [12] * 5)
    assert got[keep] == expected[0] and got[late] == expected[4]
    assert (
        partial.token_ids == expected[1][: len(partial.token_ids)]
        and cut.token_ids == expected[3][: len(cut.token_ids)]
    )
    assert sorted(o.request_id for o in finished) == [keep, late]
    assert rt.abort(keep) is None and all(o.finish_reason == "length" for o in finished)  # finished: a no-op
    _assert_stats_add_up(rt, finished + [partial, cut], prefills=4)


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
    (
        [1] * 125,
        SamplingParams(max_new_tokens=5),
        r"^max_new_tokens: prompt length 125 \+ max_new_tokens 5 exceeds max_seq_len 128$",
    ),
    ([1], SamplingParams(max_new_tokens=0), r"^max_new_tokens: must be >= 1, got 0$"),
    (
        [1],
        SamplingParams(temperature=-0.5),
        r"^temperature: must be finite and >= 0 \(0 = greedy\), got -0.5$",
    ),
    (
        [1],
        SamplingParams(temperature=float("inf")),
        r"^temperature: must be finite and >= 0 \(0 = greedy\), got inf$",
    ),
    (
        [1],
        SamplingParams(temperature=float("nan")),
        r"^temperature: must be finite and >= 0 \(0 = greedy\), got nan$",
    ),
    (
        [1],
        SamplingParams(temperature=1.0, seed=2**70),
        r"^seed: must be in \[0, 2\*\*63 - 1\] or None, got 1180591620717411303424$",
    ),
    ([1], SamplingParams(temperature=1.0, seed=-1), r"^seed: must be in \[0, 2\*\*63 - 1\] or None, got -1$"),
    ([1], SamplingParams(seed=1.5), r"^seed: must be an integer, got float 1.5$"),
    ([1, 2.0], SamplingParams(), r"^prompt\[1\]: token id must be an integer, got float 2.0$"),
    ([1, True], SamplingParams(), r"^prompt\[1\]: token id must be an integer, got bool True$"),
    (
        [1, np.float32(3)],
        SamplingParams(),
        r"^prompt\[1\]: token id must be an integer, got float32 np.float32\(3.0\)$",
    ),
    (
        [1],
        SamplingParams(stop_token_ids=(torch.tensor(0.5),)),
        r"^stop_token_ids\[0\]: token id must be an integer, got Tensor tensor\(0.5000\)$",
    ),
    ([1], SamplingParams(top_p=0.0), r"^top_p: must be in \(0, 1\], got 0.0$"),
    ([1], SamplingParams(top_p=1.5), r"^top_p: must be in \(0, 1\], got 1.5$"),
    ([1], SamplingParams(top_k=-1), r"^top_k: must be >= 0 \(0 = no limit\), got -1$"),
    ([1], SamplingParams(stop_token_ids=(500,)), r"^stop_token_ids\[0\]: token id 500 outside \[0, 97\)$"),
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


def test_a_bad_request_queues_none_of_its_batch(noisy_echo):
    rt = runtime(noisy_echo, 2)
    with pytest.raises(ValueError, match=r"^seed: "):
        rt.generate([[1, 2], [3]], [GREEDY, SamplingParams(max_new_tokens=4, temperature=1.0, seed=2**64)])
    assert rt.step() == [] and not rt.has_unfinished()


def test_integer_like_token_ids_are_plain_ids(noisy_echo):
    """NumPy and torch integers (and arrays of them) mean what the same ints mean, stop ids included."""
    prompt = prompts_for(97, [6], seed=5)[0]
    stop = reference(noisy_echo, [prompt], [12])[0][4]
    plain = runtime(noisy_echo, 2).generate(
        [prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))
    )[0]
    assert plain.finish_reason == "stop"
    for ids, stops in [
        (np.array(prompt), (np.int64(stop),)),
        (torch.tensor(prompt), (torch.tensor(stop),)),
        ([np.int32(t) for t in prompt], (np.uint8(stop),)),
    ]:
        out = runtime(noisy_echo, 2).generate([ids], SamplingParams(max_new_tokens=12, stop_token_ids=stops))[
            0
        ]
        assert out.token_ids == plain.token_ids and out.finish_reason == "stop"
        assert out.prompt_token_ids == prompt and all(type(t) is int for t in out.prompt_token_ids)


def test_bad_depth_and_options(noisy_echo):
    rt = runtime(noisy_echo, 2, mtp_depths=(0, 2))
    with pytest.raises(
        ValueError, match=r"^mtp_depth: 3 is not one of the captured depths \[0, 2\] \(or 'auto'\)$"
    ):
        rt.mtp_depth = 3
    with pytest.raises(ValueError, match=r"^mtp_depth: must be >= 0, got -1$"):
        runtime(noisy_echo, -1)
    with pytest.raises(ValueError, match=r"^compile_backend: must be one of"):
        runtime(noisy_echo, 1, compile_backend="tvm")
    with pytest.raises(ValueError, match=r"^batch_sizes: must be positive integers"):
        runtime(noisy_echo, 1, buckets=(0, 2))
    with pytest.raises(ValueError, match=r"^batch_sizes: must be an integer, got str 'a'$"):
        runtime(noisy_echo, 1, buckets=(2, "a"))
    for where in (lambda: runtime(noisy_echo, "fast"), lambda: Runtime.from_pretrained(mtp_depth="fast")):
        with pytest.raises(ValueError, match=r"^mtp_depth: must be an integer >= 0 or 'auto', got 'fast'$"):
            where()
    limit = noisy_echo.cfg.max_position_embeddings
    for n in (0, limit + 1):
        with pytest.raises(ValueError, match=rf"^max_seq_len: must be in \[1, {limit}\] \(the checkpoint's"):
            runtime(noisy_echo, 1, max_seq_len=n)
    assert Runtime(noisy_echo, mtp_depth=1, compile_backend="eager").max_seq_len == min(2048, limit)


def test_caches_memory_cannot_hold_are_a_one_line_error(noisy_echo, monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 34560000000000 bytes"
        )

    monkeypatch.setattr("compiled_mtp.runtime.StaticState", refused)
    with pytest.raises(
        ValueError, match=r"^max_seq_len: the caches of 4 slots .* x 64 positions do not fit in memory"
    ):
        runtime(noisy_echo, 1)


def test_more_requests_than_slots_queue(noisy_echo):
    prompts = prompts_for(97, [3, 5, 2, 8, 4, 6, 1], seed=4)
    rt = runtime(noisy_echo, 2, buckets=(1, 2))
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference(noisy_echo, prompts, [12] * len(prompts))


def _run_schedule(model, depth_at, joins: dict[int, int], prompts, max_new=40):
    """Requests join at the given steps; before each step the runtime's depth is set to depth_at(step).
    Returns each request's tokens, the accepted count of every K > 0 decode step by (request, the
    committed length it started from), each request's M cache entries and the runtime."""
    rt = runtime(model, 1, buckets=(1, 2, 4), mtp_depths=(0, 1), max_seq_len=96)
    index, tokens, accepted, slots, caches = {}, {}, {}, {}, {}
    step = 0
    while step == 0 or rt.has_unfinished():
        for i, at in joins.items():
            if at == step:
                index[rt.add_request(prompts[i], SamplingParams(max_new_tokens=max_new, ignore_eos=True))] = i
        rt.mtp_depth = depth_at(step)
        for out in rt.step():
            i = index[out.request_id]
            if i in tokens and rt.mtp_depth > 0:  # not the prefill's token
                accepted[i, len(prompts[i]) + len(tokens[i])] = len(out.new_token_ids) - 1
            tokens.setdefault(i, []).extend(out.new_token_ids)
            if out.finished:  # M has run over every position but the last committed token's
                caches[i] = rt.state.mtp_cache[:, slots[i], : len(prompts[i]) + len(tokens[i]) - 1].clone()
        slots |= {index[r.out.request_id]: r.slot for r in rt._running.values()}
        step += 1
    return tokens, accepted, caches, rt


@pytest.mark.parametrize("model_name", ["tiny", "noisy_echo"])
def test_draft_state_stays_current_through_depth_zero(model_name, request):
    """A stretch of depth-0 steps (longer than the lag window, so M's cache is filled once inside it) with a
    request joining in the middle and one joining at the switch back: afterwards M's cache, and so
    the drafts and their acceptance, are those of a run that never left K = 1."""
    model = request.getfixturevalue(model_name)
    prompts = prompts_for(model.cfg.vocab_size, [6, 9, 4], seed=11)
    back = 2 + LAG_WINDOW + 5  # the step that returns to K = 1
    joins = {0: 0, 1: back // 2, 2: back}
    new = back + 20
    never_left = _run_schedule(model, lambda step: 1, joins, prompts, new)
    switched = _run_schedule(model, lambda step: 0 if 2 <= step < back else 1, joins, prompts, new)
    assert switched[0] == never_left[0]  # greedy
    after = {key: a for key, a in switched[1].items() if key[1] > len(prompts[key[0]]) + back - 1}
    common = after.keys() & never_left[1].keys()
    assert len(common) >= 5 and {key: after[key] for key in common} == {
        key: never_left[1][key] for key in common
    }
    for i in joins:
        torch.testing.assert_close(switched[2][i], never_left[2][i], atol=1e-5, rtol=1e-5)
    kinds = {key.kind.name for key in switched[3].graphs.replays}
    assert {"mtp_fill", "mtp_catch_up"} <= kinds


def test_auto_depth_is_greedy_exact_and_tries_every_depth(noisy_echo):
    prompts = prompts_for(97, [5, 1, 12, 9, 3], seed=5)
    max_new = [20, 31, 12, 40, 25]
    rt = runtime(noisy_echo, "auto")
    assert rt.depths == (0, 1, 2, 3)
    outs = rt.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new])
    assert [o.token_ids for o in outs] == reference(noisy_echo, prompts, max_new)
    histogram = rt.stats()["depth_histogram"]
    assert set(histogram) == {0, 1, 2, 3} and sum(histogram.values()) == rt.stats()["decode_steps"]


STEADY_COSTS = {0: 1.0, 1: 3.0, 2: 4.0, 3: 5.0}  # K=0 the cheapest by far, as at a large batch


class _SteadyCosts(DepthPolicy):
    """Each step timed at its depth's STEADY_COSTS, and the decode step of every choose() call noted."""

    def __init__(self, depths, steps) -> None:
        super().__init__(depths)
        self.asked: list[int] = []
        self._decode_steps = steps

    def choose(self, bucket, rates, remaining):
        self.asked.append(self._decode_steps())
        before = self._hold
        k = super().choose(bucket, rates, remaining)
        assert not self.repeats or self._hold is not before  # repeats come with a hold worked out anew
        return k

    def record_cost(self, bucket, depth, seconds):
        super().record_cost(bucket, depth, STEADY_COSTS[depth])

    def record_repeats(self, bucket, depth, seconds):
        assert depth == 0  # only a choice held at depth 0 runs unasked, whatever the bucket before
        super().record_repeats(bucket, depth, seconds)


def test_auto_repeats_a_held_depth_0_without_asking_and_asks_again_when_the_batch_changes(noisy_echo):
    """Holding depth 0, auto's runtime runs the steps the policy's `repeats` allows without asking it,
    asks again on the step after a request joins or finishes, and its greedy output stays exact."""
    prompts = prompts_for(97, [5, 9, 3], seed=7)
    max_new = [80, 60, 40]
    rt = runtime(noisy_echo, "auto", max_seq_len=96)
    rt._policy = policy = _SteadyCosts(rt.depths, lambda: rt.stats()["decode_steps"])
    got: dict[int, list[int]] = {}
    changed = []  # the decode steps run before each change of the batch
    for i in range(2):
        rt.add_request(prompts[i], SamplingParams(max_new_tokens=max_new[i], ignore_eos=True))
    while rt.has_unfinished():
        if rt.stats()["decode_steps"] == 40 and len(got) == 2:  # joins before the 41st decode step
            rt.add_request(prompts[2], SamplingParams(max_new_tokens=max_new[2], ignore_eos=True))
            changed.append(40)
        outs = rt.step()
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if any(out.finished for out in outs):
            changed.append(rt.stats()["decode_steps"])
    assert [got[i] for i in sorted(got)] == reference(noisy_echo, prompts, max_new)
    histogram, steps = rt.stats()["depth_histogram"], rt.stats()["decode_steps"]
    assert histogram[0] > steps // 2 and len(policy.asked) < steps // 2  # most steps repeated
    assert set(changed[:-1]) <= set(policy.asked)  # the step after each change asked


@pytest.mark.parametrize("n", [1, 17, 97])
def test_restricted_draft_vocabulary_keeps_greedy_output_and_drafts_inside_it(noisy_echo_path, n):
    """draft_vocab: drafts come from the chosen tokens only (drafting outside them would be a bug),
    and the output is plain greedy decoding's whatever the subset."""
    model = load_model(noisy_echo_path)
    subset = torch.randperm(97, generator=torch.Generator().manual_seed(n))[:n]
    model.restrict_drafts(subset)
    prompts = prompts_for(97, [5, 1, 12], seed=n)
    rt = runtime(model, 3, mtp_depths=(0, 3))
    drafted = set()
    for p in prompts:
        rt.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
    got: dict[int, list[int]] = {}
    while rt.has_unfinished():
        rt.mtp_depth = 0 if len(got) % 3 == 1 else 3
        for out in rt.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        drafted |= {int(t) for r in rt._running.values() for t in rt.state.drafts[r.slot]}
    assert [got[i] for i in sorted(got)] == reference(model, prompts, [20] * 3)
    assert drafted and drafted <= set(subset.tolist())
    full_vocab_model = load_model(noisy_echo_path)
    if n == 97:  # every token, in another order: the same drafts as the full head
        full = runtime(full_vocab_model, 3).generate(
            prompts, SamplingParams(max_new_tokens=20, ignore_eos=True)
        )
        assert [o.num_accepted_tokens for o in full] == [
            o.num_accepted_tokens
            for o in runtime(model, 3).generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
        ]


def test_restricted_draft_distributions_stay_on_the_draft_vocabulary(noisy_echo_path):
    """draft_vocab under sampling, which reads q where greedy verification does not: after every
    depth-3 step (depth-0 steps and the catch-ups after them in between), each request's q_1..q_3
    over the whole vocabulary are 0 off the chosen tokens, sum to 1 and hold the token drafted from
    them."""
    model = load_model(noisy_echo_path)
    subset = torch.randperm(97, generator=torch.Generator().manual_seed(11))[:17]
    model.restrict_drafts(subset)
    off = torch.ones(97, dtype=torch.bool)
    off[subset] = False
    rt = runtime(model, 3, mtp_depths=(0, 3))
    for i, p in enumerate(prompts_for(97, [5, 9, 3], seed=12)):
        rt.add_request(
            p, SamplingParams(max_new_tokens=24, temperature=0.9, top_k=6, seed=i, ignore_eos=True)
        )
    checked = 0
    while rt.has_unfinished():
        rt.mtp_depth = 0 if rt.stats()["decode_steps"] % 4 == 2 else 3
        rt.step()
        if rt.mtp_depth == 0:
            continue
        for r in rt._running.values():
            q, drafts = rt.state.draft_probs[r.slot], rt.state.drafts[r.slot]
            assert not q[:, off].any()
            torch.testing.assert_close(q.sum(-1), torch.ones(3))
            assert (q.gather(1, drafts[:, None]) > 0).all()
            checked += 1
    assert checked >= 10


def test_a_step_accepts_what_its_text_accepts_at_any_depth(noisy_echo):
    """Greedy drafts depend only on the text before them, and a prefill leaves M where decoding
    does: a step at depth K taken with g tokens generated accepts min(K, a[g]) drafts, where a[g] is
    what one K=3 step accepts right after prefilling the same text. benchmarks/acceptance_trace.py
    replays any schedule of depths up to its steps' from that."""
    prompt, new = prompts_for(97, [6], seed=3)[0], 20
    greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
    text = runtime(noisy_echo, 3, buckets=(1,)).generate([prompt], greedy)[0].token_ids
    one_step, rt = SamplingParams(max_new_tokens=2, ignore_eos=True), runtime(noisy_echo, 3, buckets=(1,))
    a = [0] + [rt.generate([prompt + text[: g - 1]], one_step)[0].accepted_per_step[0] for g in range(1, new)]
    assert 0 < sum(a) < 3 * (new - 1)  # some drafts rejected, some accepted
    for k in (1, 2, 3):
        steps = runtime(noisy_echo, k, buckets=(1,)).generate([prompt], greedy)[0].accepted_per_step
        g = 1
        for accepted in steps:
            assert accepted == min(k, a[g])
            g += accepted + 1
        assert g >= new
