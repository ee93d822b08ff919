"""Linears on a few rows become a multiply-and-sum that Inductor generates (CPU float32).

A linear on a few rows is bound by reading its weight, which GEMM libraries do poorly at such row
counts on this class of CPU, and which a reduction over `W[:, None, :] * x[None]` does at the
memory's speed: each weight row is read once, in its stored layout, for all the rows, with no packed
copy and no call out of the generated code, and Inductor fuses it with its neighbours. Measured on 2
cores, the 129280 x 768 LM head read cold at 1 / 2 / 4 / 8 rows: this 11.0 / 11.6 / 12.2 / 32.0 ms,
oneDNN's packed GEMM (the packed_linear pass) 15.8 / 21.0 / 12.6 / 15.3 ms, MKL's F.linear 34.9 /
76.1 / 72.7 / 73.1 ms; on the 250m preset a verify of 1 row took 16.9 ms instead of 28.2 and one of
4 rows 29.3 instead of 34.5, and on the shipped model 2.6 instead of 4.9 and 3.2 instead of 6.7.
So every linear of at most NARROW_ROWS rows is rewritten here, before packed_linear, which takes
the large ones on more rows.

Batched products (bmm) of at most NARROW_ROWS rows get the same rewrite: MLA's absorbed attention,
where live_attention's op does not take it (the pass off, a graph not in float32), multiplies each
head's rows by that head's slice of kv_b_proj, and at 4 rows Inductor leaves that to
MKL's bmm, which took 0.48-0.93 ms for the 8 layers of the 250m preset against 0.41-0.47 ms as a
multiply-and-sum (a 4-row verify of the 250m preset, timed in turns: 0.2-0.9 ms faster). So do
those of up to 16 rows on small slices (SMALL_BMM_WEIGHT elements: the shipped model's 4 x 32 x 64),
where MKL's call is most of the cost: the shipped model's verify at B=4 took 0.970x (K=1, 8 rows)
and 0.977x (K=3, 16 rows) the time with MKL's bmm (benchmarks/README.md). The 250m preset's slices
(12 x 64 x 256) do 24x the arithmetic a row; not measured there, they stay with MKL from 5 rows on.

Linears of 2-4 rows on weights of KERNEL_WEIGHT elements or more go to
`compiled_mtp::panel_linear` instead (ops/csrc/panel_linear.cpp, see panel_linear.py), which keeps
every output lane's sum in its own register where Inductor's loop sums each output in one chain and
reduces it across lanes. The shipped model's 4096 x 256 LM head, read cold at 2 / 4 rows, took 169 /
187 us that way against 233 / 239 us with the few-row kernel that had this place before
(benchmarks/bench_linear_rows.py), which in turn had made a 4-row verify of the 250m preset 23.0-23.9
ms against Inductor's 27.1-27.8 (LM head alone) when this machine's memory was fast. At 2^17
elements the shipped model's MLP weights went too and its 4-row verify took 1.53 ms against 1.43:
there the call costs more than the arithmetic saves. At 1 row a separate call made the 250m verify
1.2-2.5 ms slower (Inductor's code fuses the LM head with the final norm), so 1 row stays here,
unless the weights hold bfloat16 values (passes/weights.py): then the op reads bfloat16 panels, half
the bytes, which pays for the call (docs/passes.md). On such weights at 2-4 rows the op also takes
weights down to BFLOAT16_FEW_ROW_KERNEL_WEIGHT elements, the shipped model's attention projections
(measured in benchmarks/README.md).
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
