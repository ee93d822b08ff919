"""Fuse the verify graph's sampling subgraph into `compiled_mtp::verify_sample`.

The subgraph is what `graphs.sampling.verify_sample` traced to: about 100 post-grad nodes (softmax,
argmax and one-hot rows, a stable sort of every row, cumsums, scatters, the accept test, the
residual draw). Inductor's own rewrites reshape it (the one-hot scatter becomes a compare, softmax is
split around the temperature), so no fixed pattern describes it. It is found by provenance instead
(region.py): the region must have exactly the function's inputs and outputs. Before anything is
replaced, the region and the fused op run on seeded probe inputs of the graph's shapes; the
replacement happens only if they agree on the committed tokens (up to rounding, see `_agreement`)
under one assignment of the two [B] float inputs (temperature, top_p). The probes run on the graph's
device, so on CUDA they check the Triton kernel (ops/verify_sample_triton.py) the graph will run.
A graph where any of this fails is left as it was, with a log line.

On CPU, where the C++ ops build, the call is `compiled_mtp::greedy_verify_sample`
(ops/csrc/greedy_sample.cpp), which verifies a batch of greedy requests in C++ and hands any other
batch to `compiled_mtp::verify_sample`: from a captured graph, the call into Python cost more than
the greedy batch's own argmax and accept test (see docs/passes.md).
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from ..graphs.sampling import verify_sample
from ..ops import library
from ..ops import verify_sample as op_module
from ..ops import verify_sample_triton as triton_kernel  # registers the CUDA kernel where Triton is installed
from . import probes
from .fx_nodes import device_types
from .probes import probe_logits, probe_params, probe_rounds
from .region import Region, RegionPass, by_signature, one_agreeing

_AGREEMENT = 0.9  # measured: the right assignment agrees on every probe row, the swapped one on 65-70%
# On CUDA the op (its Triton kernels) is slower than Inductor's own kernels for the traced subgraph,
# replayed in a CUDA graph: on an H100 (torch 2.11, 250m preset, bf16, B=1) a decode step took 3.3 ms
# with the op and 1.4 ms without, and the op alone 1.2-2.3 ms against 0.4-0.7 ms for the subgraph.
# The op branches per request on the host, so Inductor must replay the graph around it.
FUSE_ON_CUDA = False


class FuseVerifySampling(RegionPass):
    traced = verify_sample
    op_name = "verify_sample"
    arity = (7, 2)
    modules = (op_module, triton_kernel, probes)

    @property
    def settings(self) -> tuple:  # read when the uuid is, so that a switch set later counts
        return (FUSE_ON_CUDA, library.version())  # whether the C++ kernels built: PassManager.uuid

    def op_for(self, devices: set[str]) -> torch._ops.OpOverload:
        native = devices == {"cpu"} and library.load()
        return (
            torch.ops.compiled_mtp.greedy_verify_sample if native else torch.ops.compiled_mtp.verify_sample
        ).default

    def serves(self, devices: set[str]) -> bool:
        return devices == {"cpu"} or (devices == {"cuda"} and FUSE_ON_CUDA and triton_kernel.available())

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(logits, temperature, top_k, top_p, drafts, draft_probs, noise) -> (num_accepted, tokens)."""
        three_d, floats, (top_k,), (drafts,), (noise,) = by_signature(
            inputs,
            {(3, True): 2, (1, True): 2, (1, False): 1, (2, False): 1, (2, True): 1},
            "inputs (logits, temperature, top_k, top_p, drafts, draft_probs, noise)",
        )
        logits, draft_probs = sorted(three_d, key=lambda n: -n.meta["val"].shape[1])  # logits have K+1 rows
        outputs = sorted(outputs, key=lambda n: n.meta["val"].dim())
        candidates = [
            [logits, t, top_k, p, drafts, draft_probs, noise] for t, p in itertools.permutations(floats)
        ]
        return one_agreeing(inputs, outputs, candidates, self._agreement, _AGREEMENT), outputs

    def _agreement(self, region: Region, args: list[fx.Node]) -> float:
        """The share of probe rows where region and fused op commit the same tokens. Not necessarily
        all: the region's softmax and cumulative sums round differently, so a uniform within rounding
        of a step of the CDF may pick the neighbouring token."""
        gen = torch.Generator().manual_seed(0)
        batch = args[0].meta["val"].shape[0]
        op = self.op_for(device_types(args))
        same = total = 0
        for probe in range(probe_rounds(batch)):
            values = _probe_inputs(args, probe, gen)
            (accepted, tokens), (fused_accepted, fused_tokens) = region(args, values), op(*values)
            same += int(((accepted == fused_accepted) & (tokens == fused_tokens).all(-1)).sum())
            total += batch
        return same / total


def _probe_inputs(args: list[fx.Node], probe: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Seeded inputs of the graph's shapes, rows cycling through the probe parameters; drafts that are
    sometimes the target's argmax (so accepts happen) and sometimes not."""
    logits_val, *_, drafts_val, probs_val, noise_val = (a.meta["val"] for a in args)
    batch, rows, vocab = logits_val.shape
    k = rows - 1
    logits = probe_logits((batch, rows, vocab), gen)
    temperature, top_k, top_p = probe_params(batch, probe)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1)
    drafts = torch.where(
        torch.rand(batch, k, generator=gen) < 0.7,
        logits[:, :k].argmax(-1),
        torch.randint(0, vocab, (batch, k), generator=gen),
    )
    noise = torch.rand(batch, rows, generator=gen)
    values = [
        logits,
        temperature,
        top_k,
        top_p,
        drafts.to(drafts_val.dtype),
        q.to(probs_val.dtype),
        noise.to(noise_val.dtype),
    ]
    return [
        v.to(logits_val.device) for v in values
    ]  # on the graph's device: that device's kernel is what runs
