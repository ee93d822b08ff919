"""Fuse each draft step's sampling into `compiled_mtp::draft_sample` (CPU).

draft_extend samples one draft per request and draft_decode one per step, each through the traced
`graphs.sampling.draft_sample`: softmax, argmax and one-hot rows, a stable sort of the whole
vocabulary, cumsums and scatters. The sort alone took 12.6 ms for one row of a 129280-token
vocabulary, as long as the LM head; the op (ops/draft_sample.py) sorts only where top-k/top-p
need it. Where the C++ ops build, the call is `compiled_mtp::greedy_draft_sample`
(ops/csrc/greedy_sample.cpp), which keeps a batch of greedy requests in C++ and hands any other
batch to that op: from a captured graph, a call into Python cost more than a greedy draft's
argmax. Each call is found by provenance (region.py), one connected region per call, with exactly the
function's inputs and outputs. The region and the op run
on seeded probe inputs first, under each way of assigning the three [B] float inputs (temperature,
top_p, the uniform); the region is replaced only where exactly one assignment reproduces its tokens
and draft distributions. A region where any of this fails is left as it was, with a log line.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from ..graphs.sampling import draft_sample
from ..ops import draft_sample as op_module
from ..ops import library
from . import probes
from .probes import probe_logits, probe_params, probe_rounds
from .region import Region, RegionPass, by_signature, one_agreeing

_AGREEMENT = 0.9  # share of probe rows, as for the verify op: rounding may move a draw at a step of the CDF


class FuseDraftSampling(RegionPass):
    traced = draft_sample
    op_name = "draft_sample"
    arity = (5, 2)
    modules = (op_module, probes)

    @property
    def op(self) -> torch._ops.OpOverload:
        native = library.load()
        return (
            torch.ops.compiled_mtp.greedy_draft_sample if native else torch.ops.compiled_mtp.draft_sample
        ).default

    @property
    def settings(self) -> tuple:  # the C++ kernels' version (whether they built: PassManager.uuid)
        return (library.version(),)

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(logits, temperature, top_k, top_p, u) -> (tokens, q)."""
        (logits,), floats, (top_k,) = by_signature(
            inputs,
            {(2, True): 1, (1, True): 3, (1, False): 1},
            "inputs (logits, temperature, top_k, top_p, u)",
        )
        (tokens,), (q,) = by_signature(outputs, {(1, False): 1, (2, True): 1}, "outputs (tokens, q)")
        candidates = [[logits, t, top_k, p, u] for t, p, u in itertools.permutations(floats)]
        return one_agreeing(inputs, [tokens, q], candidates, self._agreement, _AGREEMENT), [tokens, q]

    def _agreement(self, region: Region, args: list[fx.Node]) -> float:
        """The share of probe rows where region and op draw the same token from the same distribution."""
        gen = torch.Generator().manual_seed(0)
        batch, vocab = args[0].meta["val"].shape
        same = total = 0
        for probe in range(probe_rounds(batch)):
            values = [
                probe_logits((batch, vocab), gen),
                *probe_params(batch, probe),
                torch.rand(batch, generator=gen),
            ]
            values = [v.to(a.meta["val"].dtype) for v, a in zip(values, args)]
            (tokens, q), (fused_tokens, fused_q) = region(args, values), self.op(*values)
            close = torch.isclose(q.float(), fused_q, rtol=1e-3, atol=1e-6).all(-1)
            same += int(((tokens == fused_tokens) & close).sum())
            total += batch
        return same / total
