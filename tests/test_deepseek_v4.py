"""DeepSeek-V4 (`deepseek_v4`) through the family interface, with HF transformers as the oracle: target
logits over every layer type, hash layers, and windows and compression rates shorter than the prompt;
the MTP layer against HF's own V4 modules; greedy output of the reference loop and of the Runtime at
every depth and bucket; rejected and padded rows that never change what a later step reads; the
`v4-tiny` preset."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.cli import main
from compiled_mtp.hf_baseline import load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.config import CheckpointError
from compiled_mtp.models.deepseek_v4 import DeepseekV4Config
from tests import checkpoints, corruption
from tests import test_distribution as distribution
from tests.oracle import (
    assert_buckets_match_hf,
    assert_depth_switching_matches_hf,
    assert_reference_matches_hf,
    hf_greedy,
    hf_logits,
)
from tests.test_acceptance import MAX_NEW, assert_acceptance_parity
from tests.test_engine import JOIN_LEAVE, assert_join_leave_parity, assert_padded_rows_write_only_scratch
from tests.test_models import ATOL, RTOL, engine_logits
from tests.v4_factory import (
    SLIDING,
    HFMtpOracle,
    random_hf_model,
    v4_config,
    v4_config_strategy,
    write_v4_checkpoint,
    write_v4_distilled_checkpoint,
)

PROMPT = 23  # longer than every drawn window (<= 8) and compression rate (<= 8)
NEW_TOKENS = 12
LM_HEAD_SCALE = 0.5


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> Path:
    """`write_v4_checkpoint(v4_config())`: sliding + hash MoE, CSA (top 2 of windows of 4), HCA (8)."""
    return write_v4_checkpoint(tmp_path_factory.mktemp("v4"), v4_config(), seed=1)


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_draft_logits(model, tokens: list[int]) -> torch.Tensor:
    """Depth-1 MTP logits [T-1, V]: row i takes tokens[i+1] and T's streams at position i."""
    n = len(tokens)
    pos, slot = torch.arange(n)[None], torch.tensor([0])
    hidden = model.forward_target(
        torch.tensor([tokens]), pos, pos, slot, model.new_cache(model.cfg.num_hidden_layers, 1, n)
    )
    cache = model.new_cache(model.num_mtp_layers, 1, n)
    m = model.forward_mtp(
        0, torch.tensor([tokens[1:]]), hidden[:, :-1], pos[:, :-1], pos[:, :-1], slot, cache
    )
    return model.draft_logits(m)[0]


