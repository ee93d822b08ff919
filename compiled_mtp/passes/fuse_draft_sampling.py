"""Fuse each draft step's sampling into `compiled_mtp::draft_sample` (CPU).

draft_extend samples one draft per request and draft_decode one per step, each through the traced
`graphs.sampling.draft_sample`: softmax, argmax and one-hot rows, a stable sort of the whole
vocabulary, cumsums and scatters. The sort alone took 12.6 ms for one row of a 129280-token
vocabulary, as long as the LM head; the op (kernels/draft_sample.py) sorts only where top-k/top-p
need it. Each call is found as the verify sampling is (fuse_verify_sampling.py): by provenance, one
connected region per call, with exactly the function's inputs and outputs. The region and the op run
on seeded probe inputs first, under each way of assigning the three [B] float inputs (temperature,
top_p, the uniform); the region is replaced only where exactly one assignment reproduces its tokens
and draft distributions. A region where any of this fails is left as it was, with a log line.
"""

from __future__ import annotations

import itertools
import logging
import re

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .fuse_verify_sampling import PROBE_ROWS, probe_logits, probe_params
from .fx_nodes import call_in_place_of, device_types, signature, standalone, traced_calls
from .kernels import draft_sample as op_module
from .kernels import greedy_sample

log = logging.getLogger("compiled_mtp.passes")
FUSED = torch.ops.compiled_mtp.draft_sample.default
_AGREEMENT = 0.9  # share of probe rows, as for the verify op: rounding may move a draw at a step of the CDF
_FRAME = re.compile(r'graphs[/\\]sampling\.py", line \d+, in draft_sample\n')


class FuseDraftSampling(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        for _, inputs, outputs in traced_calls(graph, _FRAME):
            devices = device_types(inputs)
            if devices != {"cpu"}:
                log.info("fuse_draft_sampling: the draft sampling stays unfused on %s", "/".join(sorted(devices)))
                continue
            roles = _roles(inputs, outputs)
            if isinstance(roles, str):
                log.warning("fuse_draft_sampling: left unfused: %s", roles)
                continue
            args, tokens, q = roles
            call_in_place_of(graph, FUSED, args, [tokens, q])
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__)).hex()

    def prepare(self, model: nn.Module) -> None:
        greedy_sample.prepare(model)


def _roles(inputs: list[fx.Node], outputs: list[fx.Node]):
    """(the op's arguments in order, tokens, q) or why the region cannot be fused."""
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs + outputs):
        return "a region input or output is not a tensor"
    logits, floats, top_k = ([n for n in inputs if signature(n) == kind] for kind in ((2, True), (1, True), (1, False)))
    tokens, q = ([n for n in outputs if signature(n) == kind] for kind in ((1, False), (2, True)))
    if [len(nodes) for nodes in (logits, floats, top_k, tokens, q)] != [1, 3, 1, 1, 1] or len(inputs) != 5 or len(outputs) != 2:
        return "its inputs and outputs do not have the shapes of (logits, temperature, top_k, top_p, u) -> (tokens, q)"
    (logits,), (top_k,), (tokens,), (q,) = logits, top_k, tokens, q
    candidates = [[logits, t, top_k, p, u] for t, p, u in itertools.permutations(floats)]
    try:
        module = standalone(inputs, [tokens, q])
        shares = [_agreement(module, args, inputs) for args in candidates]
    except Exception as e:  # the region does not run as a draft step's sampling would
        return f"the region does not run on probe inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    agreeing = [args for args, share in zip(candidates, shares) if share >= _AGREEMENT]
    if len(agreeing) != 1:
        return f"the fused op reproduces {', '.join(f'{s:.0%}' for s in shares)} of the probe rows under the six input assignments, expected one >= {_AGREEMENT:.0%}"
    return agreeing[0], tokens, q


def _agreement(module: fx.GraphModule, args: list[fx.Node], inputs: list[fx.Node]) -> float:
    """The share of probe rows where region and op draw the same token from the same distribution."""
    gen = torch.Generator().manual_seed(0)
    batch, vocab = args[0].meta["val"].shape
    same = total = 0
    for probe in range(max(2, -(-PROBE_ROWS // batch))):
        values = [probe_logits((batch, vocab), gen), *probe_params(batch, probe), torch.rand(batch, generator=gen)]
        env = dict(zip(args, [v.to(a.meta["val"].dtype) for v, a in zip(values, args)]))
        (tokens, q), (fused_tokens, fused_q) = module(*(env[n] for n in inputs)), FUSED(*(env[a] for a in args))
        close = torch.isclose(q.float(), fused_q, rtol=1e-3, atol=1e-6).all(-1)
        same += int(((tokens == fused_tokens) & close).sum())
        total += batch
    return same / total

