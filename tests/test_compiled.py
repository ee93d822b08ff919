"""The compiled path: every graph key traced whole (fullgraph, static shapes), output equal to the
eager reference, zero recompiles in steady state, and a focused set of real Inductor graphs.

"aot_eager" traces exactly what Inductor compiles (same Dynamo graphs, guards and recompile rules)
without code generation, so it covers every key quickly; the Inductor test compiles a few."""

from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch
from torch._inductor.graph import GraphLowering

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture import parallel
from compiled_mtp.capture.post_grad import post_grad_graphs
from compiled_mtp.graphs import plan, state
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.layers import MLP
from compiled_mtp.passes import narrow_linear, packed_linear
from compiled_mtp.reference import reference_generate
from tests.checkpoints import write_echo_checkpoint
from tests.precision import bfloat16_mlps, needs_bfloat16_dot

PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def noisy_echo(tmp_path_factory):
    return load_model(
        write_echo_checkpoint(tmp_path_factory.mktemp("noisy"), mtp_noise=0.3, attn_scale=0.5, seed=1)
    )


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(97, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def _expected(model, prompts, max_new=10):
    return [reference_generate(model, [p], max_new, 0)[0].token_ids for p in prompts]


def _one_bucket(model, depth: int) -> Runtime:
    return Runtime(
        model, mtp_depth=depth, batch_sizes=(1,), max_seq_len=48, compile_backend="aot_eager", prefill_chunk=8
    )


def _depths_0_and_2(model, backend: str, bucket: int = 1) -> Runtime:
    return Runtime(
        model,
        mtp_depth=2,
        mtp_depths=(0, 2),
        batch_sizes=(bucket,),
        max_seq_len=48,
        compile_backend=backend,
        prefill_chunk=8,
    )


def _scheduled(rt: Runtime, prompts, params, depths: tuple[int, ...], then: int) -> list[list[int]]:
    """Each request's tokens, streamed through steps at `depths` in turn, then at `then`."""
    got: dict[int, list[int]] = {rt.add_request(p, params): [] for p in prompts}
    schedule = iter(depths)
    while rt.has_unfinished():
        rt.mtp_depth = next(schedule, then)
        for out in rt.step():
            got[out.request_id] += out.new_token_ids
    return list(got.values())


def test_every_key_traces_whole_and_matches_reference(noisy_echo):
    rt = Runtime(
        noisy_echo,
        mtp_depth=0,
        mtp_depths=range(5),
        batch_sizes=(1, 2),
        max_seq_len=48,
        compile_backend="aot_eager",
        prefill_chunk=8,
    )
    prompts = _prompts(3)
    for k in range(5):
        rt.mtp_depth = k
        assert [o.token_ids for o in rt.generate(prompts, PARAMS)] == _expected(noisy_echo, prompts), f"K={k}"
    stats = rt.stats()
    # One compile per key replayed: a graph break would compile a key more than once.
    assert stats["compiles"] == len(stats["graph_replays"]) and stats["recompiles"] == 0
    # Bucket 2 ran every kind at every depth: verify at K=0; extend from K=1; decode from K=2 (on
    # bucket 1 draft_decode runs only where a lone request still lacks drafts).
    assert sum("/B2/" in key for key in stats["graph_replays"]) == 1 + 2 + 3 + 3 + 3


def test_mixed_workload_after_warmup_triggers_no_recompile(noisy_echo):
    rt = Runtime(
        noisy_echo,
        mtp_depth=2,
        mtp_depths=(0, 2),
        batch_sizes=(1, 2, 4),
        max_seq_len=64,
        compile_backend="aot_eager",
        prefill_chunk=8,
    )
    for n in (1, 2, 4):  # warm-up: every key once (back to K=2 after K=0 steps, M catches up)
        for prompt in _prompts(n, seed=n):
            rt.add_request(prompt, PARAMS)
        for k in (0, 0, 2):
            rt.mtp_depth = k
            rt.step()
        while rt.has_unfinished():
            rt.step()
    warm = rt.stats()["compiles"]
    mixed = [
        SamplingParams(max_new_tokens=n, temperature=t, top_k=tk, top_p=tp, seed=s, ignore_eos=True)
        for n, t, tk, tp, s in [
            (7, 0.0, 0, 1.0, None),
            (15, 0.8, 20, 0.9, 1),
            (3, 1.2, 0, 1.0, 2),
            (20, 0.5, 5, 1.0, 3),
            (11, 0.0, 0, 1.0, None),
        ]
    ]
    step = 0
    for prompt, params in zip(_prompts(5, seed=9), mixed):
        rt.add_request(prompt, params)
        for _ in range(step % 3):
            rt.step()
        step += 1
    while rt.has_unfinished():
        rt.mtp_depth = 2 if step % 4 else 0
        rt.step()
        step += 1
    # No new graph. Replays run under the "fail_on_recompile" stance, so a recompile would have raised
    # (test_step_tensor_unlike_the_traced_one_fails_loudly) and stats()["recompiles"] never counts one.
    assert rt.stats()["compiles"] == warm


def test_graphs_readied_before_their_first_call_build_on_it(noisy_echo):
    """The bench readies every key before any call (`parallel.ready`); without a cache that only wraps
    the step in torch.compile, so the first call builds, outside the stance that fails on a compile."""
    rt = _one_bucket(noisy_echo, depth=2)
    parallel.ready(rt, list(rt.graphs.keys))
    prompts = _prompts(2)
    assert [o.token_ids for o in rt.generate(prompts, PARAMS)] == _expected(noisy_echo, prompts)
    stats = rt.stats()
    assert (stats["compiles"], stats["recompiles"]) == (len(rt.graphs.keys), 0)


@pytest.mark.parametrize("change", ["width", "dtype"])
def test_step_tensor_unlike_the_traced_one_fails_loudly(noisy_echo, change):
    """Graphs skip Dynamo's guards on the model's and the state's modules, which never change after
    capture, but keep those on the step tensors: a call with noise of another width or dtype than
    its key traced raises instead of running the graph."""
    rt = _one_bucket(noisy_echo, depth=1)
    rt.generate(_prompts(1), PARAMS)
    key = GraphKey(GraphKind.target_verify, 1, 1)
    assert rt.graphs.replays[key] > 0
    slot = torch.tensor([rt.state.scratch_slot])
    noise = torch.zeros(1, 3) if change == "width" else torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="recompile"):
        rt.graphs(key, slot, torch.zeros(1, dtype=torch.long), noise)


