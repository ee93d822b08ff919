"""Real Inductor graphs with every custom pass forced on (as in test_compiled.py's Inductor test) on
the distilled checkpoint, its weights rounded to bfloat16 values as a bfloat16 checkpoint's are:
depths 1 and 3 end to end with the reference's tokens and accepted counts (test_compiled.py's
Inductor test runs depth 2), padded rows of bucket 4 beside 3 live requests, and a seeded request
alone and in a full batch. The ops read the weights from bfloat16 panels, and bucket 4's 8-16 rows
take AMX's tile products where the machine has them. One runtime (buckets 1 and 4) serves every
test, so each graph compiles once: 9 graphs."""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.graphs.plan import GraphKey, GraphKind
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.passes import narrow_linear, packed_linear
from compiled_mtp.reference import reference_generate
from tests.test_acceptance import assert_acceptance_parity, prompts_for


@pytest.fixture(scope="module")
def compiled(distilled_checkpoint):
    """Linears on 2-4 rows take the few-row kernel, those on 1 row narrow_linear's multiply-and-sum,
    those on 5-16 rows (the verify at B=4) the panel kernel, the rest the packed-weight op, although
    these weights are below the sizes where those pay.
    The thresholds are read when a graph compiles, so they stay set for the whole module."""
    model = load_model(distilled_checkpoint)
    with torch.no_grad():
        for weight in model.parameters():
            weight.copy_(weight.bfloat16())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_linear, "MIN_WEIGHT", 0)
        mp.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
        rt = Runtime(
            model,
            mtp_depth=3,
            mtp_depths=(1, 3),
            batch_sizes=(1, 4),
            max_seq_len=48,
            compile_backend="inductor",
            prefill_chunk=8,
        )
        yield model, rt
    assert rt.stats()["recompiles"] == 0


@pytest.mark.parametrize("k", [1, 3])
def test_every_depth_equals_the_reference(compiled, k):
    model, rt = compiled
    rt.mtp_depth = k
    for prompt in prompts_for(97, [5, 11], seed=20 + k):  # one at a time: bucket 1
        assert_acceptance_parity(rt, model, k, [prompt], [24])


def test_padded_row_touches_no_live_or_free_slot(compiled):
    """Three requests in bucket 4: the padded row writes only the scratch slot. The free slot keeps
    every buffer as it was, and the live ones generate the reference's tokens and accepted counts."""
    model, rt = compiled
    rt.mtp_depth = 3
    prompts = prompts_for(97, [6, 3, 9], seed=30)
    max_new = [10, 18, 26]
    ids = [
        rt.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_new)
    ]
    outputs = rt.step()  # prefills
    (free,) = set(range(rt.state.num_slots)) - set(rt._running)
    state = rt.state
    before = {
        name: buf.select(1 if name.endswith("cache") else 0, free).clone()
        for name, buf in state.named_buffers()
    }
    while rt.has_unfinished():
        outputs += rt.step()
    for name, buf in state.named_buffers():
        assert torch.equal(buf.select(1 if name.endswith("cache") else 0, free), before[name]), name
    assert rt.graphs.replays[GraphKey(GraphKind.target_verify, 4, 3)] > 0
    finished = {o.request_id: o.output for o in outputs if o.finished}
    refs = [reference_generate(model, [p], n, 3)[0] for p, n in zip(prompts, max_new)]
    assert [finished[i].token_ids for i in ids] == [r.token_ids for r in refs]
    assert [finished[i].accepted_per_step for i in ids] == [r.accepted for r in refs]


def test_seeded_request_alone_and_in_a_full_batch(compiled):
    """The same seeded request at bucket 1 and among three others at bucket 4."""
    _, rt = compiled
    rt.mtp_depth = 3
    params = SamplingParams(
        max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True
    )
    prompt = [11, 22, 33, 44]
    alone = rt.generate([prompt], params)[0]
    others = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s, ignore_eos=True)
        for n, t, s in [(20, 1.0, 1), (20, 0.0, None), (20, 0.5, 7)]
    ]
    batched = rt.generate([[1, 2, 3], prompt, [9] * 7, [4, 4]], [others[0], params, *others[1:]])[1]
    assert (
        rt.graphs.replays[GraphKey(GraphKind.target_verify, 1, 3)] > 0
        and rt.graphs.replays[GraphKey(GraphKind.target_verify, 4, 3)] > 0
    )
    assert batched.token_ids == alone.token_ids
    assert batched.accepted_per_step == alone.accepted_per_step
