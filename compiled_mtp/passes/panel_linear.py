"""Linears on 5-16 rows become `compiled_mtp::panel_linear` (CPU float32, ops/csrc/panel_linear.cpp).

Those are the verifies of a batch that drafts (B(K+1) rows: 8-16 at B=4) and a draft extend of
several requests. MKL's GEMM, which Inductor calls for them, copies the whole weight into its packed
layout on every call, because the rows are few: profiled on the shipped model's 16-row verify, that
copy took more time than MKL's arithmetic. The op reads a copy made once, on the weight's first use,
in panels of one vector of outputs, and keeps every row's sums for 3 panels in registers, so it
reads each panel once per block of rows (8 with AVX-512, 4 with AVX2) and never reduces across
lanes. Read cold, as in a verify, the shipped model's attention projections and LM head take about
half the time MKL's and oneDNN's GEMMs do (benchmarks/bench_linear_rows.py; figures in
benchmarks/README.md). On 1-4 rows narrow_linear keeps the small weights in Inductor's code and
sends the large ones (2-4 rows; 1-4 where the weights hold bfloat16 values, passes/weights.py) to
this op too; from 17 rows on GEMM libraries pack and block well, and packed_linear takes the large
ones.

Cost: each weight the op meets keeps a copy beside it, made when it first runs (an in-place update
of the weight makes a new one on its next use).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..ops import library
from .fx_nodes import LinearNode, call, linears
from .narrow_linear import NARROW_ROWS

PANEL_ROWS = 16  # the most rows compiled_mtp::panel_linear takes


class PanelLinear(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        found = [
            lin for lin in linears(graph) if lin.on_cpu_float32() and NARROW_ROWS < lin.rows <= PANEL_ROWS
        ]
        if not found or not library.load():  # a graph with nothing to take never builds the library
            return
        for lin in found:
            lin.replace(partial(_panel, lin=lin), adds=False)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__,), f"{NARROW_ROWS}/{PANEL_ROWS}/{library.version()}").hex()


def _panel(graph: fx.Graph, lin: LinearNode) -> fx.Node:
    return call(graph, torch.ops.compiled_mtp.panel_linear.default, lin.x, lin.weight)
