"""Attention over the live part of each slot's cache only (`compiled_mtp::live_attention`, CPU).

Static shapes make the traced attention (`models.deepseek_v3.latent_attention`) gather every one of
a slot's max_seq_len cache entries and mask those past each row's position, so its cost follows the
capacity, not the sequence. The op computes the same function over
each request's entries up to the last one its rows see, reading them from the cache itself, so the
graph's gather of every slot's whole cache goes as well.

Each call is found by provenance (region.py): one connected region per layer, whose inputs must be
the two queries [B, T, H, *], kv_b_proj's weight [H * (dn + dv), r], the gathered entries kv [B, S, D]
and the mask visible [B, T, S], where kv is a gather of one layer's cache by slot
(`cache[layer][slots]`). The op also takes the absorbed products, each head's query rows into the
latent space and its output out of it, which Inductor otherwise runs as two loops a layer on one
thread. The scale is the region's one
multiplication by a number. The region and the op run on seeded probe inputs under both assignments
of the queries; the region is replaced only where exactly one agrees. Anything else leaves the
region as it was, with a log line.

On CPU float32 the op is one C++ kernel call a layer (ops/csrc/live_attention.cpp), faster than the
traced attention at every shape measured, a prefill chunk's included (docs/passes.md, live_attention).
"""

from __future__ import annotations

import torch
from torch import fx

from ..models.deepseek_v3 import latent_attention
from .fx_nodes import aten
from .region import Region, RegionPass, Unfusable, by_signature, one_agreeing


class LiveAttention(RegionPass):
    traced = latent_attention
    op_name = "live_attention"
    native = True
    arity = (5, 1)

    def roles(
        self, region: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
    ) -> tuple[list, list[fx.Node]]:
        """(q_nope, q_pe, kv_b, cache, slots, visible, scale) -> out, the queries told apart on probes."""
        queries, (kv_b,), (kv,), (visible,) = by_signature(
            inputs,
            {(4, True): 2, (2, True): 1, (3, True): 1, (3, False): 1},
            "inputs (q_nope, q_pe, kv_b, kv, visible)",
        )
        cache, index = kv.args if kv.target is aten.index.Tensor else (None, ())
        if not (
            isinstance(cache, fx.Node)
            and isinstance(index, list | tuple)
            and len(index) == 1
            and cache.meta["val"].dim() == 3
        ):
            raise Unfusable("its entries are not a gather of one layer's cache by slot")
        scales = [n.args[1] for n in region if n.target is aten.mul.Tensor and isinstance(n.args[1], float)]
        if len(scales) != 1:
            raise Unfusable(f"it multiplies by {len(scales)} numbers, expected one (the scale)")
        values, scale = _probe_values(inputs, visible), scales[0]

        def agreement(run: Region, q: list[fx.Node]) -> float:
            return self._agreement(run, values, [*q, kv_b, kv, visible], scale)

        q_nope, q_pe = one_agreeing(inputs, outputs, [queries, queries[::-1]], agreement)
        return [q_nope, q_pe, kv_b, cache, index[0], visible, scale], outputs

    def _agreement(
        self, region: Region, values: dict[fx.Node, torch.Tensor], roles: list[fx.Node], scale: float
    ) -> float:
        """1 if the op, given `roles` (q_nope, q_pe, kv_b, kv, visible), computes the region's output,
        else 0."""
        (expected,) = region(list(values), list(values.values()))
        q_nope, q_pe, kv_b, kv, visible = (values[n] for n in roles)
        if q_pe.shape[-1] + kv_b.shape[-1] != kv.shape[-1]:
            return 0.0  # the queries swapped: the latent and rope widths do not add up to an entry's
        # Otherwise the op's checks are the same under either assignment, so an error is never a wrong
        # assignment: it reaches one_agreeing, which names it in the region's log line.
        got = self.op(q_nope, q_pe, kv_b, kv, torch.arange(len(kv)), visible, scale)
        # The products sum dn and r terms of random probes in another order: the rounding follows the
        # outputs' scale (4e-5 at outputs up to 23 on the shipped model's shapes), not each output's.
        atol = 1e-5 * max(1.0, expected.abs().max().item())
        return float(got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=atol))


def _probe_values(inputs: list[fx.Node], visible: fx.Node) -> dict[fx.Node, torch.Tensor]:
    """Seeded probe values of the region's inputs: random queries and entries, each row seeing a
    random prefix of its slot's entries."""
    gen = torch.Generator().manual_seed(0)
    values = {
        n: torch.randn(n.meta["val"].shape, generator=gen).to(n.meta["val"].dtype)
        for n in inputs
        if n is not visible
    }
    batch, rows, capacity = visible.meta["val"].shape
    values[visible] = torch.arange(capacity) <= torch.randint(0, capacity, (batch, rows, 1), generator=gen)
    return values
