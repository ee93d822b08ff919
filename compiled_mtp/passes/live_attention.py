"""Attention over the live part of each slot's cache only (`compiled_mtp::live_attention`, CPU).

Static shapes make the traced attention (`models.deepseek_v3.latent_attention`) gather every one of
a slot's max_seq_len cache entries and mask those past each row's position, so its cost follows the
capacity, not the sequence: at max_seq_len 2048, a K=3 verify of the 250m preset at B=8 with 40
tokens per request took 136 ms against 74 at max_seq_len 256. The op computes the same function over
each request's entries up to the last one its rows see, reading them from the cache itself, so the
graph's gather of every slot's whole cache goes as well.

Each call is found by provenance, as the sampling is (fuse_verify_sampling.py): one connected region
per layer, whose inputs must be the two queries [B, T, H, *], the gathered entries kv [B, S, D] and
the mask visible [B, T, S], where kv is a gather of one layer's cache by slot (`cache[layer][slots]`).
The scale is the region's one multiplication by a number. The region and the op run on seeded probe
inputs under both assignments of the queries; the region is replaced only where exactly one agrees.
Anything else leaves the region as it was, with a log line.

On CPU float32 the op is one C++ kernel call a layer (kernels/live_attention.py), faster than the
traced attention at every shape measured on the 250m preset's layer (12 heads, r = 256, dr = 32, 40
entries live, ms traced / op): a verify of 4 rows at B=1 0.09 / 0.03 with max_seq_len 80 and 1.00 /
0.03 with 2048, at B=8 0.30 / 0.16 and 8.28 / 0.18; a decode row at B=1 0.07 / 0.02. A prefill chunk
of 64 rows costs what its live entries do: 0.5 ms after no tokens against 14.0 traced at max_seq_len
2048, 13.7 after 1984 against 11.7 (MKL's products do that arithmetic faster), so about half the
traced cost over a whole prompt.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .fx_nodes import aten, call, device_types, in_graph_order, signature, standalone, traced_calls
from .kernels import cpp_build
from .kernels import live_attention as op_module

log = logging.getLogger("compiled_mtp.passes")
FUSED = torch.ops.compiled_mtp.live_attention.default
_FRAME = re.compile(r'models[/\\]deepseek_v3\.py", line \d+, in latent_attention\n')


class LiveAttention(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        for region, inputs, outputs in traced_calls(graph, _FRAME):
            devices = device_types(inputs)
            if devices != {"cpu"}:
                log.info("live_attention: attention stays traced on %s", "/".join(sorted(devices)))
                continue
            args = _arguments(region, inputs, outputs)
            if isinstance(args, str):
                log.warning("live_attention: left traced: %s", args)
                continue
            with graph.inserting_after(in_graph_order(args[:5], graph)[-1]):
                outputs[0].replace_all_uses_with(call(graph, FUSED, *args))
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        return get_hash_for_files((__file__, op_module.__file__)).hex()

    def prepare(self, model: nn.Module) -> None:
        """Build the kernel now if the model's attention goes to it, so that the first step served
        does not wait for the compiler."""
        if cpp_build.serves(model):
            op_module.build()


def _parts(region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]):
    """(the two queries, kv, visible, the output, the scale) or why the region cannot be replaced."""
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in inputs + outputs):
        return "a region input or output is not a tensor"
    queries, kv, visible = ([n for n in inputs if signature(n) == kind] for kind in ((4, True), (3, True), (3, False)))
    if [len(nodes) for nodes in (queries, kv, visible)] != [2, 1, 1] or len(inputs) != 4 or len(outputs) != 1:
        return "its inputs and outputs do not have the shapes of (q_latent, q_pe, kv, visible) -> out"
    (kv,), (visible,), (out,) = kv, visible, outputs
    if not (kv.target is aten.index.Tensor and len(kv.args[1]) == 1 and kv.args[0].meta["val"].dim() == 3):
        return "its entries are not a gather of one layer's cache by slot"
    scales = [n.args[1] for n in region if n.target is aten.mul.Tensor and isinstance(n.args[1], float)]
    if len(scales) != 1:
        return f"it multiplies by {len(scales)} numbers, expected one (the scale)"
    return queries, kv, visible, out, scales[0]


def _arguments(region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> list | str:
    """The op's arguments in order, the queries told apart on seeded probes, or why the region cannot
    be replaced."""
    parts = _parts(region, inputs, outputs)
    if isinstance(parts, str):
        return parts
    queries, kv, visible, out, scale = parts
    try:
        values, expected = _probe(standalone(inputs, [out]), inputs, kv, visible)
    except Exception as e:  # the region does not run as attention would
        return f"the region does not run on probe inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    agreeing = [q for q in (queries, queries[::-1]) if _agrees(values, expected, [*q, kv, visible], scale)]
    if len(agreeing) != 1:
        return f"the op agrees with the region under {len(agreeing)} assignments of the queries, expected one"
    cache, (slots,) = kv.args
    return [*agreeing[0], cache, slots, visible, scale]


def _probe(module: fx.GraphModule, inputs: list[fx.Node], kv: fx.Node, visible: fx.Node) -> tuple[dict, torch.Tensor]:
    """Seeded probe values of the region's inputs (random queries and entries, each row seeing a
    random prefix of its slot's entries) and the region's output on them."""
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn(n.meta["val"].shape, generator=gen).to(n.meta["val"].dtype) for n in inputs if n is not visible}
    batch, rows, capacity = visible.meta["val"].shape
    values[visible] = torch.arange(capacity) <= torch.randint(0, capacity, (batch, rows, 1), generator=gen)
    return values, module(*(values[n] for n in inputs))[0]


def _agrees(values: dict, expected: torch.Tensor, roles: list[fx.Node], scale: float) -> bool:
    """Whether the op, given `roles` (q_latent, q_pe, kv, visible), computes the region's output."""
    q_latent, q_pe, kv, visible = (values[n] for n in roles)
    try:
        got = FUSED(q_latent, q_pe, kv, torch.arange(len(kv)), visible, scale)
    except RuntimeError:  # shapes that do not fit
        return False
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
