"""Linears on a few rows become a multiply-and-sum that Inductor generates (CPU float32).

A linear on a few rows is bound by reading its weight. GEMM libraries do that poorly at such row
counts on this class of CPU; a reduction over `W[:, None, :] * x[None]` reads each weight row once, in
its stored layout, for all the rows, calls nothing outside the generated code and fuses with its
neighbours. So every linear of at most NARROW_ROWS rows is rewritten here, before packed_linear takes
the large ones on more rows.

- Batched products (bmm) of at most NARROW_ROWS rows get the same rewrite (MLA's absorbed attention
  where live_attention does not take it), and so do those of up to SMALL_BMM_ROWS rows on small
  slices, where MKL's call costs more than the arithmetic.
- Linears of 2-4 rows on weights of KERNEL_WEIGHT elements or more go to `compiled_mtp::panel_linear`
  instead (panel_linear.py), which keeps every output lane's sum in its own register where
  Inductor's loop reduces each output across lanes. Smaller weights stay here: their call would cost
  more than their arithmetic saves.
- One row stays here, fused with the final norm, unless the weights hold bfloat16 values
  (weights.py): then the op reads bfloat16 panels, half the bytes, which pays for the call, and at
  2-4 rows it takes weights down to BFLOAT16_FEW_ROW_KERNEL_WEIGHT elements.

The measurements behind each threshold: docs/passes.md, narrow_linear and panel_linear.
"""

from __future__ import annotations

from functools import partial

import torch
import torch._inductor.inductor_prims
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..ops import library
from .fx_nodes import LinearNode, call, linears, on_cpu_float32, replace
from .weights import BFLOAT16_VALUES, rows_for_values

aten = torch.ops.aten
NARROW_ROWS = 4  # the most rows this pass takes; panel_linear takes 5-16
# Batched products on up to SMALL_BMM_ROWS rows whose second operand has at most SMALL_BMM_WEIGHT
# elements are rewritten too: there MKL's call costs more than the arithmetic.
SMALL_BMM_ROWS, SMALL_BMM_WEIGHT = 16, 1 << 16
# Weights of this many elements or more go to compiled_mtp::panel_linear; smaller ones, whose read
# costs less than the op's call, stay in Inductor's code, fused with their neighbours.
KERNEL_WEIGHT = 1 << 18
KERNEL_ROWS = 2
BFLOAT16_KERNEL_ROWS = 1  # on weights of bfloat16 values (weights.py), whose panels are half the bytes
# On 2-4 rows of bfloat16 values, weights down to the attention projections' size pay for the call:
# half the bytes, and 4 rows x 6 panels of sums in registers against Inductor's per-output sums.
BFLOAT16_FEW_ROW_KERNEL_WEIGHT = 1 << 14


class NarrowLinear(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        found = [lin for lin in linears(graph) if lin.on_cpu_float32() and lin.rows <= NARROW_ROWS]
        kernel = bool(found) and library.load()  # a graph with nothing to take never builds the library
        for lin in found:
            lin.replace(partial(_narrow, lin=lin, kernel=kernel), adds=False)
        for bmm in graph.find_nodes(op="call_function", target=aten.bmm.default):
            a, b = bmm.args
            if on_cpu_float32(a, b) and narrow_bmm(a.meta["val"].shape[1], b.meta["val"].numel()):
                replace(bmm, partial(_batched_multiply_and_sum, a=a, b=b))
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files(
            (__file__,),
            f"{NARROW_ROWS}/{SMALL_BMM_ROWS}/{SMALL_BMM_WEIGHT}/{KERNEL_WEIGHT}/{KERNEL_ROWS}/"
            f"{BFLOAT16_KERNEL_ROWS}/{BFLOAT16_FEW_ROW_KERNEL_WEIGHT}/{library.version()}",
        ).hex()


def narrow_bmm(rows: int, weight: int) -> bool:
    """Whether a batched product of `rows` rows on slices of `weight` elements in all is rewritten."""
    return rows <= NARROW_ROWS or (rows <= SMALL_BMM_ROWS and weight <= SMALL_BMM_WEIGHT)


def _narrow(graph: fx.Graph, lin: LinearNode, kernel: bool) -> fx.Node:
    halves = BFLOAT16_VALUES.get()
    least = rows_for_values(KERNEL_ROWS, BFLOAT16_KERNEL_ROWS)
    smallest = KERNEL_WEIGHT
    if halves and lin.rows > 1:
        smallest = min(smallest, BFLOAT16_FEW_ROW_KERNEL_WEIGHT)
    if kernel and lin.weight_size >= smallest and lin.rows >= least:
        return call(graph, torch.ops.compiled_mtp.panel_linear.default, lin.x, lin.weight)
    return _multiply_and_sum(graph, lin)


def _multiply_and_sum(graph: fx.Graph, lin: LinearNode) -> fx.Node:
    """x W^T as sum_k W[:, None, k] * x[None, :, k]: reduced as [out, rows], so that the loop over a
    weight row's outputs holds every row, and stored as [rows, out]. Both ends are pinned to
    row-major: Inductor would otherwise inline a producer into the loop over every weight row, or
    keep the output transposed and vectorize the next reduction along its rows."""
    x = _row_major(graph, lin.x)
    products = call(
        graph,
        aten.mul.Tensor,
        call(graph, aten.unsqueeze.default, lin.weight, 1),
        call(graph, aten.unsqueeze.default, x, 0),
    )
    return _row_major(
        graph, call(graph, aten.permute.default, call(graph, aten.sum.dim_IntList, products, [2]), [1, 0])
    )


def _batched_multiply_and_sum(graph: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    """bmm(a [n, rows, k], b [n, k, out]) as sum_k a[:, :, k, None] * b[:, None, k, :]."""
    products = call(
        graph,
        aten.mul.Tensor,
        call(graph, aten.unsqueeze.default, a, 3),
        call(graph, aten.unsqueeze.default, b, 1),
    )
    return call(graph, aten.sum.dim_IntList, products, [2])


def _row_major(graph: fx.Graph, node: fx.Node) -> fx.Node:
    return call(
        graph, torch.ops.prims.inductor_force_stride_order.default, node, [node.meta["val"].shape[1], 1]
    )
