"""The routed experts of each MoE layer become `compiled_mtp::routed_experts` (CPU float32).

The fixed-shape MoE every family shares (`models.layers.gathered_experts`) gathers each row's k experts and
multiplies every (row, expert) pair on its own, so an expert chosen by several rows of a verify is
read once for each of them. The op (ops/csrc/routed_experts.cpp) groups the rows by expert and reads
each chosen expert once. On one row the call out of the generated code, where Inductor fuses the
products with their neighbours, costs more than it saves, so layers on fewer than MIN_ROWS rows stay
as they are. On weights of bfloat16 values (weights.py) one row goes to the op too: there Inductor's
code for a one-row MoE layer is one kernel of some 35 barriers between small loops. The measurements:
docs/passes.md, group_experts.

The products are found by provenance (region.py), each layer's as one connected region of nodes
traced inside `gathered_experts`, with the function's six inputs and one output. Shapes tell the inputs apart but
for gate and up, which have the same; the region and the op run on seeded probe inputs under both
assignments, and the region is replaced only when exactly one of them agrees. A region where any of
this fails is left as it was, with a log line.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, fx

from ..models.layers import gathered_experts
from .region import Region, RegionPass, Unfusable, by_signature, one_agreeing
from .weights import rows_for_values

MIN_ROWS = 2
BFLOAT16_MIN_ROWS = 1  # on weights of bfloat16 values


class GroupExperts(RegionPass):
    traced = gathered_experts
    op_name = "routed_experts"
    native = True
    arity = (6, 1)
    settings = (MIN_ROWS, BFLOAT16_MIN_ROWS)

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(x, idx, weights, gate, up, down) -> out; gate and up told apart on probes."""
        out = outputs[0].meta["val"]
        least = rows_for_values(MIN_ROWS, BFLOAT16_MIN_ROWS)
        if out.dim() == 2 and out.shape[0] < least:
            raise Unfusable(f"{out.shape[0]} row(s), fewer than MIN_ROWS ({least})", expected=True)
        two_d, (idx,), three_d = by_signature(
            inputs, {(2, True): 2, (2, False): 1, (3, True): 3}, "inputs (x, idx, weights, gate, up, down)"
        )
        candidates = [
            [x, idx, w, gate, up, down]
            for x, w in itertools.permutations(two_d)
            for gate, up, down in itertools.permutations(three_d)
        ]
        candidates = [args for args in candidates if _fits(*(n.meta["val"] for n in args))]
        return one_agreeing(inputs, outputs, candidates, self._agreement), outputs

    def _agreement(self, region: Region, args: list[fx.Node]) -> float:
        """1 if the op reproduces the region on seeded probes under `args`, else 0."""
        gen = torch.Generator().manual_seed(0)
        x, idx, weights, gate, up, down = (n.meta["val"] for n in args)
        values = [
            torch.randn(x.shape, generator=gen),
            torch.randint(0, gate.shape[0], idx.shape, generator=gen),
            torch.rand(weights.shape, generator=gen),
            *(0.1 * torch.randn(w.shape, generator=gen) for w in (gate, up, down)),
        ]
        (expected,) = region(args, values)
        return float(torch.allclose(self.op(*values), expected, rtol=1e-4, atol=1e-4))


def _fits(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> bool:
    n, h = x.shape if x.dim() == 2 else (-1, -1)
    return (
        idx.dim() == 2
        and idx.shape[0] == n
        and weights.shape == idx.shape
        and gate.dim() == 3
        and gate.shape == up.shape
        and gate.shape[2] == h
        and tuple(down.shape) == (gate.shape[0], h, gate.shape[1])
    )
