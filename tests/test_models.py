"""The static-shape DeepSeek-V3 model against HF transformers, on hypothesis-drawn tiny configs, and the
MTP layer's one-row-per-request forward and its cache entries alone against its whole-block forward
(DeepSeek-V3, GLM-4 MoE and DeepSeek-V4)."""

from __future__ import annotations

import tempfile
from collections import Counter

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from compiled_mtp.graphs.metadata import cache_rows
from compiled_mtp.hf_baseline import load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.layers import gather_rows
from compiled_mtp.models.registry import family_of
from tests.checkpoints import randomize_, write_checkpoint
from tests.glm_factory import glm_config_strategy
from tests.oracle import hf_logits, hf_mtp_draft_logits
from tests.strategies import FULL_FEATURED_CONFIGS, config_strategy
from tests.v4_factory import v4_config_strategy

# fp32 on tiny models: both sides differ only in summation order (absorbed vs expanded MLA,
# gathered vs looped experts); observed differences are ~1e-6.
ATOL = RTOL = 1e-4


def engine_logits(model, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """Target logits [T, V], fed in chunks of `chunk` rows through the cache (all at once if None)."""
    n = len(tokens)
    chunk = chunk or n
    cache = model.new_cache(model.cfg.num_hidden_layers, 2, n + 1)
    slot = torch.tensor([1])  # not slot 0, so a slot-indexing slip shows
    out = []
    for start in range(0, n, chunk):
        pos = torch.arange(start, min(start + chunk, n))[None]
        ids = torch.tensor([tokens[start : start + chunk]])
        out.append(model.logits(model.forward_target(ids, pos, pos + (n + 1), slot, cache))[0])
    return torch.cat(out)


def engine_mtp_logits(model, tokens: list[int]) -> torch.Tensor:
    """Depth-1 MTP logits [T-1, V]: row i takes tokens[i+1] and T's hidden at position i."""
    n = len(tokens)
    cache = model.new_cache(model.cfg.num_hidden_layers, 1, n)
    pos = torch.arange(n)[None]
    slot = torch.tensor([0])
    hidden = model.forward_target(torch.tensor([tokens]), pos, pos, slot, cache)
    mtp_cache = model.new_cache(model.num_mtp_layers, 1, n)
    m = model.forward_mtp(
        0, torch.tensor([tokens[1:]]), hidden[:, :-1], pos[:, :-1], pos[:, :-1], slot, mtp_cache
    )
    return model.logits(m)[0]


@settings(max_examples=12)
@given(config_strategy())
@example(FULL_FEATURED_CONFIGS[0])
@example(FULL_FEATURED_CONFIGS[1])
@torch.no_grad()
def test_target_and_mtp_logits_match_hf(config):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, config, seed=3)
        hf, ours = load_hf(path), load_model(path)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(config.vocab_size, (11,), generator=gen).tolist()
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(engine_logits(ours, tokens), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(engine_logits(ours, tokens, chunk=3), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(
            engine_mtp_logits(ours, tokens), hf_mtp_draft_logits(hf, tokens), atol=ATOL, rtol=RTOL
        )


@torch.no_grad()
def test_moe_gathered_and_masked_experts_agree(tiny_checkpoint):
    """Rows that gather their experts' weights and rows that run every expert masked: same result."""
    model = load_model(tiny_checkpoint)
    moe = model.model.layers[1].mlp
    x = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    idx, weights = moe.gate(x)
    torch.testing.assert_close(
        moe.experts.gathered(x, idx, weights), moe.experts.masked(x, idx, weights), atol=1e-5, rtol=1e-5
    )


@st.composite
def mtp_blocks(draw: st.DrawFn) -> dict:
    """A tiny DeepSeek-V3, GLM-4 MoE or DeepSeek-V4 config and an MTP block on it: B requests of T rows
    in distinct slots at drawn positions, some rows writing only the scratch slot (as a prefill chunk's
    padding or a catch-up's rows that are not behind do), and one drawn row per request."""
    config = draw(st.one_of(config_strategy(), glm_config_strategy(), v4_config_strategy()))
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    return dict(
        config=config,
        seed=draw(st.integers(0, 2**16)),
        slots=draw(st.permutations(range(batch))),
        starts=draw(st.lists(st.integers(0, 10), min_size=batch, max_size=batch)),
        writes=draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)),
        rows=draw(st.lists(st.integers(0, length - 1), min_size=batch, max_size=batch)),
        length=length,
    )


CAPACITY = 16  # an MTP block's cache positions


