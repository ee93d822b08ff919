"""Fuse the verify graph's sampling subgraph into `compiled_mtp::verify_sample`.

The subgraph is what `graphs.sampling.verify_sample` traced to: about 100 post-grad nodes (softmax,
argmax and one-hot rows, a stable sort of every row, cumsums, scatters, the accept test, the
residual draw). Inductor's own rewrites reshape it (the one-hot scatter becomes a compare, softmax is
split around the temperature), so no fixed pattern describes it. It is found by provenance instead:
every node traced inside that function carries its frame in `stack_trace`, and nodes Inductor
created without a trace join when all their users are in the region. The region must have exactly
the function's inputs and outputs. Before anything is replaced, the region and the fused op run on
seeded probe inputs of the graph's shapes; the replacement happens only if they agree on the
committed tokens (up to rounding, see `_agreement`), which also tells apart the two [B] float
inputs (temperature, top_p). The probes run on the graph's device, so on CUDA they check the Triton
kernel (kernels/verify_sample_triton.py) the graph will run. A graph where any of this fails is left
as it was, with a log line.
"""

from __future__ import annotations

import itertools
import logging
import re

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from .fx_nodes import boundary, call_in_place_of, device_types, signature, standalone, traced_region
from .kernels import greedy_sample
from .kernels import verify_sample as op_module
from .kernels import verify_sample_triton as triton_kernel  # registers the CUDA kernel where Triton is installed

log = logging.getLogger("compiled_mtp.passes")
FUSED = torch.ops.compiled_mtp.verify_sample.default
_AGREEMENT = 0.9  # measured: the right assignment agrees on every probe row, the swapped one on 65-70%
_LIVE_TOKENS = 16
# On CUDA the op (its Triton kernels) is slower than Inductor's own kernels for the traced subgraph,
# replayed in a CUDA graph: on an H100 (torch 2.11, 250m preset, bf16, B=1) a decode step took 3.3 ms
# with the op and 1.4 ms without, and the op alone 1.2-2.3 ms against 0.4-0.7 ms for the subgraph.
# The op branches per request on the host, so Inductor must replay the graph around it.
FUSE_ON_CUDA = False
_FRAME = re.compile(r'graphs[/\\]sampling\.py", line \d+, in verify_sample\n')


class FuseVerifySampling(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        region = traced_region(graph, _FRAME)
        if not region:
            return
        inputs, outputs = boundary(graph, region)
        devices = device_types(inputs)
        if devices != {"cpu"} and not (devices == {"cuda"} and FUSE_ON_CUDA and triton_kernel.available()):
            log.info("fuse_verify_sampling: the sampling subgraph stays unfused on %s", "/".join(sorted(devices)))
            return
        roles = _roles(inputs, outputs)
        if isinstance(roles, str):
            log.warning("fuse_verify_sampling: left unfused: %s", roles)
            return
        args, (accepted, tokens) = roles
        _replace(graph, args, accepted, tokens)

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__, triton_kernel.__file__), str(FUSE_ON_CUDA)).hex()

    def prepare(self, model: nn.Module) -> None:
        greedy_sample.prepare(model)


def _roles(inputs: list[fx.Node], outputs: list[fx.Node]):
    """(the op's arguments in order, (num_accepted, tokens)) or why the region cannot be fused."""
    if len(inputs) != 7 or len(outputs) != 2:
        return f"the region has {len(inputs)} inputs and {len(outputs)} outputs, expected 7 and 2"
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs + outputs):
        return "a region input or output is not a tensor"
    by_kind: dict[tuple[int, bool], list[fx.Node]] = {}
    for node in inputs:
        by_kind.setdefault(signature(node), []).append(node)
    three_d = sorted(by_kind.get((3, True), []), key=lambda n: -n.meta["val"].shape[1])  # logits have K+1 rows
    if [len(by_kind.get(kind, [])) for kind in ((3, True), (1, True), (1, False), (2, False), (2, True))] != [2, 2, 1, 1, 1]:
        return "its inputs do not have the shapes of (logits, temperature, top_k, top_p, drafts, draft_probs, noise)"
    logits, draft_probs = three_d
    (top_k,), (drafts,), (noise,) = by_kind[(1, False)], by_kind[(2, False)], by_kind[(2, True)]
    outputs = sorted(outputs, key=lambda n: n.meta["val"].dim())
    candidates = [
        [logits, temperature, top_k, top_p, drafts, draft_probs, noise]
        for temperature, top_p in itertools.permutations(by_kind[(1, True)])
    ]
    try:
        region = standalone(inputs, outputs)
        agreement = [_agreement(region, args, inputs) for args in candidates]
    except Exception as e:  # the region does not run as the verify sampling would (another graph)
        return f"the region does not run on probe inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    agreeing = [args for args, share in zip(candidates, agreement) if share >= _AGREEMENT]
    if len(agreeing) != 1:
        shares = " and ".join(f"{share:.0%}" for share in agreement)
        return f"the fused op reproduces {shares} of the region's probe rows under the two input assignments, expected one >= {_AGREEMENT:.0%}"
    return agreeing[0], tuple(outputs)


