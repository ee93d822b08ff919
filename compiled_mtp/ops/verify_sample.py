"""`compiled_mtp::verify_sample`: the verify graph's sampling subgraph as one operation.

The fusion pass (passes/fuse_verify_sampling.py) puts it in place of the traced
`graphs.sampling.verify_sample`, which stays the definition: for the same noise this kernel commits
the tokens that definition commits run eagerly (tests/test_sampling.py checks it over drawn inputs).
One sum rounds in another order: top-p's total mass (candidates first, then the rest), so a cut
within float rounding of top_p could fall one token over. Against a compiled graph, whose sums
round in another order too, the same holds for greedy requests; a sampled draw can differ only
where its uniform falls within rounding of a step of the CDF.

The traced subgraph must stay branch-free, so it sorts every row of the vocabulary for top-k/top-p
and builds one-hot rows for greedy requests. Here a request takes only the work its parameters need:
- greedy: one argmax per row; p(d) is 1 at the argmax, and the final token is the argmax of row a
  (where the C++ ops build, CPU graphs call `compiled_mtp::greedy_verify_sample` instead,
  ops/csrc/greedy_sample.cpp, which verifies a batch of greedy requests itself and hands any other
  batch to this op);
- temperature without top-k/top-p: a softmax per row, no sort;
- top-k or top-p: one pass finds how far down the distribution the cut can fall, and only the tokens
  above that are sorted (the traced definition itself where they may not decide the cut).
Each logits row is then read once for the accept test; only row a of each request is used for the
final draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

from ..graphs.sampling import accept_drafts, committed_tokens, processed_probs, residual_draw

# Top-k/top-p candidates: mass buckets per row (a factor of sqrt(2) each; the last holds the rest), and
# how many buckets past the cut the candidates reach, so that rounding in the bucket sums cannot move it out.
BUCKETS = 64
SPARE_BUCKETS = 1


# Defined and implemented directly, not as a torch.library.custom_op, whose wrapper costs about 15 us
# a call (on a greedy batch, as much as the op's own work). cudagraph_unsafe: each request takes the
# path its parameters need, so the op syncs with the host (nonzero) and cannot be captured; Inductor
# replays the rest of a CUDA graph around it.
torch.library.define(
    "compiled_mtp::verify_sample",
    "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
    "Tensor drafts, Tensor draft_probs, Tensor noise) -> (Tensor, Tensor)",
    tags=(torch.Tag.cudagraph_unsafe,),
)


def verify_sample(*inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The CPU kernel. Arguments (the schema's above) and results as `graphs.sampling.verify_sample`:
    (num_accepted [B], tokens [B, K+1])."""
    return verify_by_kind(softmax_rows, filtered_rows, *inputs)


torch.library.impl("compiled_mtp::verify_sample", "CPU", verify_sample)


@torch.library.register_fake("compiled_mtp::verify_sample")
def _(logits, temperature, top_k, top_p, drafts, draft_probs, noise):
    batch, rows, _ = logits.shape
    return logits.new_empty(batch, dtype=torch.long), logits.new_empty(batch, rows, dtype=torch.long)


