"""Route the graph's linears through `compiled_mtp::linear` (MKL packed weights on CPU).

A linear reaches the post-grad graph as `mm(x, permute(W, [1, 0]))`, or `addmm(c, x, permute(W))`
where c is a bias or a residual Inductor added in, and W is a weight the graph reads (an input or a
constant). Those where packing pays (large weights, or mid-sized ones at several rows) become
`compiled_mtp::linear(x, W, b)` (plus the residual add), which uses the copy of W that
`kernels.packed_linear.pack_linears` packed at load, and plain F.linear where there is none. Only
CPU float32 graphs are rewritten.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .kernels import packed_linear as op_module

aten = torch.ops.aten
LINEAR = torch.ops.compiled_mtp.linear.default
# Which linears are rewritten (see `_pays`): weights of BIG_WEIGHT elements always, MID_WEIGHT ones
# when the graph gives them MANY_ROWS rows or more.
BIG_WEIGHT, MID_WEIGHT, MANY_ROWS = 1 << 24, 1 << 20, 4


class PackedLinear(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        if not op_module.available():
            return
        for node in list(graph.find_nodes(op="call_function", target=aten.mm.default)) + list(
            graph.find_nodes(op="call_function", target=aten.addmm.default)
        ):
            added, x, weight_t = (None, *node.args) if node.target is aten.mm.default else node.args
            weight = _weight(weight_t)
            if weight is None or node.kwargs or not _cpu_float32(x, weight):
                continue
            if not _pays(x, weight):
                continue
            bias = added if added is not None and _bias_of(added, weight) else None
            with graph.inserting_before(node):
                result = linear = graph.call_function(LINEAR, (x, weight, bias))
                if added is not None and bias is None:  # Inductor folded a residual add into addmm
                    result = graph.call_function(aten.add.Tensor, (added, linear))
            linear.meta.update(node.meta)
            result.meta.update(node.meta)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__), f"{BIG_WEIGHT},{MID_WEIGHT},{MANY_ROWS}").hex()


def _pays(x: fx.Node, weight: fx.Node) -> bool:
    """Whether the packed GEMM beats Inductor's own mm by more than the op's call (about 50 us from
    Python). Measured on 2 cores: a 129280 x 768 weight saves 1.8 ms at 1 row and 5 ms at 4; a
    2048 x 768 one saves nothing at 1 row and 0.1 ms at 4; below that the call costs more."""
    rows, size = x.meta["val"].shape[0], weight.meta["val"].numel()
    return size >= BIG_WEIGHT or (rows >= MANY_ROWS and size >= MID_WEIGHT)


def _weight(node: object) -> fx.Node | None:
    """W when `node` is permute(W, [1, 0]) of a 2-D tensor the graph reads."""
    if not (isinstance(node, fx.Node) and node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return None
    weight = node.args[0]
    return weight if weight.op in ("placeholder", "get_attr") else None


def _bias_of(bias: fx.Node, weight: fx.Node) -> bool:
    """addmm's first argument is a bias only when it is a [out] vector the graph reads."""
    val = bias.meta.get("val")
    return bias.op in ("placeholder", "get_attr") and val is not None and tuple(val.shape) == (weight.meta["val"].shape[0],)


def _cpu_float32(*nodes: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in nodes]
    return all(isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype == torch.float32 for v in vals)
