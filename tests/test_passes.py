"""The custom FX passes on real post-grad graphs (compiled_mtp/capture/post_grad.py takes them
where Inductor runs the passes; no code generation): what each pass changes in the graph, and that
the graph computes the same with and without it. Real compiled code with every pass on is checked in
test_compiled.py (torch.compile) and test_capture.py (AOTInductor)."""

from __future__ import annotations

import copy
import math
import operator
import weakref
from typing import ClassVar

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.proxy_tensor import make_fx

from compiled_mtp import DEFAULT_MODEL
from compiled_mtp.capture.post_grad import passes_applied, post_grad_graphs
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.deepseek_v3 import Linear
from compiled_mtp.ops import packed_linear
from compiled_mtp.passes import bfloat16_reads, narrow_linear
from compiled_mtp.passes import packed_linear as packed_linear_pass
from compiled_mtp.passes.fold_key_constants import PREFIX, key_only
from compiled_mtp.passes.fx_nodes import calls_of
from compiled_mtp.passes.manager import REGISTRY, PassManager, available, inductor_options
from compiled_mtp.passes.packed_linear import LINEAR
from compiled_mtp.passes.region import Unfusable, one_agreeing
from compiled_mtp.passes.small_topk import SmallTopk
from compiled_mtp.passes.weights import bfloat16_values

FUSED = REGISTRY["fuse_verify_sampling"].op_for({"cpu"})  # greedy_verify_sample where the C++ ops build
ROUTED_EXPERTS = torch.ops.compiled_mtp.routed_experts.default
DRAFT_FUSED = REGISTRY["fuse_draft_sampling"].op  # greedy_draft_sample where the C++ ops build
LIVE_ATTENTION = torch.ops.compiled_mtp.live_attention.default
PANELS = torch.ops.compiled_mtp.panel_linear.default

aten = torch.ops.aten
ALL = available()
# (temperature, top_k, top_p) per slot: greedy, plain temperature, top-k, top-p, both
PARAMS = [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 5, 1.0), (1.2, 0, 0.7), (0.6, 20, 0.9)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def state(model):
    return StaticState(model, num_slots=5, max_seq_len=32, max_depth=3)


def _replace_op(monkeypatch, name, op):
    """Pass `name` replaces its regions with `op` instead of its own."""
    monkeypatch.setattr(type(REGISTRY[name]), "op", property(lambda self: op))


# Each step's post-grad graph before the passes, by model, state and key: lowering a step takes about
# ten times as long as its passes, so each is lowered once and every test's passes run on a copy of it
# (test_passes_on_a_copy_give_inductors_graph checks that this is the graph Inductor's run gives).
_LOWERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _graphs(kind, b, k, model, state, passes):
    key = GraphKey(GraphKind[kind], b, k)
    lowered = _LOWERED.setdefault(model, weakref.WeakKeyDictionary()).setdefault(state, {})
    if key not in lowered:
        inputs = example_inputs(key, model, prefill_chunk=8)
        lowered[key], _ = post_grad_graphs(key.kind, model, state, inputs, ())
    return passes_applied(lowered[key], model, ()), passes_applied(lowered[key], model, passes)


@pytest.mark.parametrize("kind, b, k", [("target_verify", 2, 3), ("draft_extend", 1, 3)])
def test_passes_on_a_copy_give_inductors_graph(model, state, kind, b, k, monkeypatch):
    """Every pass, run on a copy of the graph before them (as _graphs runs them on a step lowered
    before), gives the code Inductor's own run of them gives."""
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
    key = GraphKey(GraphKind[kind], b, k)
    before, after = post_grad_graphs(key.kind, model, state, example_inputs(key, model, prefill_chunk=8), ALL)
    assert passes_applied(before, model, ALL).code == after.code
    assert _count(after, LIVE_ATTENTION) > 0  # the passes took their regions