def verify_by_kind(
    plain: Callable[[Tensor, Tensor], Rows],
    filtered: Callable[[Tensor, Tensor, Tensor, Tensor], Rows],
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    drafts: Tensor,
    draft_probs: Tensor,
    noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """The op, given how a device reads the rows of requests sampled at a temperature alone
    (`plain(logits, temperature)`) and of those with top-k or top-p (`filtered(logits, t, k, p)`);
    greedy requests take an argmax."""
    logits = logits.float()
    g, s, f = request_kinds(temperature, top_k, top_p, logits.shape[-1])
    groups = [
        (g, Argmax(rows_of(logits, g).argmax(-1))),
        (s, plain(rows_of(logits, s), temperature[s])),
        (f, filtered(rows_of(logits, f), temperature[f], top_k[f], top_p[f])),
    ]
    return verify(groups, drafts, draft_probs, noise)


def request_kinds(
    temperature: Tensor, top_k: Tensor, top_p: Tensor, vocab: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The indices of the greedy requests, of those sampled at a temperature alone, and of those with
    top-k or top-p: each kind takes its own path."""
    greedy = temperature <= 0
    plain = ~greedy & ~_limits_k(top_k, vocab) & (top_p >= 1)
    g, s, f = (mask.nonzero().squeeze(1) for mask in (greedy, plain, ~greedy & ~plain))
    return g, s, f


def rows_of(logits: Tensor, requests: Tensor) -> Tensor:
    """logits[requests], without the copy when a batch's requests are all of one kind (`requests`
    comes from nonzero: ascending, so all of them is 0..B-1)."""
    return logits if len(requests) == len(logits) else logits[requests]


class Rows(Protocol):
    """What the accept test and the final draw need of a group of requests' K+1 rows."""

    def p_draft(self, drafts: Tensor) -> Tensor:
        """p_i(d_i) [R, K] of the drafts [R, K]."""

    def final(self, a: Tensor, q_a: Callable[[], Tensor], u: Tensor) -> Tensor:
        """The token [R] after a accepted drafts, from row a, q_a() [R, V] and uniforms u [R]."""


@dataclass
class Argmax(Rows):
    """Greedy requests: p is one-hot at each row's argmax [R, K+1]."""

    argmax: Tensor

    def p_draft(self, drafts: Tensor) -> Tensor:
        return (drafts == self.argmax[:, :-1]).float()

    def final(self, a: Tensor, q_a: Callable[[], Tensor], u: Tensor) -> Tensor:
        return self.argmax.gather(1, a[:, None]).squeeze(1)  # the residual of a one-hot p is p or empty


@dataclass
class Probs(Rows):
    """Sampled requests with their K+1 distributions [R, K+1, V]."""

    probs: Tensor

    def p_draft(self, drafts: Tensor) -> Tensor:
        return self.probs[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)

    def final(self, a: Tensor, q_a: Callable[[], Tensor], u: Tensor) -> Tensor:
        return residual_draw(self.probs[torch.arange(len(a), device=a.device), a], q_a(), u)


def verify(
    groups: list[tuple[Tensor, Rows]], drafts: Tensor, draft_probs: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
    """The accept test and the final draw of every request, each group of requests [R] read through its Rows."""
    batch, k = drafts.shape
    p_draft = noise.new_zeros(batch, k)
    for requests, rows in groups:
        p_draft[requests] = rows.p_draft(drafts[requests])
    q_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted, num_accepted = accept_drafts(p_draft, q_draft, noise[:, :k])

    final = torch.empty(batch, dtype=torch.long, device=drafts.device)
    for requests, rows in groups:
        a = num_accepted[requests]
        final[requests] = rows.final(a, partial(_draft_row, draft_probs, requests, a), noise[requests, k])
    return num_accepted, committed_tokens(accepted, drafts, final)


def _draft_row(draft_probs: Tensor, requests: Tensor, a: Tensor) -> Tensor:
    """q_a [R, V] of each request (zeros at a = K), as final_draw pads it."""
    k = draft_probs.shape[1]
    if k == 0:
        return draft_probs.new_zeros(len(requests), draft_probs.shape[-1]).float()
    q = draft_probs[requests, a.clamp(max=k - 1)].float()
    return torch.where((a < k)[:, None], q, 0.0)


def softmax_rows(logits: Tensor, temperature: Tensor) -> Probs:
    """processed_probs without top-k/top-p: its final renormalization is kept, for equal rounding."""
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1)
    return Probs(probs / probs.sum(-1, keepdim=True))


def filtered_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Probs:
    """processed_probs for rows with top-k or top-p, sorting only the tokens that can be kept.

    One pass sorts each row's mass into buckets by probability (a factor of sqrt(2) apart, relative
    to the row's maximum); the candidates are every token down to SPARE_BUCKETS buckets past the one
    where the mass reaches top_p (and the count top_k). A row where the candidates may not decide the
    cut takes the traced definition (a sort of the whole vocabulary)."""
    n, rows, vocab = logits.shape
    probs = torch.softmax(logits / temperature[:, None, None], dim=-1).reshape(n * rows, vocab)
    if not n:
        return Probs(probs.view(n, rows, vocab))
    k, p = top_k.repeat_interleave(rows)[:, None], top_p.repeat_interleave(rows).float()[:, None]
    out, unsure = _filter_candidates(probs, k, p, _candidate_threshold(probs, k, p))
    todo = unsure.nonzero().squeeze(1)
    if len(todo):
        out[todo] = processed_probs(
            logits.reshape(n * rows, vocab)[todo],
            temperature.repeat_interleave(rows)[todo],
            k[todo, 0],
            p[todo, 0],
        )
    return Probs(out.view(n, rows, vocab))


def _candidate_threshold(probs: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Per row [R, 1]: a probability whose tokens at or above it should hold the top-p cut and the top k."""
    top = probs.amax(-1, keepdim=True)
    # Bucket b holds prob/max in (2^-(b+1)/2, 2^-b/2]; the last one everything below.
    steps = (probs / top).log2_().mul_(-2).clamp_(max=BUCKETS - 1).long()
    mass = torch.zeros(len(probs), BUCKETS).scatter_add_(1, steps, probs).cumsum(-1)
    need = torch.where(p < 1, (mass < p * mass[:, -1:]).sum(-1, keepdim=True), 0)
    limits_k = _limits_k(k, probs.shape[-1])
    if limits_k.any():  # top-p is relative to the top-k mass, so with top-k the top k tokens are all it needs
        count = torch.zeros(len(probs), BUCKETS).scatter_add_(1, steps, torch.ones_like(probs)).cumsum(-1)
        need = torch.where(limits_k, (count < k).sum(-1, keepdim=True), need)
    last = (need + SPARE_BUCKETS).clamp_min(0)  # the most likely token is always one
    return torch.where(last >= BUCKETS - 1, 0.0, top * torch.exp2(-(last + 1) / 2))


def _filter_candidates(probs: Tensor, k: Tensor, p: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor]:
    """(processed_probs's rows from the tokens of `probs` [R, V] at or above `threshold` [R, 1],
    rows where those may not decide the cut)."""
    vocab = probs.shape[-1]
    is_candidate = probs >= threshold
    ids, values, count = _padded_candidates(probs, is_candidate)  # ids ascending, padding valued -1
    # In the traced order: probability descending, ties by token id; padding last.
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids, values = ids.gather(-1, order), values.clamp_min(0)
    rank = torch.arange(values.shape[-1])
    limits_k = _limits_k(k, vocab)
    values = values * ((rank < k) | ~limits_k)
    cumulative = values.cumsum(-1)
    # `probs` is spent from here on: its memory takes the tail, then the result.
    tail = probs.masked_fill_(is_candidate, 0.0).sum(-1, keepdim=True) * ~limits_k
    top_p_mass = p * (cumulative[:, -1:] + tail)
    keep = (cumulative - values < top_p_mass) | (rank == 0) | (p >= 1)
    filtered = probs.zero_().scatter_add_(-1, ids, values * keep)  # padding adds 0 to token 0
    # Every other token ranks below the candidates: it is cut by top-k once the candidates hold the top
    # k, else by top-p once the candidates' mass reaches top_p.
    unsure = torch.where(limits_k, k > count, (p < 1) & (cumulative[:, -1:] < top_p_mass))
    return filtered.div_(filtered.sum(-1, keepdim=True)), unsure.squeeze(1)


def _limits_k(k: Tensor, vocab: int) -> Tensor:
    return (k > 0) & (k < vocab)


def _padded_candidates(probs: Tensor, is_candidate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's candidates packed to the front of [R, most candidates in a row]: (token ids in
    ascending order, their probabilities, -1 past the row's last), and the count per row [R, 1]."""
    row, ids = is_candidate.nonzero(as_tuple=True)
    count = torch.bincount(row, minlength=len(probs))[
        :, None
    ]  # not is_candidate.sum(): that copies it to int64 first
    first = (count.cumsum(0) - count).squeeze(1)
    position = torch.arange(len(ids)) - first[row]
    width = int(count.max())
    padded_ids = torch.zeros(len(probs), width, dtype=torch.long)
    padded_values = torch.full((len(probs), width), -1.0)
    padded_ids[row, position] = ids
    padded_values[row, position] = probs[row, ids]
    return padded_ids, padded_values, count
