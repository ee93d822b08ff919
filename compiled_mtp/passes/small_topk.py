"""Top-k selections of a few entries become k rounds of argmax, which Inductor fuses.

Inductor generates no code for `aten.topk`: every call leaves the generated code for ATen's (a call
of a few microseconds on CPU, for a selection that takes nanoseconds) and splits the kernels around
it. DeepSeek-V3's router makes three a MoE layer (the best two of each group, the best groups, the
best experts), over 2-8 entries: on the shipped model nine in a K=3 iteration's drafts, and each
draft step's routing ran as four kernels and three calls. Written as rounds of argmax, each round
masking the entry it took, the routing is reductions and pointwise code that Inductor fuses with the
scores before it and the gathers after it.

The rounds give topk's values, largest first, and their indices: the same as `sorted=True` (ties,
which topk leaves in no stated order, come lowest index first, and a NaN counts as the largest, as
topk counts it); `sorted=False` allows any order, so the same values in the same order serve it.
Taken: the largest k of at most MAX_ENTRIES entries of a floating-point tensor, k at most MAX_K.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._subclasses import FakeTensor
from torch.fx.operator_schemas import normalize_function

from .fx_nodes import call

aten, prims = torch.ops.aten, torch.ops.prims
# A round sweeps every entry, so only small selections are taken: a router's, not a vocabulary's.
MAX_ENTRIES, MAX_K = 64, 4


class SmallTopk(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        taken = [(n, args) for n in graph.nodes if n.target is aten.topk.default and (args := _small(n))]
        for node, (x, k, dim) in taken:
            with graph.inserting_before(node):
                outputs = _rounds(graph, x, k, dim)
            for user in list(node.users):
                assert user.target is operator.getitem  # a post-grad graph reads topk's pair by index
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
            graph.erase_node(node)

    def uuid(self) -> str:
        return get_hash_for_files((__file__,), f"{MAX_ENTRIES}/{MAX_K}").hex()


def _small(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """topk's input, k and (non-negative) dim where it selects the largest of a few entries."""
    bound = normalize_function(aten.topk.default, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    assert bound is not None  # aten.topk has one schema
    a = bound.kwargs
    val = a["input"].meta["val"]
    dim = a["dim"] % val.dim()
    n = val.shape[dim]
    small = val.dtype.is_floating_point and isinstance(n, int) and n <= MAX_ENTRIES and 0 < a["k"] <= MAX_K
    return (a["input"], a["k"], dim) if small and a["largest"] else None


def _rounds(graph: fx.Graph, x: fx.Node, k: int, dim: int) -> tuple[fx.Node, fx.Node]:
    """(values, indices) of x's top k along `dim` from k rounds of argmax over the entries not yet
    taken (an index compared with each entry's position, so a tie takes one entry)."""
    positions = _positions(graph, x.meta["val"], dim)
    values, indices, untaken = [], [], None
    for _ in range(k):
        if untaken is None:
            index = call(graph, aten.argmax.default, x, dim, True)
        else:
            index = _best_left(graph, x, untaken, dim)
        values.append(call(graph, aten.gather.default, x, dim, index))
        indices.append(index)
        free = call(graph, aten.ne.Tensor, positions, index)
        untaken = free if untaken is None else call(graph, aten.logical_and.default, untaken, free)
    return call(graph, aten.cat.default, values, dim), call(graph, aten.cat.default, indices, dim)


def _best_left(graph: fx.Graph, x: fx.Node, untaken: fx.Node, dim: int) -> fx.Node:
    """The index of the largest entry of `x` still `untaken` along `dim` (kept as a dimension of 1)."""
    # -inf as a scalar, not a 0-dim tensor: folded into a constant (fold_key_constants), one read
    # wrong values in a package loaded a second time in the same process.
    rest = call(graph, aten.where.ScalarOther, untaken, x, float("-inf"))
    index = call(graph, aten.argmax.default, rest, dim, True)
    # Where every entry left is -inf, argmax may name a taken one: then the first untaken.
    as_int = call(graph, prims.convert_element_type.default, untaken, torch.int32)
    first_left = call(graph, aten.argmax.default, as_int, dim, True)
    all_inf = call(graph, aten.eq.Scalar, call(graph, aten.gather.default, rest, dim, index), float("-inf"))
    return call(graph, aten.where.self, all_inf, first_left, index)


def _positions(graph: fx.Graph, val: FakeTensor, dim: int) -> fx.Node:
    """0..n-1 along `dim` of a tensor like `val`, shaped to broadcast against it."""
    n = val.shape[dim]
    iota = graph.call_function(
        prims.iota.default,
        (n,),
        {"start": 0, "step": 1, "dtype": torch.int64, "device": val.device, "requires_grad": False},
    )
    with val.fake_mode:
        iota.meta["val"] = torch.arange(n, device=val.device)
    return call(graph, aten.view.default, iota, [n if d == dim else 1 for d in range(val.dim())])
