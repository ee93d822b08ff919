"""Route the graph's linears through `compiled_mtp::linear` (oneDNN packed weights on CPU).

Those of its linears (see fx_nodes.LinearNode) where packing pays, weights of 1 MB and more, become
`compiled_mtp::linear(x, W, b)` (plus a residual Inductor folded into addmm), which uses the copy of W
that `ops.packed_linear.pack_linears` packed at load, and plain F.linear where there is none. Only
CPU float32 graphs are rewritten.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..ops import packed_linear as op_module
from .fx_nodes import LinearNode, call, linears

LINEAR = torch.ops.compiled_mtp.linear.default
# Which linears are rewritten (see `_pays`): weights of MIN_WEIGHT elements or more.
MIN_WEIGHT = 1 << 18


class PackedLinear(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        if not op_module.available():
            return
        for lin in linears(graph):
            if lin.on_cpu_float32() and _pays(lin):
                bias = lin.added if lin.added is not None and _bias_of(lin.added, lin.weight) else None
                lin.replace(partial(_packed, lin=lin, bias=bias), adds=bias is not None)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__), str(MIN_WEIGHT)).hex()

    def prepare(self, model: nn.Module) -> None:
        """Pack the model's weights once, before any graph: every graph shares them."""
        op_module.pack_linears(model, MIN_WEIGHT)


def _packed(graph: fx.Graph, lin: LinearNode, bias: fx.Node | None) -> fx.Node:
    return call(graph, LINEAR, lin.x, lin.weight, bias)


def _pays(lin: LinearNode) -> bool:
    """Whether the packed GEMM beats Inductor's own mm by more than the op's call costs beyond an
    mm's: on weights of MIN_WEIGHT elements and more (docs/passes.md, packed_linear)."""
    return lin.weight_size >= MIN_WEIGHT


def _bias_of(bias: fx.Node, weight: fx.Node) -> bool:
    """addmm's first argument is a bias only when it is a [out] vector the graph reads."""
    val = bias.meta.get("val")
    return (
        bias.op in ("placeholder", "get_attr")
        and val is not None
        and tuple(val.shape) == (weight.meta["val"].shape[0],)
    )
