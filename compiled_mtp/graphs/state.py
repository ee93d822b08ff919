"""Static buffers shared by every graph: KV caches and per-slot decoding state.

Everything is indexed by cache slot. The last slot is scratch: padded rows of a bucket read and write
only there, so they never touch a live request. Graphs gather what they need by slot and scatter
results back, so the runtime passes only slots, lengths and noise between steps.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..models.family import CausalLM

# Depth-0 steps M may fall behind before it catches up: one M pass over this many rows per that many
# tokens, against one M pass per token if it kept up every step. The pass writes every row's cache
# entry but runs the layer past them on the last row only, so its cost is mostly the call's own: a
# longer window spreads it over more steps (benchmarks/README.md, "Auto at B = 4").
LAG_WINDOW = 32


class StaticState(nn.Module):
    """Buffers (not inputs) so compiled graphs and CUDA graphs see fixed addresses."""

    target_cache: Tensor  # [layers, slots + 1, max_seq_len, the family's entry width] (model.new_cache)
    mtp_cache: Tensor  # [mtp layers, slots + 1, max_seq_len, ...] (empty without MTP)
    last_token: Tensor  # [slots + 1] the last committed token, not yet through the target
    drafts: Tensor  # [slots + 1, K] d_1..d_K of the coming verify
    draft_probs: Tensor  # [slots + 1, K, V] q_1..q_K the drafts were sampled from
    mtp_hidden: Tensor  # [slots + 1, H] (H: model.hidden_width) M's hidden where d_1 was last drafted from
    lag_hidden: Tensor  # [slots + 1, W, H] T's hiddens at depth-0 steps, by position % W (W = 0 without MTP)
    temperature: Tensor  # [slots + 1] per-request sampling parameters, set at admission
    top_k: Tensor
    top_p: Tensor

    def __init__(self, model: CausalLM, num_slots: int, max_seq_len: int, max_depth: int) -> None:
        super().__init__()
        cfg = model.cfg
        n = num_slots + 1
        dev = model.lm_head.weight.device
        mtp_layers = model.num_mtp_layers if max_depth > 0 else 0
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.register_buffer("target_cache", model.new_cache(cfg.num_hidden_layers, n, max_seq_len))
        self.register_buffer("mtp_cache", model.new_cache(mtp_layers, n, max_seq_len))
        self.register_buffer("last_token", torch.zeros(n, dtype=torch.long, device=dev))
        depth = max(max_depth, 1)
        self.register_buffer("drafts", torch.zeros(n, depth, dtype=torch.long, device=dev))
        self.register_buffer(
            "draft_probs", torch.zeros(n, depth if max_depth else 0, cfg.vocab_size, device=dev)
        )
        dtype = model.lm_head.weight.dtype
        self.register_buffer("mtp_hidden", torch.zeros(n, model.hidden_width, dtype=dtype, device=dev))
        window = LAG_WINDOW if mtp_layers else 0
        self.register_buffer(
            "lag_hidden", torch.zeros(n, window, model.hidden_width, dtype=dtype, device=dev)
        )
        self.register_buffer("temperature", torch.zeros(n, device=dev))
        self.register_buffer("top_k", torch.zeros(n, dtype=torch.long, device=dev))
        self.register_buffer("top_p", torch.ones(n, device=dev))
        if dev.type == "cuda":
            # CUDA-graph replay reads and writes these in place: their addresses must never change.
            for buf in self.buffers():
                torch._dynamo.mark_static_address(buf)

    @property
    def lag_window(self) -> int:
        """How many depth-0 steps M may fall behind before it must catch up (0: no MTP layers)."""
        return self.lag_hidden.shape[1]

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def set_sampling(self, slot: int, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature[slot] = temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
