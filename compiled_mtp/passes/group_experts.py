"""The routed experts of each MoE layer become `compiled_mtp::routed_experts` (CPU float32).

The model's fixed-shape MoE (`models.deepseek_v3.gathered_experts`) gathers each row's k experts and
multiplies every (row, expert) pair on its own, so an expert chosen by several rows of a verify is
read once for each of them. The op (kernels/routed_experts.py) groups the rows by expert and reads
each chosen expert once. Measured on 2 cores, the 7 MoE layers of the 250m preset (16 experts, 4 per
row, 768 x 256), the kernel alone against Inductor's code for the gathered products: 1.8 / 5.5 /
10.7 ms against 2.4 / 7.1 / 15.5 ms at 1 / 4 / 16 rows. In the 250m verify, timed in turns in one
process, a verify of 4 rows took 1.1-2.2 ms less with the op, but one of 1 row 0.2-1.3 ms more (a call
out of the generated code, where Inductor fuses the products with their neighbours), so layers on
fewer than MIN_ROWS rows stay as they are.

The products are found by provenance, each layer's as one connected region of nodes traced inside
`gathered_experts`, with the function's six inputs and one output. Shapes tell the inputs apart but
for gate and up, which have the same; the region and the op run on seeded probe inputs under both
assignments, and the region is replaced only when exactly one of them agrees. A region where any of
this fails is left as it was, with a log line.
"""

from __future__ import annotations

import itertools
import logging
import re

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..models.deepseek_v3 import Experts
from .fx_nodes import call, in_graph_order, on_cpu_float32, standalone, traced_calls
from .kernels import routed_experts as op_module

log = logging.getLogger("compiled_mtp.passes")
ROUTED_EXPERTS = torch.ops.compiled_mtp.routed_experts.default
MIN_ROWS = 2
_FRAME = re.compile(r'models[/\\]deepseek_v3\.py", line \d+, in gathered_experts\n')


class GroupExperts(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        for _, inputs, outputs in traced_calls(graph, _FRAME):
            if _rows(outputs) < MIN_ROWS:
                continue
            args = _roles(inputs, outputs)
            if isinstance(args, str):
                log.warning("group_experts: a MoE layer's experts stay gathered: %s", args)
                continue
            with graph.inserting_after(in_graph_order(inputs, graph)[-1]):
                grouped = call(graph, ROUTED_EXPERTS, *args)
            outputs[0].replace_all_uses_with(grouped)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__), str(MIN_ROWS)).hex()

    def prepare(self, model: nn.Module) -> None:
        """Build the kernel now if some layer's experts go to it, so that the first step served does
        not wait for the compiler."""
        experts = [m.gate_proj for m in model.modules() if isinstance(m, Experts)]
        if any(w.device.type == "cpu" and w.dtype == torch.float32 for w in experts):
            op_module.build()


def _rows(outputs: list[fx.Node]) -> int:
    """Rows of the region's [N, H] output (any count where the region is not what it should be: _roles
    says why)."""
    val = outputs[0].meta.get("val") if len(outputs) == 1 else None
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() == 2 else MIN_ROWS


def _roles(inputs: list[fx.Node], outputs: list[fx.Node]) -> list[fx.Node] | str:
    """The op's arguments (x, idx, weights, gate, up, down) or why the region cannot be replaced."""
    if len(inputs) != 6 or len(outputs) != 1:
        return f"the region has {len(inputs)} inputs and {len(outputs)} outputs, expected 6 and 1"
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs + outputs):
        return "a region input or output is not a tensor"
    if not on_cpu_float32(outputs[0], *(n for n in inputs if n.meta["val"].is_floating_point())):
        return "not a CPU float32 graph"
    ints = [n for n in inputs if not n.meta["val"].is_floating_point()]
    candidates = [[x, idx, weights, gate, up, down] for idx in ints for x, weights, gate, up, down in itertools.permutations(set(inputs) - {idx})]
    candidates = [args for args in candidates if _fits(*(n.meta["val"] for n in args))]
    try:
        region = standalone(inputs, outputs)
        agreeing = [args for args in candidates if _agrees(region, inputs, args)]
    except Exception as e:  # the region does not compute what gathered_experts does
        return f"the region does not run on probe inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if len(agreeing) != 1:
        return f"{len(agreeing)} of {len(candidates)} assignments of its inputs agree with the op, expected 1"
    return agreeing[0]


def _fits(x, idx, weights, gate, up, down) -> bool:
    n, h = x.shape if x.dim() == 2 else (-1, -1)
    return (
        idx.dim() == 2 and idx.shape[0] == n and weights.shape == idx.shape and gate.dim() == 3
        and gate.shape == up.shape and gate.shape[2] == h and tuple(down.shape) == (gate.shape[0], h, gate.shape[1])
    )


def _agrees(region: fx.GraphModule, inputs: list[fx.Node], args: list[fx.Node]) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, idx, weights, gate, up, down = (n.meta["val"] for n in args)
    values = [
        torch.randn(x.shape, generator=gen),
        torch.randint(0, gate.shape[0], idx.shape, generator=gen),
        torch.rand(weights.shape, generator=gen),
        *(0.1 * torch.randn(w.shape, generator=gen) for w in (gate, up, down)),
    ]
    env = dict(zip(args, values))
    (expected,) = region(*(env[n] for n in inputs))
    return torch.allclose(ROUTED_EXPERTS(*values), expected, rtol=1e-4, atol=1e-4)
