"""The sampling ops' greedy path on CPU float32 (`compiled_mtp::greedy_sample`, csrc/greedy_sample.cpp):
a batch whose requests are all greedy is verified in one C++ call (drafts: `compiled_mtp::greedy_draft_sample`,
the same file, which graphs call directly).

Greedy decoding is the common case, and for it the sampling ops' Python paths cost more than their
arithmetic: about 20 small operations a call, and a single-threaded argmax (see docs/passes.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import library


def greedy_verify(
    logits: Tensor, temperature: Tensor, drafts: Tensor, draft_probs: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor] | None:
    """`graphs.sampling.verify_sample`'s (num_accepted [B], tokens [B, K+1]) when every request is
    greedy, the logits are CPU float32 and the ops are built; None otherwise (the caller then takes
    its general path). Arguments as that function's, less top_k and top_p, which greedy requests
    ignore."""
    if not (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.numel()
        and library.available()
    ):
        return None
    num_accepted, tokens, done = torch.ops.compiled_mtp.greedy_sample.default(
        logits, temperature, drafts, draft_probs, noise
    )
    return (num_accepted, tokens) if done.item() else None