def _randomize(state, model, seed):
    """A mid-generation state: filled caches, drafts d and their distributions q (d drawn from q, or
    the target's likely token), mixed sampling parameters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for buf in (state.target_cache, state.mtp_cache, state.mtp_hidden):
            buf.copy_(torch.randn(buf.shape, generator=gen))
        probs = torch.softmax(3 * torch.randn(state.draft_probs.shape, generator=gen), dim=-1)
        state.draft_probs.copy_(probs)
        state.drafts.copy_(
            torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=gen).view(state.drafts.shape)
        )
        state.last_token.random_(0, model.cfg.vocab_size, generator=gen)
    for slot in range(state.num_slots):
        state.set_sampling(slot, *PARAMS[(slot + seed) % len(PARAMS)])


def _step_inputs(kind, b, k, model, seed):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(5, generator=gen)[:b]
    seq_lens = torch.randint(2, 20, (b,), generator=gen)
    if kind == "target_verify":
        return slots, seq_lens, torch.rand(b, k + 1, generator=gen)
    if kind == "draft_decode":
        drafted = torch.randint(0, k + 1, (b,), generator=gen)
        return slots, seq_lens, drafted, torch.rand(b, k - 1, generator=gen)
    if kind == "draft_extend":
        accepted = torch.randint(0, k + 1, (b,), generator=gen)
        committed = torch.randint(0, model.cfg.vocab_size, (b, k + 1), generator=gen)
        hidden = torch.randn(b, k + 1, model.cfg.hidden_size, generator=gen)
        return slots, seq_lens, accepted, committed, hidden, torch.rand(b, k, generator=gen)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 8), generator=gen)
    return (
        tokens,
        tokens.roll(-1),
        slots[:1],
        torch.zeros(1, dtype=torch.long),
        torch.tensor([6]),
        torch.rand(1, 2, generator=gen),
    )


def _run(graph, state, model, inputs, seed):
    """Outputs and final state of one graph call from the state `_randomize(seed)` makes."""
    _randomize(state, model, seed)
    out = graph(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [t.clone() for t in outs if t is not None], {k: v.clone() for k, v in state.state_dict().items()}


def _assert_same(before, after, state, model, kind, b, k, seeds=(0, 1, 2), exact=True):
    for seed in seeds:
        inputs = _step_inputs(kind, b, k, model, seed)
        (out_b, state_b), (out_a, state_a) = (
            _run(before, state, model, inputs, seed),
            _run(after, state, model, inputs, seed),
        )
        for x, y in list(zip(out_b, out_a)) + [(state_b[n], state_a[n]) for n in state_b]:
            if exact or not x.is_floating_point():
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def _count(graph, target):
    return sum(1 for n in graph.graph.nodes if n.target is target)


@pytest.mark.parametrize("b,k", [(1, 0), (2, 1), (3, 3)])
def test_verify_sampling_becomes_one_fused_op(model, state, b, k):
    before, after = _graphs("target_verify", b, k, model, state, ("fuse_verify_sampling",))
    assert (
        _count(before, FUSED) == 0
        and _count(before, aten.sort.stable) == 1
        and _count(before, aten.cumsum.default) == 2
    )
    assert (
        _count(after, FUSED) == 1
        and _count(after, aten.sort.stable) == 0
        and _count(after, aten.cumsum.default) == 0
    )
    removed = len(before.graph.nodes) - len(after.graph.nodes)
    assert removed >= 60, f"{len(before.graph.nodes)} -> {len(after.graph.nodes)} nodes"
    _assert_same(before, after, state, model, "target_verify", b, k, seeds=range(5))


@pytest.mark.parametrize(
    "kind,b,k,drafts",
    [
        ("draft_extend", 1, 1, 1),
        ("draft_extend", 3, 2, 2),
        ("draft_decode", 2, 3, 2),
        ("draft_decode", 1, 2, 1),
    ],
)
def test_each_draft_sampling_becomes_one_fused_op(model, state, kind, b, k, drafts):
    """One op per draft the graph samples, no sort left; the same drafts, draft distributions and
    state as without the pass, over mixed greedy / temperature / top-k / top-p requests."""
    before, after = _graphs(kind, b, k, model, state, ("fuse_draft_sampling",))
    assert _count(before, DRAFT_FUSED) == 0 and _count(before, aten.sort.stable) == drafts
    assert (
        _count(after, DRAFT_FUSED) == drafts
        and _count(after, aten.sort.stable) == 0
        and _count(after, aten.cumsum.default) == 0
    )
    assert len(before.graph.nodes) - len(after.graph.nodes) >= 40 * drafts, (
        f"{len(before.graph.nodes)} -> {len(after.graph.nodes)} nodes"
    )
    _assert_same(before, after, state, model, kind, b, k, seeds=range(5), exact=False)


def test_draft_sampling_that_disagrees_with_the_op_stays(model, state, monkeypatch, caplog):
    def wrong(logits, temperature, top_k, top_p, u):
        tokens, q = torch.ops.compiled_mtp.draft_sample(logits, temperature, top_k, top_p, u)
        return (tokens + 1) % logits.shape[-1], q

    _replace_op(monkeypatch, "fuse_draft_sampling", wrong)
    with caplog.at_level("WARNING", logger="compiled_mtp.passes"):
        _, after = _graphs("draft_extend", 2, 1, model, state, ("fuse_draft_sampling",))
    assert _count(after, aten.sort.stable) == 1
    assert (
        "fuse_draft_sampling: left as traced: the op reproduces the region on 0%, 0%, 0%, 0%, 0%, 0% of the probes "
        "under the 6 assignments of its inputs, expected exactly one at 90% or more"
    ) in caplog.text


@pytest.mark.parametrize(
    "kind,b,k", [("prefill", 1, 0), ("draft_decode", 2, 3), ("target_verify", 2, 2), ("draft_extend", 2, 2)]
)
def test_no_key_only_op_survives_the_passes(model, state, kind, b, k):
    before, after = _graphs(kind, b, k, model, state, ALL)
    fixed = key_only(before.graph)
    assert any(n.target is torch.ops.prims.iota.default for n in fixed), "expected aranges before folding"
    assert key_only(after.graph) == set()
    assert any(n.op == "get_attr" and n.target.startswith(PREFIX) for n in after.graph.nodes)
    _assert_same(before, after, state, model, kind, b, k, seeds=(0,), exact=False)


@pytest.mark.parametrize("kind,b,k", [("target_verify", 2, 2), ("draft_extend", 1, 1)])
def test_folding_alone_changes_no_value(model, state, kind, b, k):
    before, after = _graphs(kind, b, k, model, state, ("fold_key_constants",))
    assert len(key_only(before.graph)) >= 10 and key_only(after.graph) == set()
    folded = {name: value.clone() for name, value in after.named_buffers() if name.startswith(PREFIX)}
    assert folded
    _assert_same(before, after, state, model, kind, b, k)  # calls `after` once per seed, in turn
    # No call writes a constant (a folded zero accumulator updated in place would be one): each sees
    # the values folded at compile time.
    assert all(
        torch.equal(value, folded[name]) for name, value in after.named_buffers() if name.startswith(PREFIX)
    )


def _linear_weights(graph):
    """Weights read by mm(x, permute(W)) / addmm(b, x, permute(W)) nodes."""
    mms = [n for n in graph.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    return [
        n.args[-1].args[0]
        for n in mms
        if n.args[-1].target is aten.permute.default and n.args[-1].args[0].op in ("placeholder", "get_attr")
    ]


@pytest.fixture
def pack_every_size(monkeypatch):
    """The tiny model's weights are below the sizes where packing pays: rewrite them anyway."""
    monkeypatch.setattr(packed_linear_pass, "MIN_WEIGHT", 0)


