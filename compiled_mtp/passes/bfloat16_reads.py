"""Weights of bfloat16 values that Inductor's own loops read are read from bfloat16 copies (CPU).

Where every weight holds bfloat16 values (weights.py), the C++ ops read them from bfloat16 panels,
half the bytes. What stays in Inductor's generated loops read float32: the one-row linears below
narrow_linear's kernel size (at B = 1, the attention projections of every layer and the MTP layer's
eh_proj), the router. This pass gives such reads a bfloat16 copy of the weight, widened inside the
loop (`convert_element_type`, which Inductor fuses into the load), so they read half the bytes for
the same float32 values: the products and sums are bit for bit those of the float32 weight.

A read counts as Inductor's when it reaches no call out of the generated code (a GEMM, a batched
product, a C++ op), through any chain of views: there a widened copy would be made on every call,
and the ops read their own panels. Nor does the embedding's lookup count: it reads one row of the
table a token, where a copy would cost half the table's bytes for nothing. Each copy is a constant
of its own (PREFIX + the weight's name), which the package is built without, like every weight:
aot.load makes it from the live model's weight, once per model (capture/weight_copies.py), and
checks that weight's values. The ops that read bfloat16 weights themselves (READS_BFLOAT16: the
routed experts, which have no panels, and the attention's kv_b_proj) take the copy as it is.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .fx_nodes import call
from .weights import BFLOAT16_VALUES

aten, prims = torch.ops.aten, torch.ops.prims
PREFIX = "_bfloat16_"
SEPARATOR = "$"  # in place of the dots of the weight's name: a buffer's name has none
# Products Inductor calls out to a library for (CPU), besides every op outside aten and prims; and
# the embedding's lookup, which reads a row a token: a copy of the table would gain nothing.
KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.embedding.default}
READS_BFLOAT16 = ("compiled_mtp::routed_experts", "compiled_mtp::live_attention")
VIEWS = {
    aten.permute.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.t.default,
    aten.alias.default,
}


class BFloat16Reads(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        if not BFLOAT16_VALUES.get():
            return
        module = graph.owning_module
        assert module is not None, "post-grad graphs belong to a GraphModule"
        for node in list(graph.find_nodes(op="get_attr")):
            weight = operator.attrgetter(node.target)(module)
            loops = [u for u in node.users if _in_loops(u)]
            ops = [u for u in node.users if _reads_bfloat16(u)]
            if not ((loops or ops) and _float32_weight(weight)):
                continue
            name = copy_name(node.target)
            if not hasattr(module, name):
                module.register_buffer(name, weight.detach().to(torch.bfloat16))
            with graph.inserting_before(node):
                copy = graph.get_attr(name)
                copy.meta["val"] = _bfloat16_val(node)
                widened = call(graph, prims.convert_element_type.default, copy, torch.float32)
            for user in loops:
                user.replace_input_with(node, widened)
            for user in ops:
                user.replace_input_with(node, copy)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex()


def copy_name(weight: str) -> str:
    """The constant that holds weight `weight`'s bfloat16 copy."""
    return PREFIX + weight.replace(".", SEPARATOR)


def weight_of(name: str) -> str | None:
    """The weight whose copy constant `name` is, or None for any other constant."""
    return name.removeprefix(PREFIX).replace(SEPARATOR, ".") if name.startswith(PREFIX) else None


def _float32_weight(weight: object) -> bool:
    """A parameter (never a state buffer, which the graphs write) of float32 on CPU, a matrix or more."""
    return (
        isinstance(weight, torch.nn.Parameter)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() >= 2
    )


def _bfloat16_val(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    with val.fake_mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=torch.bfloat16)


def _reads_bfloat16(node: fx.Node) -> bool:
    """Whether `node` is a call of an op that reads bfloat16 weights as they are."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in READS_BFLOAT16


def _in_loops(node: fx.Node) -> bool:
    """Whether `node` and every view chain from it reach only Inductor's own loops."""
    target = node.target
    if node.op != "call_function" or target in KEEP:
        return False
    if not (isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")):
        return False
    return target not in VIEWS or all(_in_loops(u) for u in node.users)
