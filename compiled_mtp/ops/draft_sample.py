"""`compiled_mtp::draft_sample`: a draft step's sampling (`graphs.sampling.draft_sample`) as one
operation on CPU. Where the C++ ops build, graphs call `compiled_mtp::greedy_draft_sample`
(ops/csrc/greedy_sample.cpp) instead, which samples a batch of greedy requests itself and hands
any other batch to this op.

The traced definition must stay branch-free, so every draft step of every request sorts the whole
vocabulary for top-k/top-p: 12.6 ms for one row of a 129280-token vocabulary on this CPU, as long as
the LM head that made the row. Here a request takes only the work its parameters need, by the same
paths as the verify op (verify_sample.py): an argmax and a one-hot q for greedy requests, a softmax
for a temperature alone, and a sort of only the tokens that can be kept for top-k/top-p. The token
is then drawn from q as the definition draws it, so for the same noise the same tokens come out,
with the verify op's one caveat: a draw whose uniform falls within float rounding of a step of the
CDF may pick the neighbouring token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..graphs.sampling import sample_from_probs
from .verify_sample import filtered_rows, request_kinds, rows_of, softmax_rows

# Defined and implemented directly, like the verify op: it runs in every draft step.
torch.library.define(
    "compiled_mtp::draft_sample",
    "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor u) -> (Tensor, Tensor)",
)


def draft_sample(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor
) -> tuple[Tensor, Tensor]:
    """Arguments and results as `graphs.sampling.draft_sample`: (tokens [B], q float32 [B, V])."""
    logits = logits.float()
    g, s, f = request_kinds(temperature, top_k, top_p, logits.shape[-1])
    tokens = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    q = torch.empty_like(logits)
    top = rows_of(logits, g).argmax(-1)
    tokens[g] = top
    q[g] = torch.zeros(len(g), logits.shape[-1], device=logits.device).scatter_(-1, top[:, None], 1.0)
    for requests, rows in (
        (s, softmax_rows(rows_of(logits, s)[:, None], temperature[s])),
        (f, filtered_rows(rows_of(logits, f)[:, None], temperature[f], top_k[f], top_p[f])),
    ):
        probs = rows.probs[:, 0]
        q[requests] = probs
        tokens[requests] = sample_from_probs(probs, u[requests])
    return tokens, q


torch.library.impl("compiled_mtp::draft_sample", "CPU", draft_sample)


@torch.library.register_fake("compiled_mtp::draft_sample")
def _(logits, temperature, top_k, top_p, u):
    return logits.new_empty(logits.shape[0], dtype=torch.long), logits.new_empty(
        logits.shape, dtype=torch.float32
    )