def test_packed_linear_leaves_small_weights_to_inductor(model, state):
    before, after = _graphs("draft_extend", 2, 2, model, state, ("packed_linear",))
    assert _count(after, LINEAR) == 0 and len(_linear_weights(after)) == len(_linear_weights(before))


def test_packed_linear_rewrites_every_linear(model, state, pack_every_size):
    before, after = _graphs("draft_extend", 2, 2, model, state, ("packed_linear",))
    weights = _linear_weights(before)
    assert len(weights) >= 8  # MLA projections, MLP, eh_proj, lm_head
    assert _linear_weights(after) == [] and _count(after, LINEAR) == len(weights)
    # Without packed copies the op is F.linear: identical values.
    _assert_same(before, after, state, model, "draft_extend", 2, 2)
    assert packed_linear.pack_linears(model) > 0
    _assert_same(before, after, state, model, "draft_extend", 2, 2, exact=False)


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_packed_linear_op_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(48, 40)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48, generator=gen))
    wrapped = Linear(48, 40, bias=True)
    wrapped.weight, wrapped.bias = layer.weight, layer.bias
    x = torch.randn(rows, 48, generator=gen)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(
        packed_linear.linear(x, layer.weight.detach(), layer.bias.detach()), expected
    )  # not packed yet
    assert packed_linear.pack_linears(wrapped) == int(packed_linear.available())
    torch.testing.assert_close(
        packed_linear.linear(x, layer.weight.detach(), layer.bias.detach()), expected, rtol=1e-5, atol=1e-5
    )
    with torch.no_grad():  # an in-place update: the packed copy must follow, not serve stale weights
        layer.weight.mul_(-2.0)
    torch.testing.assert_close(
        packed_linear.linear(x, layer.weight.detach(), layer.bias.detach()), layer(x), rtol=1e-5, atol=1e-5
    )
    bf16 = layer.weight.detach().bfloat16()
    assert torch.equal(
        packed_linear.linear(x.bfloat16(), bf16, None), torch.nn.functional.linear(x.bfloat16(), bf16)
    )


@pytest.mark.parametrize(
    "kind,b,k,rows", [("draft_extend", 2, 3, 2), ("draft_decode", 3, 2, 3), ("target_verify", 2, 2, 6)]
)
def test_lm_head_runs_only_on_rows_that_are_used(model, state, kind, b, k, rows, pack_every_size):
    """One row per request in each draft step (K of them in draft_extend, K - 1 in draft_decode); all
    K+1 in verify."""
    _, after = _graphs(kind, b, k, model, state, ("packed_linear",))
    vocab = model.cfg.vocab_size
    head_rows = [
        n.args[0].meta["val"].shape[0]
        for n in after.graph.nodes
        if n.target is LINEAR and n.args[1].meta["val"].shape[0] == vocab
    ]
    assert head_rows == [rows] * {"draft_extend": k, "draft_decode": k - 1}.get(kind, 1)


@pytest.mark.parametrize(
    "kind,b,k,share",
    [("draft_extend", 1, 3, "all"), ("draft_extend", 2, 2, "some"), ("target_verify", 2, 2, "none")],
)
def test_narrow_linear_takes_every_linear_on_few_rows(model, state, kind, b, k, share):
    """Linears on at most 4 rows (all of draft_extend at B=1, K=3: 4 rows through M, then 1 through the LM
    head and each draft step; at B=2, K=2 its LM head and draft step, not the 6 rows through M; none
    of a 6-row verify) become a multiply-and-sum over the
    weight in place, and so do batched products of at most 16 rows on small slices (the attention's
    per-head products); the others stay."""
    before, after = _graphs(kind, b, k, model, state, ("narrow_linear",))
    rows = [
        n.args[-2].meta["val"].shape[0]
        for n in before.graph.nodes
        if n.target in (aten.mm.default, aten.addmm.default)
    ]
    few = sum(r <= 4 for r in rows)
    assert {"all": few == len(rows) > 0, "some": 0 < few < len(rows), "none": few == 0}[share]
    assert len(_linear_weights(after)) == len(_linear_weights(before)) - few
    bmm_rows = [n.args[0].meta["val"].shape[1] for n in before.graph.nodes if n.target is aten.bmm.default]
    few_bmm = sum(r <= 16 for r in bmm_rows)
    assert bmm_rows and _count(after, aten.bmm.default) == len(bmm_rows) - few_bmm
    assert _count(after, aten.sum.dim_IntList) - _count(before, aten.sum.dim_IntList) == few + few_bmm
    _assert_same(before, after, state, model, kind, b, k, exact=False)


