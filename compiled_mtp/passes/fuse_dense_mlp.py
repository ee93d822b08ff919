"""Each dense SwiGLU MLP on a few rows becomes `compiled_mtp::dense_mlp` (CPU float32).

Traced, a dense MLP (`models.layers.dense_mlp`) is three linears and the activation between
them: on 2-4 rows, three linears from narrow_linear (panel_linear calls on weights of 2^18+
elements, Inductor's loops on smaller ones) and a kernel of Inductor's, each
with its own start and its threads' barrier; on 5-16 rows (a batch of 4 verifying drafts), three
packed oneDNN linears. The op does the MLP in one call from panels of its weights
(ops/csrc/routed_experts.cpp), reading gate and up together for all the rows, then down. The gains
and the row range are measured in benchmarks/README.md. On weights of bfloat16 values
(passes/weights.py) the op reads bfloat16 panels, half the bytes, and takes every row count from 1
on, 16 rows at a time: a row then gets the same products whichever rows share its call, also where
bfloat16_products rounds them (docs/passes.md).

The MLP is found by provenance (region.py): one connected region per call, with the function's four
inputs and one output; gate and up have the same shape, so the region and the op run on seeded probe
inputs under each assignment the shapes allow, and the region is replaced only where exactly one
agrees.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import fx

from ..models.layers import dense_mlp
from .region import Region, RegionPass, Unfusable, one_agreeing
from .weights import rows_for_values

MIN_ROWS, MAX_ROWS = 2, 16
# On weights of bfloat16 values the op reads half the bytes, which pays for its call at 1 row too,
# and it takes every row count: rounded to bfloat16 (bfloat16_products), a row's products must be
# the op's at every depth and batch, where oneDNN's float32 ones from 17 rows on (a verify of B=8
# at K >= 2) would give other tokens than a depth-0 step's.
BFLOAT16_MIN_ROWS, BFLOAT16_MAX_ROWS = 1, math.inf


class FuseDenseMLP(RegionPass):
    traced = dense_mlp
    op_name = "dense_mlp"
    native = True
    arity = (4, 1)
    settings = (MIN_ROWS, BFLOAT16_MIN_ROWS, MAX_ROWS, BFLOAT16_MAX_ROWS)

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(x, gate, up, down) -> out; gate and up told apart on probes."""
        out = outputs[0].meta["val"]
        rows = math.prod(out.shape[:-1])
        least = rows_for_values(MIN_ROWS, BFLOAT16_MIN_ROWS)
        most = rows_for_values(MAX_ROWS, BFLOAT16_MAX_ROWS)
        if not least <= rows <= most:
            raise Unfusable(f"{rows} row(s), outside [{least}, {most}]", expected=True)
        candidates = [
            list(args) for args in itertools.permutations(inputs) if _fits(*(n.meta["val"] for n in args))
        ]
        return one_agreeing(inputs, outputs, candidates, self._agreement), outputs

    def _agreement(self, region: Region, args: list[fx.Node]) -> float:
        """1 if the op reproduces the region on seeded probes under `args`, else 0."""
        gen = torch.Generator().manual_seed(0)
        values = [
            torch.randn(n.meta["val"].shape, generator=gen) * (1.0 if i == 0 else 0.1)
            for i, n in enumerate(args)
        ]
        (expected,) = region(args, values)
        return float(torch.allclose(self.op(*values), expected, rtol=1e-4, atol=1e-4))


def _fits(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    return (
        gate.dim() == up.dim() == down.dim() == 2
        and x.dim() >= 1
        and gate.shape == up.shape
        and gate.shape[1] == x.shape[-1]
        and tuple(down.shape) == (gate.shape[1], gate.shape[0])
    )
