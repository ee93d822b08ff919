"""The step functions the engine captures: prefill, draft_decode, target_verify, draft_extend.

Each is a function of (model, static state, a few small step tensors) with shapes fixed by its key
(kind, B, K). They follow compiled_mtp.reference exactly, batched: B requests, each in its own cache
slot, with sampling (greedy rows included) and rejection sampling inside the graph. Positions are
0-based; `seq_lens` counts committed tokens, so the last committed token sits at seq_lens - 1 and
both caches hold positions up to seq_lens - 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.deepseek_v3 import DeepseekV3
from .metadata import block_positions, cache_rows, gather_rows
from .sampling import draft_sample, processed_probs, sample_from_probs, verify_sample
from .state import StaticState


def _params(state: StaticState, slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return state.temperature[slots], state.top_k[slots], state.top_p[slots]


def _rows(state: StaticState, slots: Tensor, positions: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return cache_rows(slots, positions, state.max_seq_len, state.scratch_slot, valid)


def _store_draft(state: StaticState, slots: Tensor, depth: int, token: Tensor, probs: Tensor) -> None:
    state.drafts[slots, depth] = token
    state.draft_probs[slots, depth] = probs


def prefill(model: DeepseekV3, state: StaticState, tokens: Tensor, next_tokens: Tensor, slot: Tensor, start: Tensor, prompt_len: Tensor, noise: Tensor) -> Tensor:
    """One fixed-size chunk of one prompt: tokens [1, C] at positions start.., next_tokens [1, C] the
    prompt shifted by one (for M). In the chunk holding the prompt's last token, samples t_n (returned)
    and, with MTP, drafts d_1. noise [1, 2]: the uniform for t_n, the one for d_1."""
    positions = block_positions(start, tokens.shape[1])
    positions, write = _rows(state, slot, positions, positions < prompt_len[:, None])
    h = model.forward_target(tokens, positions, write, slot, state.target_cache)
    last_row = (prompt_len - 1 - start).clamp(0, tokens.shape[1] - 1)
    temperature, top_k, top_p = _params(state, slot)
    probs = processed_probs(model.logits(gather_rows(h, last_row)), temperature, top_k, top_p)
    first = sample_from_probs(probs, noise[:, 0])
    state.last_token[slot] = first
    if state.mtp_cache.shape[0]:
        m_tokens = torch.where(positions == prompt_len[:, None] - 1, first[:, None], next_tokens)
        m = model.forward_mtp(0, m_tokens, h, positions, write, slot, state.mtp_cache)
        _draft_from(model, state, slot, gather_rows(m, last_row), noise[:, 1])
    return first


def _draft_from(model: DeepseekV3, state: StaticState, slots: Tensor, hidden: Tensor, u: Tensor) -> None:
    """d_1 and q_1 from M's hidden at the last committed position; remembered for draft_decode."""
    token, probs = draft_sample(model.logits(hidden), *_params(state, slots), u)
    _store_draft(state, slots, 0, token, probs)
    state.mtp_hidden[slots] = hidden


def draft_decode(model: DeepseekV3, state: StaticState, slots: Tensor, seq_lens: Tensor, noise: Tensor) -> None:
    """Drafts d_2..d_K (K - 1 = noise.shape[1] steps): depth j runs MTP layer j % layers at position
    seq_len - 2 + j on d_j and M's own previous hidden."""
    hidden, token = state.mtp_hidden[slots], state.drafts[slots, 0]
    params = _params(state, slots)
    for j in range(1, noise.shape[1] + 1):
        positions, write = _rows(state, slots, (seq_lens - 2 + j)[:, None])
        layer = j % model.num_mtp_layers
        hidden = model.forward_mtp(layer, token[:, None], hidden[:, None], positions, write, slots, state.mtp_cache)[:, 0]
        token, probs = draft_sample(model.logits(hidden), *params, noise[:, j - 1])
        _store_draft(state, slots, j, token, probs)


def target_verify(model: DeepseekV3, state: StaticState, slots: Tensor, seq_lens: Tensor, noise: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """T over [t_{L-1}, d_1..d_K] (K = noise.shape[1] - 1) and rejection sampling in the same graph.
    Returns accepted counts [B], committed tokens [B, K + 1] (d_1..d_a, then the bonus/correction
    token, repeated as filler) and T's hiddens [B, K + 1, H] for draft_extend."""
    k = noise.shape[1] - 1
    drafts = state.drafts[slots, :k]
    tokens = torch.cat([state.last_token[slots][:, None], drafts], dim=1)
    positions, write = _rows(state, slots, block_positions(seq_lens - 1, k + 1))
    h = model.forward_target(tokens, positions, write, slots, state.target_cache)
    accepted, committed = verify_sample(model.logits(h), *_params(state, slots), drafts, state.draft_probs[slots, :k], noise)
    state.last_token[slots] = committed.gather(1, accepted[:, None])[:, 0]
    return accepted, committed, h


def draft_extend(model: DeepseekV3, state: StaticState, slots: Tensor, seq_lens: Tensor, accepted: Tensor, committed: Tensor, hidden: Tensor, noise: Tensor) -> None:
    """M over the verify block's K + 1 positions with T's hiddens and the committed tokens: rewrites
    M's cache there (rows past `accepted` carry filler, overwritten later) and drafts the next d_1
    from row `accepted`. seq_lens are the lengths before the verify; noise [B, 1]."""
    positions, write = _rows(state, slots, block_positions(seq_lens - 1, committed.shape[1]))
    m = model.forward_mtp(0, committed, hidden, positions, write, slots, state.mtp_cache)
    _draft_from(model, state, slots, gather_rows(m, accepted), noise[:, 0])
