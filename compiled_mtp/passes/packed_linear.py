"""Route the graph's linears through `compiled_mtp::linear` (oneDNN packed weights on CPU).

A linear reaches the post-grad graph as `mm(x, permute(W, [1, 0]))`, or `addmm(c, x, permute(W))`
where c is a bias or a residual Inductor added in, and W is a weight the graph reads (an input or a
constant). Those where packing pays (weights of 1 MB and more) become
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
# Which linears are rewritten (see `_pays`): weights of MIN_WEIGHT elements or more.
MIN_WEIGHT = 1 << 18


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
            if not _pays(weight):
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
        return get_hash_for_files((__file__, op_module.__file__), str(MIN_WEIGHT)).hex()


def _pays(weight: fx.Node) -> bool:
    """Whether the packed GEMM beats Inductor's own mm by more than the op's call (about 25 us from
    Python, against 6 us for an mm). Measured on 2 cores, weights read cold as in a model's forward:
    a 129280 x 768 weight saves about 20 ms at 1 row and 55 ms at 4, a 2048 x 768 one 0.3 ms at 1 row,
    a 768 x 768 one 0.1 ms at 4 rows; rewriting every linear of the shipped model (all but its
    4096 x 256 LM head under 2^18 elements) made a decode step 1.1 ms slower."""
    return weight.meta["val"].numel() >= MIN_WEIGHT


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