def mtp_block_inputs(block: dict) -> tuple:
    """A drawn MTP block's model (random weights) and step tensors: the generator that drew them,
    slots, positions, cache write rows, tokens and hiddens."""
    raw = block["config"].to_dict()
    family = family_of(raw)
    model = family.model(family.config.from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(block["seed"])
    randomize_(model, gen)
    batch, length = len(block["slots"]), block["length"]
    slots = torch.tensor(block["slots"])
    positions = torch.tensor(block["starts"])[:, None] + torch.arange(length)
    valid = torch.tensor(block["writes"]).view(batch, length)
    positions, write = cache_rows(slots, positions, CAPACITY, batch, valid)
    tokens = torch.randint(model.cfg.vocab_size, (batch, length), generator=gen)
    hidden = torch.randn(batch, length, model.hidden_width, generator=gen)
    return model, gen, slots, positions, write, tokens, hidden


@given(mtp_blocks())
@torch.no_grad()
def test_mtp_rows_equal_the_whole_block_and_write_the_same_cache(block):
    """forward_mtp with rows: every row's cache entry, bit for bit as forward_mtp writes it, and the drawn
    rows' hiddens as forward_mtp's (fp32: the one-row products may sum in another order).
    write_mtp_entries: the same cache entries, bit for bit."""
    model, gen, slots, positions, write, tokens, hidden = mtp_block_inputs(block)
    rows = torch.tensor(block["rows"])
    # Earlier positions hold entries already, so the rows attend over more than their own block.
    cache = torch.randn(
        model.num_mtp_layers, len(slots) + 1, CAPACITY, model.cache_layout.width, generator=gen
    )
    whole_cache, rows_cache, entries_cache = cache.clone(), cache.clone(), cache.clone()
    whole = model.forward_mtp(0, tokens, hidden, positions, write, slots, whole_cache)
    got = model.forward_mtp(0, tokens, hidden, positions, write, slots, rows_cache, rows)
    torch.testing.assert_close(got, gather_rows(whole, rows), atol=ATOL, rtol=RTOL)
    assert torch.equal(rows_cache, whole_cache)
    model.write_mtp_entries(0, tokens, hidden, positions, write, slots, entries_cache)
    assert torch.equal(entries_cache, whole_cache) and not torch.equal(entries_cache, cache)


@given(mtp_blocks())
@settings(max_examples=20, deadline=None)
@torch.no_grad()
def test_only_the_every_row_modules_run_on_every_row_of_a_block(block):
    """mtp_every_row_modules, which the bench's bound counts on every row of a draft extend: with `rows`,
    each matrix-holding module of the MTP layer within them sees T times the rows of a block of T as of
    a block of 1, and every other one the same rows (one a request)."""
    model, _, slots, positions, write, tokens, hidden = mtp_block_inputs(block)
    length = block["length"]
    every_row = {id(m) for part in model.mtp_every_row_modules(0) for m in part.modules()}
    multiplying = [
        m for m in model.mtp_layer(0).modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))
    ]

    def rows_seen(t: int) -> Counter[int]:
        """Rows each multiplying module is called on in forward_mtp with `rows` over the first t positions."""
        seen: Counter[int] = Counter()
        hooks = [
            m.register_forward_pre_hook(
                lambda m, args: seen.update({id(m): args[0].numel() // args[0].shape[-1]})
            )
            for m in multiplying
        ]
        try:
            cache = torch.zeros(model.num_mtp_layers, len(slots) + 1, CAPACITY, model.cache_layout.width)
            rows = torch.tensor(block["rows"]).clamp(max=t - 1)
            model.forward_mtp(
                0, tokens[:, :t], hidden[:, :t], positions[:, :t], write[:, :t], slots, cache, rows
            )
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    whole, single = rows_seen(length), rows_seen(1)
    called = [m for m in multiplying if whole[id(m)]]
    assert called and any(id(m) in every_row for m in called)
    for m in called:
        assert whole[id(m)] == (length if id(m) in every_row else 1) * single[id(m)], type(m).__name__


def test_a_context_at_rows_keeps_every_field_and_gathers_the_rows(tiny_checkpoint):
    """Context.at lists the fields it copies (Dynamo before torch 2.13 traces no copy.copy): a field
    added to Context but not to that list would be missing from the MTP layer's one-row attention."""
    model = load_model(tiny_checkpoint)
    positions = torch.tensor([[0, 1, 2], [3, 4, 5]])
    cache = model.new_cache(1, 3, 8)
    ctx = model.context(positions, torch.tensor([0, 1, 2, 11, 12, 13]), torch.tensor([0, 1]), cache)
    row = ctx.at(torch.tensor([2, 0]))
    assert type(row) is type(ctx) and vars(row).keys() == vars(ctx).keys()
    assert torch.equal(row.visible, ctx.visible[[0, 1], [2, 0]][:, None])
    assert torch.equal(row.cos, ctx.cos[[0, 1], [2, 0]][:, None]) and row.cache is ctx.cache
