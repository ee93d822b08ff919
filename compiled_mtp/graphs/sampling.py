"""Sampling inside captured graphs: temperature / top-k / top-p, inverse-CDF draws, and
speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Every function is static-shape and branch-free on tensor values so it traces under
``torch.compile(fullgraph=True, dynamic=False)``, and works row by row: a row's result depends
only on that row's inputs. Nothing here draws random numbers; callers pass uniforms in [0, 1)
from per-request generators, so a request's tokens do not depend on its batch.
"""

import torch
from torch import Tensor


def processed_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The sampling distribution of each row of ``logits`` [..., V], as float32 [..., V].

    ``temperature``, ``top_k`` and ``top_p`` have the shape ``logits.shape[:-1]``. Rows with
    temperature <= 0 are greedy: one-hot at ``argmax`` (ties to the lowest index). Other rows are
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (0 or >= V: no
    limit), then to the smallest prefix of those whose share of the top-k mass reaches ``top_p``
    (the most likely token always stays; top_p >= 1 keeps all), renormalized. Equal
    probabilities at a cut are ordered by token id, lowest kept first.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy_rows = (temperature <= 0).unsqueeze(-1)
    one_hot = torch.zeros_like(logits).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)

    # Greedy rows still run the sampled branch; a unit temperature keeps it finite there.
    safe_temperature = torch.where(greedy_rows, 1.0, temperature.unsqueeze(-1).float())
    probs = torch.softmax(logits / safe_temperature, dim=-1)
    # Stable, so ties at a cut resolve by token id and the result is deterministic.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = top_k.unsqueeze(-1)
    in_top_k = (rank < k) | (k <= 0)
    sorted_probs = sorted_probs * in_top_k
    cumulative = sorted_probs.cumsum(-1)
    # Top-p is relative to the top-k distribution (as in HF and vLLM): a token stays while the
    # mass ranked strictly above it is short of top_p. Rank 0 and top_p >= 1 stay explicitly, so
    # rounding in the cumulative sum can never drop them.
    mass_above = cumulative - sorted_probs
    p = top_p.unsqueeze(-1).float()
    keep = (mass_above < p * cumulative[..., -1:]) | (rank == 0) | (p >= 1)
    kept_sorted = sorted_probs * keep
    kept = torch.zeros_like(probs).scatter(-1, order, kept_sorted)
    sampled = kept / kept.sum(-1, keepdim=True)
    return torch.where(greedy_rows, one_hot, sampled)


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw from each row of ``probs`` [..., V] (unnormalized is fine) with one
    uniform ``u`` [...] in [0, 1): the smallest index whose cumulative mass exceeds u * total.

    The strict '>' never lands on a zero-probability token, and a one-hot row returns its hot
    index for every u. Returns int64 [...].
    """
    probs = probs.float()
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    threshold = u.unsqueeze(-1).float() * cdf[..., -1:]
    # cdf is non-decreasing (rounding is monotone), so counting entries <= threshold is the index.
    index = (cdf <= threshold).sum(-1)
    # When u * total rounds up to total the count runs past the last positive token; cap it
    # there (this also keeps the index below V).
    rank = torch.arange(vocab, device=probs.device)
    last_positive = torch.where(probs > 0, rank, 0).amax(-1)
    return torch.minimum(index, last_positive)


def draft_sample(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor
) -> tuple[Tensor, Tensor]:
    """One draft token per row of ``logits`` [B, V] and the draft distribution q it came from.

    Returns (tokens int64 [B], q float32 [B, V]); greedy rows give argmax and a one-hot q,
    which is what ``rejection_sample`` expects from greedy drafts.
    """
    q = processed_probs(logits, temperature, top_k, top_p)
    return sample_from_probs(q, u), q


def rejection_sample(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    u_accept: Tensor,
    u_final: Tensor,
) -> tuple[Tensor, Tensor]:
    """Verify K drafts per row against the target and emit the committed tokens.

    ``target_probs`` [B, K+1, V] are p_0..p_K, ``draft_tokens`` [B, K] the drafts d_1..d_K
    sampled from ``draft_probs`` [B, K, V] (q), ``u_accept`` [B, K] and ``u_final`` [B]
    uniforms in [0, 1). Draft i is accepted iff u_accept * q_i(d_i) < p_i(d_i), i.e. with
    probability min(1, p/q); with one-hot p and q that is exactly d_i == argmax p_i.

    Returns (num_accepted a int64 [B] in [0, K], tokens int64 [B, K+1]): tokens[:, :a] are the
    accepted drafts and tokens[:, a:] all hold the final token, drawn with u_final from
    normalize(max(p_a - q_a, 0)) after a rejection or from p_K when every draft is accepted
    (from p_a if that residual is empty, which a rejection cannot produce).
    """
    drafts = draft_tokens.unsqueeze(-1)
    p_draft = target_probs[:, :-1].gather(-1, drafts).squeeze(-1)
    q_draft = draft_probs.gather(-1, drafts).squeeze(-1)
    accepted, num_accepted = accept_drafts(p_draft, q_draft, u_accept)
    final = final_draw(target_probs, draft_probs, num_accepted, u_final)
    return num_accepted, committed_tokens(accepted, draft_tokens, final)


def accept_drafts(p_draft: Tensor, q_draft: Tensor, u_accept: Tensor) -> tuple[Tensor, Tensor]:
    """The accept test per draft, p and q at the drafts [B, K]: (accepted 0/1 [B, K], a [B])."""
    accepted = (u_accept * q_draft < p_draft).long()
    return accepted, accepted.cumprod(-1).sum(-1)


def final_draw(target_probs: Tensor, draft_probs: Tensor, num_accepted: Tensor, u_final: Tensor) -> Tensor:
    """The token after the accepted drafts: from normalize(max(p_a - q_a, 0)), from p_a if that is empty."""
    batch, _, vocab = target_probs.shape
    # q_K = 0 makes the residual at the bonus position p_K itself, so one formula covers both.
    q = draft_probs.float()
    q_padded = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)
    row = num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)
    p_final = target_probs.float().gather(1, row).squeeze(1)
    q_final = q_padded.gather(1, row).squeeze(1)
    return residual_draw(p_final, q_final, u_final)


def residual_draw(p_final: Tensor, q_final: Tensor, u_final: Tensor) -> Tensor:
    """A token from normalize(max(p - q, 0)) per row of p_a and q_a [B, V] (q_K is zeros), from p if that is empty."""
    residual = (p_final - q_final).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_final)
    return sample_from_probs(residual, u_final)


def committed_tokens(accepted: Tensor, draft_tokens: Tensor, final: Tensor) -> Tensor:
    """[B, K+1]: the drafts up to the first rejection, then `final` [B] in every later position.

    Built from the accept prefix, not an arange, so the verify sampling shares no node with the rest
    of the verify graph and the fusion pass can replace it whole."""
    final = final.unsqueeze(-1)
    kept = torch.where(accepted.cumprod(-1) > 0, draft_tokens, final)
    return torch.cat([kept, final], dim=1)


def verify_sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """The sampling half of target_verify: the target distributions p_0..p_K of the K+1 rows of
    ``logits`` [B, K+1, V] under each request's parameters ([B] each), then ``rejection_sample``
    with the uniforms ``noise`` [B, K+1] (K accept tests, then the final draw).

    The fusion pass (compiled_mtp/passes/fuse_verify_sampling.py) matches exactly this subgraph and
    replaces it with one fused operation."""
    probs = processed_probs(logits, temperature[:, None], top_k[:, None], top_p[:, None])
    k = draft_tokens.shape[1]
    return rejection_sample(probs, draft_tokens, draft_probs, noise[:, :k], noise[:, k])
