"""The eager reference loop: MTP speculative decoding, greedy, one request at a time.

This is the ground truth the compiled graphs are tested against, and the plainest statement of the
algorithm (docs/design.md, "The decode loop as graphs"). Positions are 0-based; the prompt is t_0..t_{n-1}.
Target row at position i reads t_i and yields hidden h_i, whose logits predict t_{i+1}.
MTP row at position i reads t_{i+1} and a hidden for position i, and predicts t_{i+2}.
Between steps, with L committed tokens, both caches hold positions 0..L-2 and the last committed
token t_{L-1} has not been through the target yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .models.family import CausalLM


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # accepted drafts at each verify step


class _Request:
    """One request's caches, sized for the whole generation, in slot 0."""

    def __init__(self, model: CausalLM, capacity: int, mtp: bool) -> None:
        self.model = model
        self.device = model.lm_head.weight.device
        self.slot = torch.tensor([0], device=self.device)
        self.target_cache = model.new_cache(model.cfg.num_hidden_layers, 1, capacity)
        self.mtp_cache = model.new_cache(model.num_mtp_layers, 1, capacity) if mtp else None

    def target(self, tokens: list[int], start: int) -> Tensor:
        pos = self._positions(len(tokens), start)
        return self.model.forward_target(self._ids(tokens), pos, pos, self.slot, self.target_cache)[0]

    def mtp(self, depth: int, tokens: list[int], hidden: Tensor, start: int) -> Tensor:
        pos = self._positions(len(tokens), start)
        layer = depth % self.model.num_mtp_layers
        assert self.mtp_cache is not None, "a request made with mtp=False drafts nothing"
        return self.model.forward_mtp(
            layer, self._ids(tokens), hidden[None], pos, pos, self.slot, self.mtp_cache
        )[0]

    def greedy(self, hidden: Tensor) -> Tensor:
        return self.model.logits(hidden).argmax(-1)

    def draft(self, hidden: Tensor) -> Tensor:
        """M's greedy draft from its hidden (its own logits: V4's MTP layer has its own hc_head)."""
        best = self.model.draft_logits(hidden).argmax(-1)
        return best if self.model.draft_ids is None else self.model.draft_ids[best]

    def _ids(self, tokens: list[int]) -> Tensor:
        return torch.tensor([tokens], device=self.device)

    def _positions(self, n: int, start: int) -> Tensor:
        return torch.arange(start, start + n, device=self.device)[None]


@torch.no_grad()
def reference_generate(
    model: CausalLM, prompts: list[list[int]], max_new_tokens: int, mtp_depth: int
) -> list[ReferenceOutput]:
    """Greedy speculative decoding with K = mtp_depth drafts per step (0 = plain decoding)."""
    return [_generate_one(model, p, max_new_tokens, mtp_depth) for p in prompts]


def _generate_one(model: CausalLM, prompt: list[int], max_new_tokens: int, k: int) -> ReferenceOutput:
    req = _Request(model, len(prompt) + max_new_tokens + k + 1, mtp=k > 0)
    out = ReferenceOutput([])

    # 1. prefill: T over the prompt gives t_n; M over positions 0..n-1 (tokens t_1..t_n) drafts d_1.
    h = req.target(prompt, 0)
    seq = list(prompt) + [int(req.greedy(h[-1]))]
    if k:
        m = req.mtp(0, seq[1:], h, 0)
        draft, m_hidden = int(req.draft(m[-1])), m[-1]

    while len(seq) - len(prompt) < max_new_tokens:
        n = len(seq)
        if k == 0:
            seq.append(int(req.greedy(req.target([seq[-1]], n - 1)[-1])))
            continue
        # 2. draft_decode: depth j runs M at position n-2+j on d_j and M's own previous hidden.
        drafts = [draft]
        for j in range(1, k):
            m_hidden = req.mtp(j, [drafts[-1]], m_hidden[None], n - 2 + j)[-1]
            drafts.append(int(req.draft(m_hidden)))
        # 3. target_verify: T over [t_{n-1}, d_1..d_K] at positions n-1..n-1+K; accept the matching prefix.
        h = req.target([seq[-1]] + drafts, n - 1)
        best = req.greedy(h).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        committed = drafts[:a] + [best[a]]
        seq += committed
        out.accepted.append(a)
        # 4. draft_extend: M over the same K+1 positions with T's hiddens and the committed tokens
        # rewrites M's cache there; rows past `a` carry filler and are overwritten later.
        rows = committed + [committed[-1]] * (k - a)
        m = req.mtp(0, rows, h, n - 1)
        draft, m_hidden = int(req.draft(m[a])), m[a]

    out.token_ids = seq[len(prompt) : len(prompt) + max_new_tokens]
    return out