def _agreement(region: fx.GraphModule, args: list[fx.Node], inputs: list[fx.Node]) -> float:
    """The share of probe rows where region and fused op commit the same tokens. Not necessarily all:
    the region's softmax and cumulative sums round differently, so a uniform within rounding of a
    step of the CDF may pick the neighbouring token."""
    gen = torch.Generator().manual_seed(0)
    batch = args[0].meta["val"].shape[0]
    same = total = 0
    for probe in range(max(2, -(-PROBE_ROWS // batch))):  # two draws at the least
        values = _probe_inputs(args, probe, gen)
        env = dict(zip(args, values))
        (accepted, tokens), (fused_accepted, fused_tokens) = region(*(env[n] for n in inputs)), FUSED(*values)
        same += int(((accepted == fused_accepted) & (tokens == fused_tokens).all(-1)).sum())
        total += batch
    return same / total


# (temperature, top_k, top_p) of probe rows: greedy, temperature-only, top-k, top-p, mixes, chosen so
# that swapping temperature and top_p changes the distribution a lot (a top_p >= 1 keeps every
# token, a top_p near 0 acts greedy): probe rows tell the two [B] float inputs apart.
_PROBE_PARAMS = [(0.0, 0, 1.0), (4.0, 0, 1.0), (3.0, 0, 0.3), (2.0, 5, 1.0), (1.0, 0, 0.5), (3.0, 0, 1.0), (0.8, 3, 0.9), (2.5, 0, 0.6)]
PROBE_ROWS = 32


def probe_logits(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A few live tokens per row and the rest far below: the draws depend on every parameter, and the
    steps of the CDF are wide, so rounding in the region's sums never decides a token."""
    logits = torch.full(shape, -40.0)
    live = torch.rand(shape, generator=gen).argsort(-1)[..., :_LIVE_TOKENS]
    return logits.scatter_(-1, live, 1.5 * torch.randn(live.shape, generator=gen))


def probe_params(batch: int, probe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) [batch] of probe `probe`, cycling rows through _PROBE_PARAMS."""
    params = [_PROBE_PARAMS[(row + probe) % len(_PROBE_PARAMS)] for row in range(batch)]
    temperature, top_k, top_p = (torch.tensor(v) for v in zip(*params))
    return temperature.float(), top_k.long(), top_p.float()


def _probe_inputs(args: list[fx.Node], probe: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Seeded inputs of the graph's shapes, cycling rows through _PROBE_PARAMS; drafts that are
    sometimes the target's argmax (so accepts happen) and sometimes not."""
    logits_val, *_, drafts_val, probs_val, noise_val = (a.meta["val"] for a in args)
    batch, rows, vocab = logits_val.shape
    k = rows - 1
    logits = probe_logits((batch, rows, vocab), gen)
    temperature, top_k, top_p = probe_params(batch, probe)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1)
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, logits[:, :k].argmax(-1), torch.randint(0, vocab, (batch, k), generator=gen))
    noise = torch.rand(batch, rows, generator=gen)
    values = [logits, temperature, top_k, top_p, drafts.to(drafts_val.dtype), q.to(probs_val.dtype), noise.to(noise_val.dtype)]
    return [v.to(logits_val.device) for v in values]  # on the graph's device: that device's kernel is what runs


def _replace(graph: fx.Graph, args: list[fx.Node], accepted: fx.Node, tokens: fx.Node) -> None:
    call_in_place_of(graph, FUSED, args, [accepted, tokens])
    graph.eliminate_dead_code()
    stable_topological_sort(graph)  # users of `accepted` may precede the last input
