"""`compiled_mtp::verify_sample`: the verify graph's sampling subgraph as one operation.

The fusion pass (passes/fuse_verify_sampling.py) puts it in place of the traced
`graphs.sampling.verify_sample`, which stays the definition: for the same noise this kernel commits
the tokens that definition commits run eagerly (tests/test_sampling.py checks it over drawn inputs).
Against a compiled graph, whose sums round in another order, the same holds for greedy requests; a
sampled draw can differ only where its uniform falls within rounding of a step of the CDF. The traced subgraph must stay branch-free, so it sorts every row of the vocabulary for
top-k/top-p and builds one-hot rows for greedy requests. Here a request takes only the work its
parameters need:
- greedy: one argmax per row; p(d) is 1 at the argmax, and the final token is the argmax of row a;
- temperature without top-k/top-p: a softmax per row, no sort;
- top-k or top-p: a sort of the 1024 (then 16384) most likely tokens instead of the vocabulary
  (the traced definition itself where the cut may fall beyond them).
Each logits row is then read once for the accept test; only row a of each request is used for the
final draw.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...graphs.sampling import accept_drafts, committed_tokens, final_draw, processed_probs

# Tokens sorted per row for top-k/top-p, tried in turn (the traced definition sorts the whole vocabulary).
CANDIDATES = (1024, 16384)


@torch.library.custom_op("compiled_mtp::verify_sample", mutates_args=(), device_types="cpu")
def verify_sample(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, drafts: Tensor, draft_probs: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
    """Arguments and results as `graphs.sampling.verify_sample`: (num_accepted [B], tokens [B, K+1])."""
    batch, rows, vocab = logits.shape
    k = rows - 1
    logits = logits.float()
    greedy = temperature <= 0
    plain = ~greedy & ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1)
    g, s, f = (mask.nonzero().squeeze(1) for mask in (greedy, plain, ~greedy & ~plain))

    # p_i(d_i) for the accept test, and each sampled request's K+1 distributions for the final draw.
    p_draft = logits.new_zeros(batch, k)
    argmax = logits[g].argmax(-1)  # [G, K+1]
    p_draft[g] = (drafts[g] == argmax[:, :k]).float()
    sampled = torch.cat([s, f])
    probs = torch.cat([_softmax_rows(logits[s], temperature[s]), _filtered_rows(logits[f], temperature[f], top_k[f], top_p[f])])
    p_draft[sampled] = probs[:, :k].gather(-1, drafts[sampled, :, None]).squeeze(-1)

    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted, num_accepted = accept_drafts(p_draft, q_draft, noise[:, :k])

    final = torch.empty(batch, dtype=torch.long)
    final[g] = argmax.gather(1, num_accepted[g, None]).squeeze(1)
    final[sampled] = final_draw(probs, draft_probs[sampled], num_accepted[sampled], noise[sampled, k])
    return num_accepted, committed_tokens(accepted, drafts, final)


@verify_sample.register_fake
def _(logits, temperature, top_k, top_p, drafts, draft_probs, noise):
    batch, rows, _ = logits.shape
    return logits.new_empty(batch, dtype=torch.long), logits.new_empty(batch, rows, dtype=torch.long)


def _softmax_rows(logits: Tensor, temperature: Tensor) -> Tensor:
    """processed_probs without top-k/top-p: its final renormalization is kept, for equal rounding."""
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
    return probs / probs.sum(-1, keepdim=True)


def _filtered_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """processed_probs for rows with top-k or top-p, sorting only the most likely tokens.

    The cut nearly always falls among the first CANDIDATES[0] tokens; a row where it may not (its
    kept tokens reach the smallest candidate's probability, or top_k needs more candidates) tries
    the next count, and the traced definition (a sort of the whole vocabulary) after the last."""
    n, rows, vocab = logits.shape
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1).reshape(n * rows, vocab)
    k, p = top_k.repeat_interleave(rows), top_p.repeat_interleave(rows).float()
    out = torch.empty_like(probs)
    todo = torch.arange(n * rows)
    for m in CANDIDATES:
        if not len(todo) or m >= vocab:
            break
        filtered, unsure = _filter_candidates(probs[todo], k[todo, None], p[todo, None], m)
        out[todo[~unsure]] = filtered[~unsure]
        todo = todo[unsure]
    if len(todo):
        out[todo] = processed_probs(logits.reshape(n * rows, vocab)[todo], temperature.repeat_interleave(rows)[todo], k[todo], p[todo])
    return out.view(n, rows, vocab)


def _filter_candidates(probs: Tensor, k: Tensor, p: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(processed_probs's rows from the m most likely tokens of `probs` [R, V], rows where that may be wrong)."""
    vocab = probs.shape[-1]
    top = probs.topk(m, dim=-1)
    # In the traced order: probability descending, ties by token id.
    ids = top.indices.sort(dim=-1).values
    values, order = probs.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    rank = torch.arange(m)
    values = values * ((rank < k) | (k <= 0))
    cumulative = values.cumsum(-1)
    tail = probs.scatter(-1, ids, 0.0).sum(-1, keepdim=True) * ((k <= 0) | (k >= vocab))
    keep = (cumulative - values < p * (cumulative[:, -1:] + tail)) | (rank == 0) | (p >= 1)
    kept = values * keep
    filtered = torch.zeros_like(probs).scatter(-1, ids, kept)
    last_kept = torch.where(kept > 0, kept, torch.inf).amin(-1, keepdim=True)
    unsure = (last_kept <= top.values[:, -1:]) | ((k >= m) & (k < vocab))
    return filtered / filtered.sum(-1, keepdim=True), unsure.squeeze(1)