@settings(max_examples=8, deadline=None)
@given(v4_config_strategy())
@example(v4_config())
@torch.no_grad()
def test_target_logits_match_hf(config):
    """Whole prompt at once and in chunks of 5 through the cache (compressed entries pooled from the
    rows of earlier chunks), against HF's forward without a cache."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_v4_checkpoint(tmp, config, seed=3)
        hf, ours = load_hf(path), load_model(path)
        tokens = _tokens(config.vocab_size, PROMPT, seed=0)
        expected = hf_logits(hf, tokens)
        torch.testing.assert_close(engine_logits(ours, tokens), expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(engine_logits(ours, tokens, chunk=5), expected, atol=ATOL, rtol=RTOL)


@settings(max_examples=4, deadline=None)
@given(v4_config_strategy())
@example(v4_config())
@torch.no_grad()
def test_mtp_logits_match_hf_modules(config):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_v4_checkpoint(tmp, config, seed=4)
        hf, ours = load_hf(path), load_model(path)
        tokens = _tokens(config.vocab_size, PROMPT, seed=1)
        expected = HFMtpOracle(path, hf).draft_logits(tokens)
        torch.testing.assert_close(engine_draft_logits(ours, tokens), expected, atol=ATOL, rtol=RTOL)


def _float32_tensors(tensors) -> list[tuple]:
    """The float32 tensors among `tensors`, by shape and values (names differ between HF and here)."""
    return sorted((tuple(t.shape), t.flatten().tolist()) for t in tensors if t.dtype == torch.float32)


@torch.no_grad()
def test_bfloat16_keeps_hf_float32_parameters_and_logits(v4_path):
    """In bfloat16 the parameters HF's V4 keeps in float32 (norms, hyper-connections, sinks, position
    biases, router biases; for the MTP layer also its enorm, hnorm, norm and hc_head, as DeepSeek's own
    code keeps them) are float32 here too, and every norm multiplies in float32 and casts once. The
    eager ops are then HF's, in HF's order, so target and MTP logits are HF's bit for bit; with those
    parameters rounded to bfloat16 they move by 0.16 here."""
    hf, ours = load_hf(v4_path, dtype=torch.bfloat16), load_model(v4_path, dtype=torch.bfloat16)
    oracle = HFMtpOracle(v4_path, hf, dtype=torch.bfloat16)
    ours_target, ours_mtp = [], []
    for name, t in ours.state_dict().items():
        (ours_mtp if name.startswith("mtp.") else ours_target).append(t)
    assert _float32_tensors(ours_target) == _float32_tensors(hf.state_dict().values())
    hf_mtp = [*oracle.block.state_dict().values(), *(norm.weight for norm in oracle.norms.values())]
    assert _float32_tensors(ours_mtp) == _float32_tensors(hf_mtp)
    tokens = _tokens(97, PROMPT, seed=2)
    expected, exact = hf_logits(hf, tokens).float(), dict(atol=0.0, rtol=0.0)
    torch.testing.assert_close(engine_logits(ours, tokens), expected, **exact)
    torch.testing.assert_close(engine_logits(ours, tokens, chunk=5), expected, **exact)
    torch.testing.assert_close(
        engine_draft_logits(ours, tokens), oracle.draft_logits(tokens).float(), **exact
    )


def test_bfloat16_runtime_greedy_equals_hf_bfloat16(v4_path):
    """The step graphs (eager) of a bfloat16 model at K = 2, buckets 2 and 1: HF's bfloat16 greedy."""
    hf = load_hf(v4_path, dtype=torch.bfloat16)
    prompts = [_tokens(97, n, seed=n) for n in (5, 12)]
    rt = Runtime.from_pretrained(
        v4_path,
        dtype="bfloat16",
        mtp_depth=2,
        batch_sizes=(1, 2),
        max_seq_len=64,
        compile_backend="eager",
        cache_dir=None,
    )
    outs = rt.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 16)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, n) for p, n in zip(prompts, (6, 16))]


@settings(max_examples=3, deadline=None)
@given(v4_config_strategy(), st.lists(st.integers(1, 9), min_size=1, max_size=2))
@example(v4_config(), [5])
def test_reference_greedy_equals_hf_generate_for_every_depth(config, lengths):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_v4_checkpoint(tmp, config, seed=5)
        assert_reference_matches_hf(
            path, [_tokens(config.vocab_size, n, seed=n) for n in lengths], NEW_TOKENS
        )


@pytest.mark.parametrize("k", range(5))
def test_runtime_greedy_equals_hf_generate_on_buckets_1_2_4(v4_path, k):
    """Four requests of different lengths finish at different steps, so the batch moves through
    buckets 4, 2 and 1; sequences grow to 28 positions, past the window and several compressed
    entries of every layer."""
    assert_buckets_match_hf(v4_path, load_hf(v4_path), [_tokens(97, n, seed=k + n) for n in (5, 1, 12, 9)], k)


def test_padded_rows_write_only_the_scratch_slot(v4_path):
    assert_padded_rows_write_only_scratch(load_model(v4_path))


@pytest.fixture(scope="module")
def v4_sequence(v4_path) -> tuple:
    """(our model, a 40-token sequence, HF's logits over it without a cache)."""
    tokens = _tokens(97, 40, seed=7)
    return load_model(v4_path), tokens, hf_logits(load_hf(v4_path), tokens)


@settings(max_examples=10, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=12),
    st.integers(0, 2**16),
)
@torch.no_grad()
def test_rejected_and_padded_rows_never_change_later_reads(v4_sequence, prompt, schedule, seed):
    """Verify blocks of K + 1 rows at drawn depths K, of which the first a + 1 carry the sequence and the
    rest rejected drafts (random tokens); beside each, a padded row writes random tokens to the scratch
    slot at a random position. Every accepted row's logits equal HF's over the sequence: no rejected or
    padded row changed what a later step read (sliding window, compressed entries, indexer keys)."""
    model, tokens, expected = v4_sequence
    gen = torch.Generator().manual_seed(seed)
    capacity, slot, scratch = len(tokens) + 5, 1, 2
    cache = model.new_cache(model.cfg.num_hidden_layers, 3, capacity)
    pos = torch.arange(prompt)[None]
    model.forward_target(
        torch.tensor([tokens[:prompt]]), pos, pos + slot * capacity, torch.tensor([slot]), cache
    )
    n = prompt  # committed tokens; the last is not yet through the target
    for k, accept in schedule:
        a = min(accept, k, len(tokens) - n - 1)
        if a < 0:
            break
        garbage = torch.randint(model.cfg.vocab_size, (2, k + 1), generator=gen)
        block = torch.cat([torch.tensor(tokens[n - 1 : n + a]), garbage[0, a + 1 :]])
        pos = torch.stack(
            [
                torch.arange(n - 1, n + k),
                torch.randint(capacity - k, (1,), generator=gen) + torch.arange(k + 1),
            ]
        )
        write = pos + torch.tensor([[slot], [scratch]]) * capacity
        ids = torch.stack([block, garbage[1]])
        logits = model.logits(model.forward_target(ids, pos, write, torch.tensor([slot, scratch]), cache))
        torch.testing.assert_close(logits[0, : a + 1], expected[n - 1 : n + a], atol=ATOL, rtol=RTOL)
        n += a + 1


