"""The step functions the engine captures: prefill, draft_decode, target_verify, draft_extend, and the
MTP layer's catch-up after depth-0 steps (mtp_catch_up, mtp_fill).

Each is a function of (model, static state, a few small step tensors) with shapes fixed by its key
(kind, B, K). They follow compiled_mtp.reference exactly, batched: B requests, each in its own cache
slot, with sampling (greedy rows included) and rejection sampling inside the graph. Positions are
0-based; `seq_lens` counts committed tokens, so the last committed token sits at seq_lens - 1 and
both caches hold positions up to seq_lens - 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.family import CausalLM
from ..models.layers import gather_rows
from .metadata import block_positions, cache_rows
from .sampling import draft_sample, processed_probs, sample_from_probs, verify_sample
from .state import StaticState


def _params(state: StaticState, slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return state.temperature[slots], state.top_k[slots], state.top_p[slots]


def _rows(
    state: StaticState, slots: Tensor, positions: Tensor, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return cache_rows(slots, positions, state.max_seq_len, state.scratch_slot, valid)


def _store_draft(
    state: StaticState, slots: Tensor, depth: int, token: Tensor, probs: Tensor, keep: Tensor | None
) -> None:
    # A depth index per row, so that the writes index the whole buffers: written through the view
    # `[:, depth]`, a compiled graph copied every slot's row at that depth, the whole vocabulary's q,
    # out and back at every draft.
    at = torch.full_like(slots, depth)
    if keep is not None:  # those rows' drafts stay as they are
        token = torch.where(keep, state.drafts[slots, at], token)
        probs = torch.where(keep[:, None], state.draft_probs[slots, at], probs)
    state.drafts[slots, at] = token
    state.draft_probs[slots, at] = probs


def prefill(
    model: CausalLM,
    state: StaticState,
    tokens: Tensor,
    next_tokens: Tensor,
    slot: Tensor,
    start: Tensor,
    prompt_len: Tensor,
    noise: Tensor,
) -> Tensor:
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
        m = model.forward_mtp(0, m_tokens, h, positions, write, slot, state.mtp_cache, last_row)
        _draft_from(model, state, slot, m, noise[:, 1])
    return first


def _draft(
    model: CausalLM,
    state: StaticState,
    slots: Tensor,
    hidden: Tensor,
    u: Tensor,
    depth: int,
    keep: Tensor | None = None,
) -> Tensor:
    """Draft d_{depth + 1} from M's hidden, remember it with q (but in `keep`'s rows) and return it. A
    restricted draft vocabulary samples among its tokens; q, over the whole vocabulary, is 0 elsewhere,
    so verification stays exact."""
    token, probs = draft_sample(model.draft_logits(hidden), *_params(state, slots), u)
    if model.draft_ids is not None:
        token = model.draft_ids[token]
        probs = probs.new_zeros(probs.shape[0], state.draft_probs.shape[-1]).index_copy(
            1, model.draft_ids, probs
        )
    _store_draft(state, slots, depth, token, probs, keep)
    return token


def _draft_from(model: CausalLM, state: StaticState, slots: Tensor, hidden: Tensor, u: Tensor) -> Tensor:
    """d_1 and q_1 from M's hidden at the last committed position; remembered for draft_decode. Returns
    d_1."""
    state.mtp_hidden[slots] = hidden
    return _draft(model, state, slots, hidden, u, 0)


def _draft_on(
    model: CausalLM,
    state: StaticState,
    slots: Tensor,
    seq_lens: Tensor,
    hidden: Tensor,
    token: Tensor,
    noise: Tensor,
    keep: Tensor | None = None,
) -> None:
    """d_2..d_K from d_1 and M's hidden that drafted it (K - 1 = noise.shape[1] steps): depth j runs MTP
    layer j % layers at position seq_len - 2 + j on d_j and M's own previous hidden. `keep`'s rows
    write neither drafts nor M's cache."""
    for j in range(1, noise.shape[1] + 1):
        valid = None if keep is None else ~keep[:, None]
        positions, write = _rows(state, slots, (seq_lens - 2 + j)[:, None], valid)
        layer = j % model.num_mtp_layers
        hidden = model.forward_mtp(
            layer, token[:, None], hidden[:, None], positions, write, slots, state.mtp_cache
        )[:, 0]
        token = _draft(model, state, slots, hidden, noise[:, j - 1], j, keep)


def draft_decode(
    model: CausalLM, state: StaticState, slots: Tensor, seq_lens: Tensor, drafted: Tensor, noise: Tensor
) -> None:
    """Drafts d_2..d_K (K - 1 = noise.shape[1]) from the d_1 and hidden in the state, for the rows whose
    last step drafted fewer (drafted [B]: how many of d_1..d_K are current); the others keep theirs,
    so a request's drafts do not depend on which others share its step."""
    keep = drafted >= noise.shape[1] + 1
    token = state.drafts[slots, 0]
    _draft_on(model, state, slots, seq_lens, state.mtp_hidden[slots], token, noise, keep)


