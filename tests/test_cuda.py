"""The CUDA path, where there is a GPU (skipped elsewhere): real Inductor graphs with every custom pass,
replayed as CUDA graphs, against the reference (greedy) and the eager steps (sampled); the verify
graph's sampling fused into the op whose CUDA kernel is Triton's only when asked; the capture cache
refusing CUDA."""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.post_grad import post_grad_graphs
from compiled_mtp.graphs import plan, state
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.passes import fuse_verify_sampling
from compiled_mtp.passes.manager import REGISTRY
from compiled_mtp.reference import reference_generate
from tests.checkpoints import write_echo_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = [
    SamplingParams(max_new_tokens=10, temperature=t, top_k=tk, top_p=tp, seed=s, ignore_eos=True)
    for t, tk, tp, s in [(0.8, 0, 1.0, 1), (1.0, 5, 1.0, 2), (1.2, 0, 0.9, 3)]
]
PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 11, 60], [1]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_echo_checkpoint(tmp_path_factory.mktemp("cuda"), mtp_noise=0.3, attn_scale=0.5, seed=4)


def test_cuda_graphs_equal_the_reference(checkpoint, monkeypatch):
    """Greedy output of CUDA-graph replays equals the reference, at depth 2 and through a depth schedule
    that fills M's cache at depth 0 and catches it up after; sampled output equals the eager steps'."""
    for module in (plan, state):  # the third of three depth-0 steps fills M's cache first
        monkeypatch.setattr(module, "LAG_WINDOW", 2)
    model = load_model(checkpoint, device="cuda")
    options = {
        "mtp_depth": 2,
        "mtp_depths": (0, 2),
        "batch_sizes": (1, 2),
        "max_seq_len": 48,
        "prefill_chunk": 8,
    }
    rt = Runtime(model, compile_backend="inductor", **options)
    expected = [reference_generate(model, [p], 10, 0)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in rt.generate(PROMPTS, GREEDY)] == expected
    assert _scheduled(rt, (0, 0, 0, 2, 2, 0)) == expected
    eager = Runtime(model, compile_backend="eager", **options)
    assert [o.token_ids for o in rt.generate(PROMPTS, SAMPLED)] == [
        o.token_ids for o in eager.generate(PROMPTS, SAMPLED)
    ]
    assert rt.graphs.replays[GraphKey(GraphKind.mtp_fill, 2, 0)] >= 1
    assert rt.graphs.replays[GraphKey(GraphKind.mtp_catch_up, 2, 0)] >= 1
    assert rt.stats()["compiles"] == len(rt.graphs.replays)  # one each; fail_on_recompile raises


def _scheduled(rt: Runtime, depths: tuple[int, ...]) -> list[list[int]]:
    ids = [rt.add_request(p, GREEDY) for p in PROMPTS]
    got: dict[int, list[int]] = {i: [] for i in ids}
    schedule = iter(depths)
    while rt.has_unfinished():
        rt.mtp_depth = next(schedule, 2)
        for out in rt.step():
            got[out.request_id] += out.new_token_ids
    return list(got.values())


@pytest.mark.parametrize("fuse", [False, True])
def test_verify_sampling_is_fused_on_cuda_only_when_asked(checkpoint, monkeypatch, fuse):
    monkeypatch.setattr(fuse_verify_sampling, "FUSE_ON_CUDA", fuse)
    model = load_model(checkpoint, device="cuda")
    state = StaticState(model, num_slots=3, max_seq_len=32, max_depth=2)
    key = GraphKey(GraphKind.target_verify, 2, 2)
    _, after = post_grad_graphs(
        key.kind, model, state, example_inputs(key, model, 8), ("fuse_verify_sampling",)
    )
    fused = [n for n in after.graph.nodes if n.target is REGISTRY["fuse_verify_sampling"].op]
    assert len(fused) == fuse and all(n.args[0].meta["val"].is_cuda for n in fused)


def test_capture_cache_refuses_cuda_before_building_anything(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"^cache_dir: the capture cache holds CPU graphs only") as e:
        Runtime.from_pretrained(
            checkpoint,
            mtp_depth=1,
            batch_sizes=(1,),
            max_seq_len=48,
            prefill_chunk=8,
            device="cuda",
            cache_dir=tmp_path / "graphs",
        )
    assert "\n" not in str(e.value) and not (tmp_path / "graphs").exists()