def test_v4_tiny_preset_serves_like_hf(tmp_path):
    """`random-checkpoint --preset v4-tiny` writes a checkpoint HF loads; the Runtime's greedy output
    at K = 2 equals HF's plain greedy."""
    path = tmp_path / "v4"
    main(["random-checkpoint", "--preset", "v4-tiny", "--out", str(path), "--seed", "2"])
    hf = load_hf(path)
    prompts = [_tokens(512, n, seed=n) for n in (3, 20)]
    rt = Runtime.from_pretrained(
        path, mtp_depth=2, batch_sizes=(1, 2), max_seq_len=64, compile_backend="eager", cache_dir=None
    )
    outs = rt.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]


def test_hf_save_pretrained_alone_serves_at_depth_0(tmp_path):
    """HF writes no MTP layer: the checkpoint serves without MTP, and asking for it is one error."""
    random_hf_model(v4_config(), seed=2).save_pretrained(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"no MTP layer keys \(mtp\.0\.\*\).*serve it with mtp_depth 0$"
    ):
        load_model(tmp_path)
    tokens = _tokens(97, 9, seed=2)
    torch.testing.assert_close(
        engine_logits(load_model(tmp_path, with_mtp=False), tokens),
        hf_logits(load_hf(tmp_path), tokens),
        atol=ATOL,
        rtol=RTOL,
    )


def test_unknown_layer_type_is_one_error_naming_the_field(v4_path, tmp_path):
    path = corruption.copy_checkpoint(v4_path, tmp_path / "bad")
    checkpoints.set_config_fields(
        path, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    )
    with pytest.raises(
        CheckpointError,
        match=r"^\S*config\.json: layer_types entries must be in \[.*\], got \['full_attention'\]$",
    ):
        load_model(path)


def test_every_kind_traces_whole_and_matches_hf(v4_path):
    """Every graph kind, buckets 1 and 2, the depth switching: HF's greedy tokens (oracle.py)."""
    assert_depth_switching_matches_hf(v4_path, load_hf(v4_path), [_tokens(97, n, seed=9) for n in (4, 7)])