def test_inductor_graphs_equal_the_reference(tmp_path, monkeypatch):
    """Real Inductor code with every custom pass, for every kind at K = 2 and 0 on bucket 1 (a
    2-layer model keeps compile short; test_inductor_paths.py builds bucket 4 at K = 1 and 3),
    drafting from half the vocabulary (draft_vocab): greedy output equals the reference, also when
    M's cache is filled during depth-0 steps and M catches up after them, sampled output the eager
    steps, and no graph copies a cache.
    Linears on 2-4 rows go through the few-row kernel, those on 1 row become Inductor's
    multiply-and-sum (narrow_linear), those on 5-16 rows (the prefill's chunk of 8) the panel kernel
    and every other one goes through the packed-weight op, although this model's weights are below
    the sizes where those pay; attention goes through live_attention."""
    monkeypatch.setattr(packed_linear, "MIN_WEIGHT", 0)
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
    for module in (plan, state):  # the third of three depth-0 steps fills M's cache first
        monkeypatch.setattr(module, "LAG_WINDOW", 2)
    model = load_model(write_echo_checkpoint(tmp_path, mtp_noise=0.3, attn_scale=0.5, seed=4, num_layers=2))
    model.restrict_drafts(torch.arange(0, 97, 2))
    rt = _depths_0_and_2(model, "inductor")
    prompts = _prompts(3, seed=5)
    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):  # also called on a cache hit
        outs = rt.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == _expected(model, prompts)
        assert _scheduled(rt, prompts, PARAMS, (0, 0, 0, 2, 2, 0), then=2) == _expected(model, prompts)
    assert rt.graphs.replays[GraphKey(GraphKind.mtp_fill, 1, 0)] >= 1
    assert rt.graphs.replays[GraphKey(GraphKind.mtp_catch_up, 1, 0)] >= 1
    _assert_state_written_in_place(rt, codes)
    sampled = [
        SamplingParams(max_new_tokens=10, temperature=t, top_k=tk, top_p=tp, seed=s, ignore_eos=True)
        for t, tk, tp, s in [(0.8, 0, 1.0, 1), (1.0, 5, 1.0, 2), (1.2, 0, 0.9, 3)]
    ]
    rt.mtp_depth = 2
    eager = _depths_0_and_2(model, "eager")
    assert [o.token_ids for o in rt.generate(prompts, sampled)] == [
        o.token_ids for o in eager.generate(prompts, sampled)
    ]
    stats = rt.stats()
    assert stats["compiles"] == len(stats["graph_replays"]) == len(codes)