@pytest.mark.parametrize(
    "rows,weight,narrow",
    [(4, 1 << 20, True), (5, 1 << 16, True), (16, 1 << 16, True), (5, (1 << 16) + 1, False), (17, 64, False)],
)
def test_narrow_linear_takes_batched_products_on_few_rows_or_small_slices(rows, weight, narrow):
    """Any batched product on at most 4 rows; on 5-16 rows only those whose slices hold at most 2^16
    elements (the shipped model's attention products, not the 250m preset's)."""
    assert narrow_linear.narrow_bmm(rows, weight) is narrow


@pytest.mark.parametrize(
    "kind,b,k", [("draft_extend", 1, 3), ("target_verify", 1, 3), ("target_verify", 1, 1)]
)
def test_narrow_linear_sends_large_weights_on_2_to_4_rows_to_the_kernel(
    model, state, kind, b, k, monkeypatch
):
    """With every weight counted large, linears of 2-4 rows become compiled_mtp::panel_linear and
    those of 1 row (draft_extend's LM head) Inductor's multiply-and-sum."""
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
    before, after = _graphs(kind, b, k, model, state, ("narrow_linear",))
    rows = [
        n.args[-2].meta["val"].shape[0]
        for n in before.graph.nodes
        if n.target in (aten.mm.default, aten.addmm.default)
    ]
    assert _count(after, PANELS) == sum(2 <= r <= 4 for r in rows) > 0
    assert _linear_weights(after) == []
    _assert_same(before, after, state, model, kind, b, k, exact=False)


@pytest.mark.parametrize(
    "kind,b,k,share",
    [
        ("target_verify", 2, 2, "all"),
        ("target_verify", 4, 3, "all"),
        ("draft_extend", 2, 2, "some"),
        ("target_verify", 1, 3, "none"),
    ],
)
def test_panel_linear_takes_every_linear_on_5_to_16_rows(model, state, kind, b, k, share):
    """Linears on 5-16 rows (all of a verify of 6 or 16 rows; M's of a draft extend at B=2, K=2, not
    its 2-row LM head; none of a 4-row verify) become compiled_mtp::panel_linear, a bias or residual
    Inductor folded in added after it; the others stay, and the graph computes what it did."""
    before, after = _graphs(kind, b, k, model, state, ("panel_linear",))
    rows = [
        n.args[-2].meta["val"].shape[0]
        for n in before.graph.nodes
        if n.target in (aten.mm.default, aten.addmm.default)
    ]
    panel = sum(4 < r <= 16 for r in rows)
    assert {"all": panel == len(rows) > 0, "some": 0 < panel < len(rows), "none": panel == 0}[share]
    assert _count(after, PANELS) == panel
    assert len(_linear_weights(after)) == len(_linear_weights(before)) - panel
    _assert_same(before, after, state, model, kind, b, k, exact=False)


@pytest.mark.parametrize(
    "kind,b,k,layers",
    [("target_verify", 1, 3, 1), ("draft_extend", 2, 2, 2), ("draft_decode", 2, 3, 2), ("prefill", 1, 0, 1)],
)
def test_group_experts_replaces_each_moe_layers_gathered_products(model, state, kind, b, k, layers):
    """One op per MoE layer run by the graph on 2 rows or more (the tiny target has one, M's layer runs
    once per draft step, on one row per request, draft_extend's first included; prefill's one row of M stays
    with Inductor); each replaces the three weight gathers and their products."""
    before, after = _graphs(kind, b, k, model, state, ("group_experts",))
    assert _count(before, ROUTED_EXPERTS) == 0 and _count(after, ROUTED_EXPERTS) == layers
    assert _count(before, aten.index.Tensor) - _count(after, aten.index.Tensor) == 3 * layers
    assert len(before.graph.nodes) - len(after.graph.nodes) >= 30 * layers
    _assert_same(before, after, state, model, kind, b, k, exact=False)


@pytest.mark.parametrize("kind,b,k", [("target_verify", 1, 0), ("draft_decode", 1, 2)])
def test_group_experts_leaves_one_row_layers_to_inductor(model, state, kind, b, k, caplog):
    with caplog.at_level("INFO", logger="compiled_mtp.passes"):
        before, after = _graphs(kind, b, k, model, state, ("group_experts",))
    assert _count(before, aten.index.Tensor) >= 3 and len(after.graph.nodes) == len(before.graph.nodes)
    passes_log = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "compiled_mtp.passes"]
    assert passes_log == [("INFO", "group_experts: left as traced: 1 row(s), fewer than MIN_ROWS (2)")]


@pytest.mark.parametrize("kind,b,k,layers", [("target_verify", 1, 0, 1), ("draft_decode", 1, 3, 2)])
def test_group_experts_takes_one_row_layers_of_bfloat16_weights(bfloat16_model, state, kind, b, k, layers):
    """On weights of bfloat16 values the one-row MoE layers go to the op too (the op reads the experts'
    bfloat16 copies as they are)."""
    before, after = _graphs(kind, b, k, bfloat16_model, state, ("group_experts",))
    assert _count(before, ROUTED_EXPERTS) == 0 and _count(after, ROUTED_EXPERTS) == layers
    _assert_same(before, after, state, bfloat16_model, kind, b, k, exact=False)


def test_group_experts_leaves_a_layer_the_op_does_not_reproduce(model, state, monkeypatch, caplog):
    """The probe decides: an op that disagrees with the traced products replaces nothing."""
    _replace_op(monkeypatch, "group_experts", lambda x, *args: torch.zeros_like(x))
    before, after = _graphs("target_verify", 1, 1, model, state, ("group_experts",))
    assert len(after.graph.nodes) == len(before.graph.nodes)
    assert (
        "group_experts: left as traced: the op reproduces the region on 0%, 0% of the probes "
        "under the 2 assignments of its inputs, expected exactly one at 100% or more"
    ) in caplog.text


