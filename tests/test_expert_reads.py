"""The routed experts a step's rows read together (expert_reads.py), which the bench's bound counts."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from compiled_mtp import expert_reads
from compiled_mtp.models.checkpoint import load_model


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int]:
    """Choices of k of E experts at every position of equal-length prompts, a batch and a window."""
    experts = draw(st.integers(2, 16))
    k = draw(st.integers(1, experts))
    prompts, positions = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    gen = random.Random(draw(st.integers(0, 2**32 - 1)))
    idx = [[gen.sample(range(experts), k) for _ in range(positions)] for _ in range(prompts)]
    chosen = torch.stack([expert_reads.one_hot(torch.tensor(p), experts) for p in idx])
    return chosen, k, draw(st.integers(1, prompts)), draw(st.integers(1, positions))


@given(routings())
def test_experts_read_is_the_mean_union_of_aligned_windows_of_batches_in_order(drawn):
    chosen, k, batch, rows = drawn
    prompts, positions, experts = chosen.shape
    ids = [[set(chosen[p, t].nonzero().flatten().tolist()) for t in range(positions)] for p in range(prompts)]
    unions = [
        len(set().union(*(ids[p][t] for p in range(g, g + batch) for t in range(start, start + rows))))
        for g in range(0, prompts - batch + 1, batch)
        for start in range(positions - rows + 1)
    ]
    read = expert_reads.experts_read(chosen, batch, rows)
    assert abs(read - sum(unions) / len(unions)) < 1e-5
    assert k - 1e-5 <= read <= min(experts, k * batch * rows) + 1e-5
    assert expert_reads.experts_read(chosen, 1, 1) == k  # one row reads its own k


def test_record_takes_every_moe_layer_and_chains_the_draft_depths(echo_checkpoint):
    """On the echo checkpoint (attention off, MTP layer = target layer 0 on the next token's
    embedding) draft depth j's row i reads the token at position i + j + 1 through the same layer, so
    it must choose the target's experts at that position: the depths are aligned as the loop runs
    them."""
    model = load_model(echo_checkpoint)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, model.cfg.vocab_size, (3, 10), generator=gen).tolist()
    routing = expert_reads.record(model, prompts, 3)
    (target,) = routing.target  # one MoE layer
    assert target.chosen.shape == (3, 10, 8) and bool((target.chosen.sum(-1) == 2).all())
    for j, depth in enumerate(routing.drafts):
        assert depth is not None and depth.chosen.shape == (3, 10 - 1 - j, 8)
        assert torch.equal(depth.chosen, target.chosen[:, j + 1 :])