@needs_bfloat16_dot
def test_bfloat16_products_give_the_same_tokens_at_every_depth_alone_and_batched(tiny_checkpoint):
    """With bfloat16_products on, the dense MLP (bfloat16 weights, read from panels on 1-16 rows)
    multiplies bfloat16-rounded rows, in the same graphs (csrc/panels.h). A row's
    products do not depend on the rows beside it, so greedy tokens are the same at depths 0 and 2,
    alone (beside padded rows) and four at a time, and through a schedule that switches depth."""
    model = load_model(tiny_checkpoint)
    with torch.no_grad():
        for weight in model.parameters():
            weight.copy_(weight.bfloat16())
    rt = _depths_0_and_2(model, "inductor", bucket=4)
    prompts = _prompts(4, seed=7)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = {}
    with bfloat16_mlps():
        for k in (0, 2):
            rt.mtp_depth = k
            outputs[k, 4] = [o.token_ids for o in rt.generate(prompts, params)]
            outputs[k, 1] = [rt.generate([p], params)[0].token_ids for p in prompts]
        outputs["switched"] = _scheduled(rt, prompts, params, (2, 0, 0, 2, 0, 2), then=0)
    assert all(tokens == outputs[0, 1] for tokens in outputs.values())
    dense = model.model.layers[0].mlp  # the MoE layer's shared experts stay in Inductor's code
    assert isinstance(dense, MLP)
    assert all(0 < torch.ops.compiled_mtp.panel_bytes(w) < w.nbytes for w in dense.parameters())


@pytest.mark.parametrize("key", plan.graph_keys((1,), (0, 2)), ids=lambda key: key.name)
def test_state_is_written_on_its_buffers_not_through_views(noisy_echo, key):
    """Every graph writes the static state by indexing each buffer itself. Written through a view
    (`drafts[slots, depth] = ...` reads `drafts[:, depth]`), a graph scatters the whole view back: at
    each draft it copied every slot's q over the vocabulary out and back, where one request's row
    was meant. In the post-grad graph such a write is a select_scatter or slice_scatter."""
    inputs = example_inputs(key, noisy_echo, prefill_chunk=8)
    buffers = StaticState(noisy_echo, num_slots=3, max_seq_len=32, max_depth=2)
    _, graph = post_grad_graphs(key.kind, noisy_echo, buffers, inputs, ())
    aten = torch.ops.aten
    scatters = (aten.select_scatter.default, aten.slice_scatter.default, aten.as_strided_scatter.default)
    assert [(n.target, n.args[0]) for n in graph.graph.nodes if n.target in scatters] == []


def _assert_state_written_in_place(rt: Runtime, codes: list[str]) -> None:
    """No graph allocates a buffer as large as a cache or one layer of it: each writes its rows in place, so a
    step costs what its rows read, not a copy of every slot's cache (Inductor copied the cache whole, and
    back, where a graph wrote it through a view)."""
    caches = {
        size
        for cache in (rt.state.target_cache, rt.state.mtp_cache)
        for size in (cache.numel(), cache[0].numel())
    }
    # Every kind ran: prefill, draft_decode, target_verify and draft_extend at K=2, target_verify at K=0,
    # mtp_fill, mtp_catch_up.
    assert {key.kind for key in rt.graphs.replays} == set(GraphKind)
    assert len(codes) == len(rt.graphs.replays)  # every graph's code, compiled or loaded
    for code in codes:
        shapes = [
            tuple(map(int, re.findall(r"\d+", dims)))
            for dims in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
        ]
        assert shapes, "no allocations found: has the generated code changed form?"
        assert not [s for s in shapes if math.prod(s) in caches]