@pytest.mark.parametrize(
    "kind,b,k", [("target_verify", 1, 0), ("draft_decode", 1, 3), ("draft_extend", 2, 2)]
)
def test_small_topk_takes_every_routing_selection(model, state, kind, b, k):
    """The router's three topk calls a MoE layer run leave the graph; the step computes the same (the
    chosen experts may come in another order, so their sum may round differently)."""
    before, after = _graphs(kind, b, k, model, state, ("small_topk",))
    assert _count(before, aten.topk.default) >= 3 and _count(after, aten.topk.default) == 0
    _assert_same(before, after, state, model, kind, b, k, exact=False)


ENTRIES = st.sampled_from([-math.inf, -1.0, 0.0, 0.5, math.nan]) | st.floats(-4, 4, width=32)


@settings(max_examples=200)  # 4 s: rows where all but a few entries are -inf need many draws
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9)),
    dim=st.sampled_from([0, 1, -1]),
    k=st.integers(1, 4),
    sort=st.booleans(),
    entries=st.lists(ENTRIES, min_size=27, max_size=27),
)
def test_small_topk_selects_what_topk_selects(shape, dim, k, sort, entries):
    """topk's values, largest first (NaN first, as topk ranks it), at k distinct indices that hold them,
    whatever ties, -inf and NaN the entries hold; where the entries are distinct, topk's indices."""
    assume(k <= shape[dim])
    x = torch.tensor(entries[: shape[0] * shape[1]]).view(shape)
    graph = make_fx(lambda t: torch.topk(t, k, dim=dim, sorted=sort), tracing_mode="fake")(x)
    SmallTopk()(graph.graph)
    graph.recompile()
    assert _count(graph, aten.topk.default) == 0
    values, indices = graph(x)
    expected, expected_indices = torch.topk(x, k, dim=dim)
    torch.testing.assert_close(values, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(x.gather(dim, indices), values, rtol=0, atol=0, equal_nan=True)
    assert all(len(set(line)) == k for line in indices.movedim(dim, -1).reshape(-1, k).tolist())
    if len(set(entries[: x.numel()])) == x.numel() and not x.isnan().any():
        assert torch.equal(indices, expected_indices)


DENSE_MLP = torch.ops.compiled_mtp.dense_mlp.default


@pytest.mark.parametrize(
    "kind,b,k,calls",
    [
        ("target_verify", 1, 3, 2),
        ("target_verify", 2, 1, 2),
        ("target_verify", 4, 3, 2),
        ("prefill", 1, 0, 2),
        ("draft_extend", 1, 2, 0),
        ("target_verify", 1, 0, 0),
        ("target_verify", 5, 3, 0),
    ],
)
def test_fuse_dense_mlp_takes_each_dense_mlp_on_2_to_16_rows(model, state, kind, b, k, calls):
    """The tiny target's dense MLPs (layer 0's, and the shared expert of its MoE layer 1) become one op
    each when its verify or prefill chunk has 2-16 rows; M's layer runs its MLP on one row, and one row
    or 20 stay as traced. The same outputs and state as without it."""
    before, after = _graphs(kind, b, k, model, state, ("fuse_dense_mlp",))
    assert _count(before, DENSE_MLP) == 0 and _count(after, DENSE_MLP) == calls
    assert _count(before, aten.mm.default) - _count(after, aten.mm.default) == 3 * calls
    _assert_same(before, after, state, model, kind, b, k, exact=False)


@pytest.fixture(scope="module")
def bfloat16_model(tiny_checkpoint):
    """The tiny model with every weight matrix rounded to bfloat16 values, as a bfloat16 checkpoint's
    are once upcast."""
    rounded = load_model(tiny_checkpoint)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() >= 2:
                p.copy_(p.bfloat16().float())
    return rounded


def test_bfloat16_values_are_told_from_float32_ones(model, bfloat16_model):
    assert bfloat16_values(bfloat16_model) and not bfloat16_values(model)
    moved = copy.deepcopy(bfloat16_model)
    with torch.no_grad():
        moved.lm_head.weight.view(torch.int32)[-1, -1] |= 1  # one element's lowest bit
    assert not bfloat16_values(moved)


def test_dense_mlps_of_bfloat16_weights_go_to_the_op_past_16_rows(bfloat16_model, state):
    """On weights of bfloat16 values the dense MLP of a 20-row verify becomes dense_mlp too, where on
    float32 values it stays as traced: with bfloat16_products on, a row must get the op's rounded
    products at every depth and batch, not oneDNN's float32 ones from 17 rows on."""
    before, after = _graphs("target_verify", 5, 3, bfloat16_model, state, ("fuse_dense_mlp",))
    assert _count(before, DENSE_MLP) == 0 and _count(after, DENSE_MLP) == 2  # layer 0's, the shared expert
    _assert_same(before, after, state, bfloat16_model, "target_verify", 5, 3, exact=False)


# The target's two dense MLPs (layer 0's, layer 1's shared expert); M's shared expert at each of its 3 rows.
@pytest.mark.parametrize("kind,b,k,mlps", [("target_verify", 1, 0, 2), ("draft_extend", 1, 3, 3)])
def test_one_row_products_of_bfloat16_weights_go_to_the_ops(
    bfloat16_model, state, monkeypatch, kind, b, k, mlps
):
    """On weights of bfloat16 values the ops read panels of half the bytes, so on one row too the dense
    MLP becomes dense_mlp and the large linears panel_linear (every weight counted large here: a
    1-row verify's, and draft_extend's 1-row LM head); on float32 values one row stays with Inductor
    (test_fuse_dense_mlp_takes_each_dense_mlp_on_2_to_16_rows, and the 2-4 row test above)."""
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
    before, after = _graphs(kind, b, k, bfloat16_model, state, ("fuse_dense_mlp", "narrow_linear"))
    rows = [
        n.args[-2].meta["val"].shape[0]
        for n in before.graph.nodes
        if n.target in (aten.mm.default, aten.addmm.default)
    ]
    assert _count(after, DENSE_MLP) == mlps
    assert _count(after, PANELS) == sum(r <= 4 for r in rows) - 3 * mlps > 0
    assert _linear_weights(after) == []
    _assert_same(before, after, state, bfloat16_model, kind, b, k, exact=False)


@pytest.mark.parametrize(
    "kind,b,k", [("target_verify", 1, 3), ("target_verify", 1, 1), ("draft_extend", 1, 3)]
)
def test_few_row_linears_of_bfloat16_weights_go_to_the_kernel_from_a_smaller_size(
    bfloat16_model, state, monkeypatch, kind, b, k
):
    """On weights of bfloat16 values, linears of 2-4 rows go to panel_linear from
    BFLOAT16_FEW_ROW_KERNEL_WEIGHT elements (the shipped model's attention projections), while those
    of 1 row still need KERNEL_WEIGHT; smaller ones stay Inductor's multiply-and-sum. The threshold is
    set here between the tiny model's weight sizes."""
    before, _ = _graphs(kind, b, k, bfloat16_model, state, ())
    mms = [n for n in before.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    linears = [
        (n.args[-2].meta["val"].shape[0], n.args[-1].args[0].meta["val"].numel())
        for n in mms
        if n.args[-1].target is aten.permute.default
    ]
    few = sorted(w for r, w in linears if 2 <= r <= 4)
    threshold = few[len(few) // 2]
    monkeypatch.setattr(narrow_linear, "BFLOAT16_FEW_ROW_KERNEL_WEIGHT", threshold)
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", max(w for _, w in linears) + 1)
    _, after = _graphs(kind, b, k, bfloat16_model, state, ("narrow_linear",))
    taken = sum(w >= threshold for w in few)
    assert 0 < taken < len(few) and _count(after, PANELS) == taken
    _assert_same(before, after, state, bfloat16_model, kind, b, k, exact=False)


OP_PASSES = (
    "live_attention",
    "group_experts",
    "fuse_dense_mlp",
    "narrow_linear",
    "panel_linear",
    "packed_linear",
)


def _weight_reads(graph):
    """(float32 parameters the graph reads, bfloat16 copies it reads), as get_attr nodes."""
    attrs = list(graph.graph.find_nodes(op="get_attr"))
    params = [n for n in attrs if bfloat16_reads._float32_weight(operator.attrgetter(n.target)(graph))]
    return params, [n for n in attrs if bfloat16_reads.weight_of(n.target) is not None]


@pytest.mark.parametrize("kind,b,k,layers", [("target_verify", 2, 1, 1), ("draft_decode", 1, 3, 2)])
def test_bfloat16_reads_give_inductors_loops_bfloat16_copies(
    model, bfloat16_model, state, kind, b, k, layers
):
    """On weights of bfloat16 values, every read of a weight that stays in Inductor's loops (through
    any views) reads a bfloat16 copy, widened in the loop, and routed_experts and live_attention read
    the copies as they are; a weight a GEMM or another C++ op reads stays float32 for it, and the
    graph computes the same bit for bit. On float32 values nothing changes."""
    _, plain = _graphs(kind, b, k, bfloat16_model, state, OP_PASSES)
    _, read = _graphs(kind, b, k, bfloat16_model, state, (*OP_PASSES, "bfloat16_reads"))
    params, copies = _weight_reads(read)
    widen = torch.ops.prims.convert_element_type.default
    assert copies and all(
        {u.target for u in c.users} <= {widen, ROUTED_EXPERTS, LIVE_ATTENTION}
        and operator.attrgetter(c.target)(read).dtype == torch.bfloat16
        for c in copies
    )
    experts = list(read.graph.find_nodes(op="call_function", target=ROUTED_EXPERTS))
    assert all(set(n.args[3:]) <= set(copies) for n in experts) and len(experts) == layers
    attention = list(read.graph.find_nodes(op="call_function", target=LIVE_ATTENTION))
    assert attention and all(n.args[2] in copies for n in attention)
    assert not any(bfloat16_reads._in_loops(u) for p in params for u in p.users)
    read_weights = {p.target for p in params} | {bfloat16_reads.weight_of(c.target) for c in copies}
    assert read_weights == {p.target for p in _weight_reads(plain)[0]}
    _assert_same(plain, read, state, bfloat16_model, kind, b, k, exact=True)
    _, unchanged = _graphs(kind, b, k, model, state, (*OP_PASSES, "bfloat16_reads"))
    assert _weight_reads(unchanged)[1] == []


def test_dense_mlp_that_disagrees_with_the_op_stays(model, state, monkeypatch, caplog):
    _replace_op(monkeypatch, "fuse_dense_mlp", lambda x, *args: torch.zeros_like(x))
    before, after = _graphs("target_verify", 1, 3, model, state, ("fuse_dense_mlp",))
    assert _count(after, DENSE_MLP) == 0 and len(after.graph.nodes) == len(before.graph.nodes)
    assert (
        "fuse_dense_mlp: left as traced: the op reproduces the region on 0%, 0% of the probes" in caplog.text
    )


def _cache_gathers(graph, capacity):
    """Gathers of whole cache rows by slot: index nodes producing [B, capacity, D]."""
    return [
        n
        for n in graph.graph.nodes
        if n.target is aten.index.Tensor and n.meta["val"].dim() == 3 and n.meta["val"].shape[1] == capacity
    ]


@pytest.mark.parametrize(
    "kind,b,k,calls",
    [("target_verify", 2, 2, 2), ("draft_decode", 2, 3, 2), ("draft_extend", 1, 1, 1), ("prefill", 1, 0, 3)],
)
def test_attention_reads_only_the_live_cache(model, state, kind, b, k, calls):
    """One op per attention call (each target layer, each MTP step), no gather of whole cache rows
    left; the same outputs and state as without the pass, from caches filled with random entries
    past every row's position."""
    before, after = _graphs(kind, b, k, model, state, ("live_attention",))
    assert _count(before, LIVE_ATTENTION) == 0 and len(_cache_gathers(before, state.max_seq_len)) == calls
    assert _count(after, LIVE_ATTENTION) == calls and _cache_gathers(after, state.max_seq_len) == []
    _assert_same(before, after, state, model, kind, b, k, exact=False)


def test_attention_op_takes_the_shipped_models_layers():
    """On the shipped model's shapes (32 query columns a head into a latent of 64) the absorbed
    products enlarge the probes' outputs to ~20, and with them the rounding of sums taken in another
    order: the op must still take the region (a tolerance fit only for unit outputs left it traced)."""
    model = load_model(DEFAULT_MODEL)
    before, after = _graphs("target_verify", 4, 1, model, StaticState(model, 5, 256, 1), ("live_attention",))
    assert _count(before, LIVE_ATTENTION) == 0 and _count(after, LIVE_ATTENTION) == 12


def _fails_on_probes(*args):
    raise RuntimeError("live_attention: out of memory\nmore detail")


@pytest.mark.parametrize(
    "op, logged",
    [
        (
            lambda *args: LIVE_ATTENTION(*args) * 1.01,
            "the op reproduces the region on 0%, 0% of the probes under the 2 assignments of its inputs, "
            "expected exactly one at 100% or more",
        ),
        (
            _fails_on_probes,
            "the region does not run on probe inputs (RuntimeError: live_attention: out of memory)",
        ),
    ],
    ids=["wrong", "raises"],
)
def test_attention_the_op_does_not_reproduce_stays(model, state, monkeypatch, caplog, op, logged):
    """An op that computes something else, or raises, leaves the region as traced, and the log says why."""
    _replace_op(monkeypatch, "live_attention", op)
    with caplog.at_level("WARNING", logger="compiled_mtp.passes"):
        _, after = _graphs("draft_extend", 1, 1, model, state, ("live_attention",))
    assert _count(after, LIVE_ATTENTION) == 0 and len(_cache_gathers(after, state.max_seq_len)) == 1
    assert f"live_attention: left as traced: {logged}" in caplog.text


def test_one_agreeing_takes_only_a_single_agreeing_assignment():
    """The region a - b: of the two ways to feed it (x, y), the op sub agrees under one only; an op
    both agree with, or neither, replaces nothing; a region that raises on probes says so."""
    graph = torch.fx.symbolic_trace(lambda a, b: a - b).graph
    a, b = (n for n in graph.nodes if n.op == "placeholder")
    (out,) = (n for n in graph.nodes if n.op == "call_function")
    x, y = torch.tensor([5.0]), torch.tensor([2.0])

    def pick(op):
        return one_agreeing(
            [a, b],
            [out],
            [[a, b], [b, a]],
            lambda region, args: float(torch.equal(region(args, [x, y])[0], op(x, y))),
        )

    assert pick(torch.sub) == [a, b]
    with pytest.raises(
        Unfusable,
        match=r"^the op reproduces the region on 0%, 0% of the probes under the 2 assignments of its inputs, "
        r"expected exactly one at 100% or more$",
    ):
        pick(torch.add)
    with pytest.raises(
        Unfusable, match=r"^the op reproduces the region on 100%, 100% of the probes under the 2 assignments"
    ):
        one_agreeing([a, b], [out], [[a, b], [a, b]], lambda region, args: 1.0)
    with pytest.raises(Unfusable, match=r"^the region does not run on probe inputs \(RuntimeError: "):
        one_agreeing(
            [a, b],
            [out],
            [[a, b]],
            lambda region, args: float(region(args, [torch.ones(2), torch.ones(3)])[0].sum()),
        )


def _inner(x):
    return torch.sin(x).cos() + 1


def _outer(x, y):
    return _inner(x) * y + _inner(y)


class _Stop(Exception):
    pass


class _FindInner(CustomGraphPass):
    """Records the calls of `_inner` that `calls_of` finds in the post-grad graph (their nodes'
    targets, and the nodes they read), then ends the compile."""

    found: ClassVar[list] = []

    def __call__(self, graph):
        _FindInner.found = [
            (sorted(str(n.target) for n in nodes), len(inputs))
            for nodes, inputs, _ in calls_of(graph, _inner)
        ]
        raise _Stop

    def uuid(self):
        return None


@pytest.mark.parametrize("capture", ["torch.compile", "torch.export strict"])
def test_provenance_reaches_the_post_grad_graph(capture, tmp_path):
    """The region passes find a function's calls by the stack traces of its nodes; if a torch release
    stopped carrying them through Dynamo or torch.export to Inductor's post-grad graph, every region
    pass would silently stop fusing. This fails loudly instead."""
    x, y = torch.randn(8), torch.randn(8)
    options = {"post_grad_custom_post_pass": _FindInner(), "fx_graph_cache": False}
    _FindInner.found = []
    with pytest.raises(Exception) as stopped:
        if capture == "torch.compile":
            torch.compile(_outer, backend="inductor", options=options, fullgraph=True)(x, y)
        else:
            ep = torch.export.export(
                _Module(), (x, y), strict=True
            )  # as captures export: non-strict keeps only forward frames
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(tmp_path / "graph.pt2"), inductor_configs=options
            )
    assert (
        isinstance(stopped.value, _Stop)
        or isinstance(stopped.value.__cause__, _Stop)
        or "_Stop" in str(stopped.value)
    )
    assert _FindInner.found == [(["aten.add.Tensor", "aten.cos.default", "aten.sin.default"], 1)] * 2


class _Module(torch.nn.Module):
    def forward(self, x, y):
        return _outer(x, y)


def test_switches_and_uuids():
    assert set(ALL) == {
        "fuse_verify_sampling",
        "fuse_draft_sampling",
        "live_attention",
        "group_experts",
        "fuse_dense_mlp",
        "small_topk",
        "narrow_linear",
        "panel_linear",
        "packed_linear",
        "bfloat16_reads",
        "fold_key_constants",
    }
    uuids = {
        PassManager(tuple(subset)).uuid()
        for n in range(len(ALL) + 1)
        for subset in __import__("itertools").combinations(ALL, n)
    }
    assert len(uuids) == 2 ** len(ALL)  # every pass set keys its own cache entries
    bfloat16 = PassManager(ALL)
    bfloat16.bfloat16_values = True
    assert bfloat16.uuid() != PassManager(ALL).uuid()  # so do the weights' values (passes/weights.py)
    assert PassManager(ALL).uuid() == PassManager(tuple(reversed(ALL))).uuid()  # run order is the registry's
    assert inductor_options(())["post_grad_custom_post_pass"].enabled == ()
    with pytest.raises(ValueError, match=r"^passes: unknown pass 'fuse_everything' \(available: "):
        inductor_options(("fuse_everything",))


def test_small_loops_of_a_step_graph_run_on_one_thread():
    """The step graphs compile with inductor_options, whose smallest split loop keeps the loops of a
    small model's decode step (an RMSNorm of 4 rows of 256, 1024 elements) on one thread even when the
    process has two, where Inductor's default opens a parallel region for them."""
    from torch._inductor.utils import run_and_get_code

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x, w = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)), torch.ones(256)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        codes = {}
        for name, options in (("default", {}), ("step", inductor_options(()))):
            torch._dynamo.reset()
            compiled = torch.compile(norm, fullgraph=True, dynamic=False, options=options)
            out, code = run_and_get_code(compiled, x, w)
            torch.testing.assert_close(out, norm(x, w))
            codes[name] = "\n".join(code)
    finally:
        torch.set_num_threads(before)
        torch._dynamo.reset()
    assert "#pragma omp parallel" in codes["default"]
    assert "#pragma omp" not in codes["step"]