def target_verify(
    model: CausalLM, state: StaticState, slots: Tensor, seq_lens: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """T over [t_{L-1}, d_1..d_K] (K = noise.shape[1] - 1) and rejection sampling in the same graph.
    Returns accepted counts [B], committed tokens [B, K + 1] (d_1..d_a, then the bonus/correction
    token, repeated as filler) and T's hiddens [B, K + 1, H] for draft_extend."""
    k = noise.shape[1] - 1
    drafts = state.drafts[slots, :k]
    tokens = torch.cat([state.last_token[slots][:, None], drafts], dim=1)
    positions, write = _rows(state, slots, block_positions(seq_lens - 1, k + 1))
    h = model.forward_target(tokens, positions, write, slots, state.target_cache)
    if k == 0 and state.lag_hidden.shape[1]:
        # M skips depth-0 steps; mtp_fill or mtp_catch_up runs it later over the hiddens kept here.
        state.lag_hidden[slots, (seq_lens - 1) % state.lag_hidden.shape[1]] = h[:, 0]
    accepted, committed = verify_sample(
        model.logits(h), *_params(state, slots), drafts, state.draft_probs[slots, :k], noise
    )
    state.last_token[slots] = committed.gather(1, accepted[:, None])[:, 0]
    return accepted, committed, h


def draft_extend(
    model: CausalLM,
    state: StaticState,
    slots: Tensor,
    seq_lens: Tensor,
    accepted: Tensor,
    committed: Tensor,
    hidden: Tensor,
    noise: Tensor,
) -> None:
    """M over the verify block's K + 1 positions with T's hiddens and the committed tokens: rewrites
    M's cache there (rows past `accepted` carry filler, overwritten later) and drafts the next d_1
    from row `accepted`, then d_2..d_K as the next step's draft_decode would: a step at the same depth
    runs two graphs, not three. seq_lens are the lengths before the verify; noise [B, K]."""
    positions, write = _rows(state, slots, block_positions(seq_lens - 1, committed.shape[1]))
    m = model.forward_mtp(0, committed, hidden, positions, write, slots, state.mtp_cache, accepted)
    token = _draft_from(model, state, slots, m, noise[:, 0])
    _draft_on(model, state, slots, seq_lens + accepted + 1, m, token, noise[:, 1:])


def _lag_block(
    state: StaticState, slots: Tensor, seq_lens: Tensor, lags: Tensor, w: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Positions, cache write rows and T's hiddens of the W positions before seq_len - 1, of which only each
    request's last `lags` run (the other rows write nowhere)."""
    positions = block_positions(seq_lens - 1 - w, w)
    behind = positions >= (seq_lens - 1 - lags)[:, None]
    positions, write = _rows(state, slots, positions.clamp(min=0), behind)
    return positions, write, state.lag_hidden[slots[:, None], positions % w]


def mtp_catch_up(
    model: CausalLM,
    state: StaticState,
    slots: Tensor,
    seq_lens: Tensor,
    lags: Tensor,
    tokens: Tensor,
    noise: Tensor,
) -> None:
    """M over the positions depth-0 steps left it behind on, then d_1 from the last one. The block is
    the W = tokens.shape[1] positions before seq_len - 1; only each request's last `lags` of them run
    (T's hiddens kept by target_verify at K=0), the other rows write nowhere. tokens [B, W]: the
    committed token one past each position. A request with lag 0 keeps its hidden and redraws d_1
    from it. noise [B, 1]."""
    w = tokens.shape[1]
    positions, write, hidden = _lag_block(state, slots, seq_lens, lags, w)
    last_row = torch.full_like(lags, w - 1)
    m = model.forward_mtp(0, tokens, hidden, positions, write, slots, state.mtp_cache, last_row)
    last = torch.where((lags > 0)[:, None], m, state.mtp_hidden[slots])
    _draft_from(model, state, slots, last, noise[:, 0])


def mtp_fill(
    model: CausalLM, state: StaticState, slots: Tensor, seq_lens: Tensor, lags: Tensor, tokens: Tensor
) -> None:
    """mtp_catch_up's cache writes alone, for a batch that stays at depth 0 once a lag fills the window:
    no draft is wanted, so of M's layer only what its cache entries need runs. M's hidden stays as it
    was: the step that follows leaves every request lagging again, so a catch-up computes it afresh
    before any draft."""
    positions, write, hidden = _lag_block(state, slots, seq_lens, lags, tokens.shape[1])
    model.write_mtp_entries(0, tokens, hidden, positions, write, slots, state.mtp_cache)