def test_released_config_fields_give_the_same_schedule(v4_path):
    """DeepSeek's config.json spells the schedule `compress_ratios` (0 / 4 / 128 per layer) and
    `num_hash_layers`; they give the layer types HF's `layer_types` / `mlp_layer_types` name."""
    raw = json.loads((v4_path / "config.json").read_text())
    ours = DeepseekV4Config.from_dict(raw)
    released = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types")}
    released |= {"compress_ratios": [0, 4, 128], "num_hash_layers": 1}
    released["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert DeepseekV4Config.from_dict(released) == ours


@pytest.fixture(scope="module")
def v4_markov(tmp_path_factory):
    """A one-layer V4 model (test_distribution._chain reads one layer) whose target and MTP layer are
    Markov chains over 12 tokens: every attention's wo_b is zero, so the streams depend only on the
    current token, and the MTP layer's h_proj drops the target's streams. Its drafts follow a chain
    of their own, so rejections and residuals run."""
    config = v4_config(
        vocab_size=distribution.VOCAB,
        num_hidden_layers=1,
        layer_types=[SLIDING],
        mlp_layer_types=["hash_moe"],
    )
    model = load_model(write_v4_checkpoint(tmp_path_factory.mktemp("v4_markov"), config, seed=8))
    with torch.no_grad():
        for block in [*model.model.layers, *model.mtp]:
            block.attn.wo_b.weight.zero_()
        model.mtp[0].h_proj.weight.zero_()
        model.lm_head.weight *= LM_HEAD_SCALE
    return model


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_sampled_tokens_follow_the_target_chain(v4_markov, k):
    """test_distribution.py's chi-square and convergence checks (false-failure rate 1e-6 per depth)."""
    target = distribution._chain(v4_markov, target=True)
    draft = distribution._chain(v4_markov, target=False)
    pairs, depths = distribution._transitions(v4_markov, k, seed=402 + k)
    assert list(depths) == [k]
    distribution._assert_follows(pairs, target, draft, f"V4 K={k}")


@pytest.fixture(scope="module")
def v4_distilled_path(tmp_path_factory) -> Path:
    return write_v4_distilled_checkpoint(tmp_path_factory.mktemp("v4_distilled"), seed=1)


@pytest.mark.parametrize("k", [1, 3])
def test_accepted_counts_equal_the_reference_on_every_bucket(v4_distilled_path, k):
    """Per request and step, the Runtime drafts and accepts what the reference loop does (a wrong draft
    lowers acceptance without changing a greedy token), through buckets 4, 2 and 1."""
    model = load_model(v4_distilled_path)
    rt = Runtime(
        model, mtp_depth=k, batch_sizes=(1, 2, 4), max_seq_len=64, compile_backend="eager", prefill_chunk=8
    )
    assert_acceptance_parity(rt, model, k, [_tokens(97, n, seed=k + n) for n in (5, 1, 12, 9)], MAX_NEW)


def test_distilled_mtp_layer_is_accepted_at_k1(v4_distilled_path):
    """The distilled MTP layer's drafts are accepted at least 0.6 of the time at K = 1 (greedy, 6
    prompts x 24 tokens; measured 0.73), and the tokens are HF's plain greedy ones."""
    prompts = [_tokens(97, n, seed=4 + n) for n in (3, 8, 5, 12, 6, 9)]
    rt = Runtime.from_pretrained(
        v4_distilled_path,
        mtp_depth=1,
        batch_sizes=(1,),
        max_seq_len=64,
        compile_backend="eager",
        cache_dir=None,
    )
    outs = rt.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    hf = load_hf(v4_distilled_path)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    assert rt.stats()["acceptance_rate_per_position"][0] >= 0.6


def test_capture_cache_serves_v4_with_every_pass(v4_distilled_path, tmp_path):
    """Inductor with every pass, built into a capture cache, then loaded by a second runtime without a
    compile: HF's greedy tokens and the same drafts accepted both times. The compressed entries'
    rotary tables fold into the code (they follow from the config, which is in the key)."""
    prompt, params = _tokens(97, 9, seed=3), SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        rt = Runtime.from_pretrained(
            v4_distilled_path,
            mtp_depth=1,
            batch_sizes=(1,),
            max_seq_len=32,
            prefill_chunk=8,
            cache_dir=tmp_path,
        )
        runs.append((rt.generate([prompt], params)[0].token_ids, rt.stats()))
    (tokens, built), (again, loaded) = runs
    assert tokens == again == hf_greedy(load_hf(v4_distilled_path), prompt, 12)
    assert built["compiles"] == 3 and loaded["compiles"] == 0
    assert loaded["accepted_tokens_per_position"] == built["accepted_tokens_per_position"]


@settings(max_examples=6, deadline=None)
@given(k=st.integers(0, 3), schedule=JOIN_LEAVE)
def test_greedy_parity_under_join_and_leave(v4_distilled_path, k, schedule):
    """Requests join and leave between steps while drafts are accepted and rejected: every request
    gets the reference loop's greedy tokens."""
    assert_join_leave_parity(load_model(v4_distilled_path), k, schedule)


def test_restricted_draft_vocabulary_keeps_parity(v4_distilled_path):
    """draft_vocab: the MTP layer's hc_head and norm, then the head's rows of the draft tokens; tokens
    and accepted counts equal the reference loop's on the same restricted model."""
    model = load_model(v4_distilled_path)
    model.restrict_drafts(torch.arange(0, 97, 2))
    rt = Runtime(
        model, mtp_depth=2, batch_sizes=(1, 2, 4), max_seq_len=64, compile_backend="eager", prefill_chunk=8
    )
    assert_acceptance_parity(rt, model, 2, [_tokens(97, n, seed=n) for n in (5, 1, 12, 9)], MAX_NEW)
