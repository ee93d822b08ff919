"""`compiled_mtp::live_attention`: the model's latent attention over the live part of the cache.

A graph has static shapes, so the traced attention reads all max_seq_len entries of each request's
cache and masks those past the row's position. This op runs the same function,
`models.deepseek_v3.latent_attention`, on the entries up to the last one any row sees, gathered from
the cache by slot: every masked entry it leaves out has weight exactly 0 in the traced softmax, so
only rounding can differ (the products' sums run over fewer terms).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...models.deepseek_v3 import latent_attention

# Defined and implemented directly, not as a torch.library.custom_op, whose wrapper costs about 25 us
# a call: the op runs once per layer of every step.
torch.library.define(
    "compiled_mtp::live_attention",
    "(Tensor q_latent, Tensor q_pe, Tensor cache, Tensor slots, Tensor visible, float scale) -> Tensor",
)


def live_attention(q_latent: Tensor, q_pe: Tensor, cache: Tensor, slots: Tensor, visible: Tensor, scale: float) -> Tensor:
    """latent_attention(q_latent, q_pe, cache[slots], visible, scale), reading cache [N, S, D] only up
    to the last position visible [B, T, S] holds for any row."""
    seen = visible.flatten(0, -2).any(0).nonzero()
    live = int(seen.max()) + 1 if len(seen) else 1  # nothing visible: one entry, all masked, as traced
    return latent_attention(q_latent, q_pe, cache[slots, :live], visible[..., :live], scale).contiguous()


torch.library.impl("compiled_mtp::live_attention", "CompositeExplicitAutograd", live_attention)


@torch.library.register_fake("compiled_mtp::live_attention")
def _(q_latent, q_pe, cache, slots, visible, scale):
    return q_latent.new_empty(q_latent.shape, dtype=cache.dtype)
