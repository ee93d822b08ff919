"""The step plan (graphs/plan.py) is the single source of the graphs: the runtime runs, step by step,
the graphs its plan names, with the step tensors `example_inputs` builds graphs for, and over all
buckets and depths exactly the keys `graph_keys` lists for capture."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.compiler import CompiledGraphs
from compiled_mtp.graphs import plan as plan_module
from compiled_mtp.graphs import state as state_module
from compiled_mtp.graphs.plan import PREFILL, GraphKey, example_inputs, graph_keys, step_plan
from compiled_mtp.models.checkpoint import load_model

CHUNK = 8
PARAMS = SamplingParams(
    max_new_tokens=16, ignore_eos=True
)  # outlives a prefill, two steps at depth 0 and one at each other: 1 + 2 + 2 + 3 + 4 tokens at most


@pytest.fixture(scope="module")
def echo(echo_checkpoint):
    return load_model(echo_checkpoint)  # one layer and one MTP layer: the cheapest steps


def _check_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every graph check, on every call, that its step tensors have the shapes and dtypes of
    example_inputs(key): those a capture builds it for."""
    build = CompiledGraphs._build

    def checked(self: CompiledGraphs, key: GraphKey):
        graph = build(self, key)
        expected = [(t.shape, t.dtype) for t in example_inputs(key, self.model, CHUNK)]

        def call(*inputs: torch.Tensor):
            assert [(t.shape, t.dtype) for t in inputs] == expected, key.name
            return graph(*inputs)

        return call

    monkeypatch.setattr(CompiledGraphs, "_build", checked)


@given(
    buckets=st.lists(st.integers(1, 3), min_size=1, max_size=2, unique=True).map(sorted),
    depths=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True).map(sorted),
    seed=st.integers(0, 2**16),
)
def test_runtime_runs_the_plan_and_graph_keys_lists_it(echo, buckets, depths, seed):
    """Each bucket, full, takes one step at each depth in increasing order, two at depth 0 (so a step at
    K > 0 follows a depth-0 one where there is one, and M catches up then; with a lag window of one
    step, M's cache is filled before the second depth-0 step): each step replays its plan's graphs
    once, the catch-up and the fill exactly there, and the run replays every key of graph_keys and no
    other."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _check_inputs(monkeypatch)
        for module in (
            state_module,
            plan_module,
        ):  # M may lag one depth-0 step behind, so two in a row fill its cache
            monkeypatch.setattr(module, "LAG_WINDOW", 1)
        _run_plan(echo, buckets, depths, seed)


def _run_plan(model, buckets: list[int], depths: list[int], seed: int) -> None:
    rt = Runtime(
        model,
        mtp_depth=depths[0],
        mtp_depths=depths,
        batch_sizes=buckets,
        max_seq_len=64,
        prefill_chunk=CHUNK,
        compile_backend="eager",
    )
    gen = torch.Generator().manual_seed(seed)
    for b in buckets:
        ids = [
            rt.add_request(torch.randint(model.cfg.vocab_size, (CHUNK,), generator=gen).tolist(), PARAMS)
            for _ in range(b)
        ]
        expected = Counter({PREFILL: b})  # the first step admits them
        lagging = False  # M lags: a depth-0 step ran since it last caught up
        for k in depths:
            rt.mtp_depth = k
            plan = step_plan(b, k, tuple(depths))
            for _ in range(2 if plan.fill else 1):  # the window is one step: the second fills M's cache
                expected += Counter(
                    key for key in plan.keys if lagging or key not in (plan.catch_up, plan.fill)
                )
                before = Counter(rt.graphs.replays)
                rt.step()
                assert Counter(rt.graphs.replays) - before == expected, (b, k)
                expected, lagging = Counter(), k == 0
        for i in ids:
            rt.abort(i)
    assert set(rt.graphs.replays) == set(graph_keys(buckets, depths))
    assert len(graph_keys(buckets, depths)) == len(rt.graphs.replays)  # each key listed once