def test_command_line_switch(capsys):
    import argparse

    from compiled_mtp.cli import _engine_options, main

    args = argparse.Namespace(
        max_seq_len=None,
        dtype=None,
        device=None,
        draft_vocab=None,
        backend="inductor",
        cache_dir=None,
        disable_pass=["packed_linear"],
    )
    assert _engine_options(args, None)["passes"] == (
        "bfloat16_reads",
        "fold_key_constants",
        "fuse_dense_mlp",
        "fuse_draft_sampling",
        "fuse_verify_sampling",
        "group_experts",
        "live_attention",
        "narrow_linear",
        "panel_linear",
        "small_topk",
    )
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--disable-pass", "fuse_everything"])
    assert "invalid choice: 'fuse_everything'" in capsys.readouterr().err


def test_folded_values_are_kept_by_name_on_disk(tmp_path, monkeypatch):
    """A capture whose code came from Inductor's FX graph cache (the fold pass did not run) finds the
    values by name; a damaged or mismatched file is never used."""
    from compiled_mtp.passes import fold_key_constants as fold

    monkeypatch.setattr(fold, "_store", lambda: tmp_path)
    monkeypatch.setattr(fold, "_FOLDED", {})
    value = torch.arange(5)
    name = fold.folded_name(value)
    fold._remember(name, value)
    monkeypatch.setattr(fold, "_FOLDED", {})  # a new process
    assert torch.equal(fold.folded_value(name), value)
    monkeypatch.setattr(fold, "_FOLDED", {})
    (tmp_path / f"{name}.pt").write_bytes(b"garbage")
    assert fold.folded_value(name) is None
    other = fold.folded_name(torch.arange(6))
    torch.save(torch.arange(5), tmp_path / f"{other}.pt")
    assert fold.folded_value(other) is None
