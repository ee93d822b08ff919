"""Sampled output of the whole engine follows the target's distribution, at every depth.

The model: an echo checkpoint with attention switched off (attn_scale 0), so the target is an exact
Markov chain over a 12-token vocabulary whose transition rows P[x] we can compute directly, and a
noisy MTP layer (mtp_noise 0.5) so drafts often differ from the target and the rejection and
residual paths run. Each generated token is one draw from P[previous token], whatever was drafted.

Two checks per depth K:
- Pearson chi-square of the transition counts against P, failing below p = 1e-6: false-failure
  rate 1e-6 per depth (the seeds are fixed, so a pass is stable).
- Convergence: the count-weighted total-variation distance to P falls as more samples come in
  (expected by 4x from N/16 to N; we require 2x), while the distance to random reference chains and
  to the draft chain stays above FLOOR. Each of those chains is first checked to lie more than
  FLOOR + NOISE from P itself (else the floor could not tell it from P); then the floor check
  fails falsely only if the samples lie NOISE or more from P: probability below 1e-9 (see
  _assert_follows).
"""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.models.checkpoint import load_model
from tests.checkpoints import write_echo_checkpoint
from tests.stats import chi_square_p_value

VOCAB = 12
TEMPERATURE = 2.5  # at 1.0 this chain puts ~0.9 on one successor; 2.5 fills every cell
TRANSITIONS = 12_000
FLOOR = 0.05  # the least distance from the samples to a wrong chain
NOISE = 0.16  # the most distance from the samples to the target, but with probability < 1e-9
MIN_ROW = 700  # transitions out of every token: the premise of NOISE's bound


@pytest.fixture(scope="module")
def markov_path(tmp_path_factory):
    return write_echo_checkpoint(tmp_path_factory.mktemp("markov"), vocab_size=VOCAB, mtp_noise=0.5, seed=3)


@pytest.fixture(scope="module")
def markov(markov_path):
    model = load_model(markov_path)
    return model, _chain(model, target=True), _chain(model, target=False)


@torch.no_grad()
def _chain(model, target: bool) -> torch.Tensor:
    """Transition rows [V, V] of the target (or the depth-1 draft) at TEMPERATURE."""
    tokens = torch.arange(VOCAB)[:, None]
    zeros = torch.zeros(VOCAB, 1, dtype=torch.long)
    slots = torch.zeros(VOCAB, dtype=torch.long)
    cache = model.new_cache(1, 1, 1)
    h = model.forward_target(tokens, zeros, zeros, slots, cache)
    if target:
        logits = model.logits(h)
    else:  # an MTP row reading token x drafts x's successor (this M ignores the hidden)
        logits = model.draft_logits(
            model.forward_mtp(0, tokens, h, zeros, zeros, slots, model.new_cache(1, 1, 1))
        )
    return (logits[:, 0] / TEMPERATURE).softmax(-1).double()


def _transitions(model, k: int | str, seed: int) -> tuple[torch.Tensor, dict[int, int]]:
    """(previous, next) pairs in generation order, from batches of seeded requests, and the steps run
    at each depth."""
    rt = Runtime(
        model, mtp_depth=k, batch_sizes=(16,), max_seq_len=64, compile_backend="eager", prefill_chunk=4
    )
    gen = torch.Generator().manual_seed(seed)
    pairs: list[torch.Tensor] = []
    seed = 0
    while sum(len(p) for p in pairs) < TRANSITIONS:
        starts = torch.randint(VOCAB, (16,), generator=gen).tolist()
        params = []
        for _ in starts:
            seed += 1
            params.append(
                SamplingParams(max_new_tokens=48, temperature=TEMPERATURE, seed=seed, ignore_eos=True)
            )
        for start, out in zip(starts, rt.generate([[s] for s in starts], params)):
            seq = torch.tensor([start] + out.token_ids)
            pairs.append(torch.stack([seq[:-1], seq[1:]], dim=1))
    return torch.cat(pairs)[:TRANSITIONS], rt.stats()["depth_histogram"]


def _counts(pairs: torch.Tensor) -> torch.Tensor:
    return (
        torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).view(VOCAB, VOCAB).double()
    )


def _distance(counts: torch.Tensor, chain: torch.Tensor) -> float:
    """Count-weighted total variation between the empirical transition rows and `chain`."""
    rows = counts.sum(-1, keepdim=True)
    empirical = counts / rows.clamp_min(1)
    return float((rows[:, 0] * 0.5 * (empirical - chain).abs().sum(-1)).sum() / rows.sum())


# "auto" switches depth between steps from measured wall time, so its schedule (not its distribution)
# varies from run to run.
DEPTHS = [0, 1, 2, 3, "auto"]


@pytest.mark.parametrize("k", DEPTHS)
def test_sampled_tokens_follow_the_target_chain(markov, k):
    model, target, draft = markov
    pairs, depths = _transitions(model, k, seed=100 + DEPTHS.index(k))
    assert len(depths) > 1 if k == "auto" else list(depths) == [k], depths
    _assert_follows(pairs, target, draft, f"K={k}")


def test_sampled_tokens_follow_the_target_chain_with_a_restricted_draft_vocabulary(markov, markov_path):
    """draft_vocab: q is zero outside the draft tokens, so the residual must supply every other one."""
    _, target, draft = markov
    model = load_model(markov_path)
    model.restrict_drafts(torch.arange(0, VOCAB, 2))
    pairs, _ = _transitions(model, 2, seed=200)
    _assert_follows(pairs, target, draft, "K=2, half the vocabulary drafted")


def _assert_follows(pairs: torch.Tensor, target: torch.Tensor, draft: torch.Tensor, case: str) -> None:
    counts = _counts(pairs)
    p = min(chi_square_p_value(counts[x], target[x]) for x in range(VOCAB)) * VOCAB  # Bonferroni over rows
    assert p > 1e-6, f"{case}: chi-square p={p:.2e}"

    early, full = _distance(_counts(pairs[: TRANSITIONS // 16]), target), _distance(counts, target)
    assert full < early / 2, f"{case}: distance to the target {early:.4f} -> {full:.4f} did not shrink"
    # Row x's transitions are draws from P[x], each independent of those before it, so their total
    # variation from P[x] reaches NOISE with probability at most (2^V - 2) exp(-2 n NOISE^2) after n
    # of them (Weissman et al. 2003): summed over n >= MIN_ROW and the V rows, below 1e-9. Short of
    # that, `full` < NOISE, and by the triangle inequality (rows weighted alike) a chain at more than
    # FLOOR + NOISE from P lies more than FLOOR from the samples.
    rows = counts.sum(-1, keepdim=True)
    assert rows.min() >= MIN_ROW, f"{case}: only {int(rows.min())} transitions out of some token"
    gen = torch.Generator().manual_seed(7)
    randoms = [(3 * torch.rand(VOCAB, VOCAB, generator=gen)).softmax(-1).double() for _ in range(4)]
    for ref in [draft] + randoms:
        gap = _distance(rows * target, ref)  # P's own distance to the chain, rows weighted as sampled
        assert gap > FLOOR + NOISE, f"{case}: a wrong chain lies only {gap:.4f} from the target"
        far, early_far = _distance(counts, ref), _distance(_counts(pairs[: TRANSITIONS // 16]), ref)
        assert far > FLOOR and far > 0.5 * early_far, f"{case}: distance to a wrong chain fell to {far:.4f}"


TOP_K, TOP_P = 6, 0.85
STREAMED = TRANSITIONS // 3  # the truncated rows have at most TOP_K cells: fewer samples fill them


def _truncated_chain(model) -> torch.Tensor:
    """The target's transition rows after top-k then top-p (processed_probs, itself held to HF's
    processors in test_sampling.py)."""
    from compiled_mtp.graphs.sampling import processed_probs

    tokens = torch.arange(VOCAB)[:, None]
    zeros = torch.zeros(VOCAB, 1, dtype=torch.long)
    h = model.forward_target(
        tokens, zeros, zeros, torch.zeros(VOCAB, dtype=torch.long), model.new_cache(1, 1, 1)
    )
    rows = torch.full((VOCAB,), 1.0)
    return processed_probs(
        model.logits(h)[:, 0], rows * TEMPERATURE, (rows * TOP_K).long(), rows * TOP_P
    ).double()


def _streamed_transitions(model, seed: int) -> tuple[torch.Tensor, dict[int, int]]:
    """Like _transitions, with top-k and top-p, requests joining between steps and leaving when done
    (the batch moves between buckets) and the depth switching every step among 0..3."""
    rt = Runtime(
        model,
        mtp_depth=0,
        mtp_depths=(0, 1, 2, 3),
        batch_sizes=(4, 8, 16),
        max_seq_len=64,
        compile_backend="eager",
        prefill_chunk=4,
    )
    gen = torch.Generator().manual_seed(seed)
    tokens: dict[int, list[int]] = {}
    schedule, step, total = [3, 0, 1, 2, 0, 3, 3], 0, 0
    while total < STREAMED:
        for _ in range(int(torch.randint(0, 7, (), generator=gen))):  # about 16 running, more queued
            start, n = torch.randint(VOCAB, (2,), generator=gen).tolist()
            params = SamplingParams(
                max_new_tokens=8 + 4 * n,
                temperature=TEMPERATURE,
                top_k=TOP_K,
                top_p=TOP_P,
                seed=seed * 100_000 + len(tokens),
                ignore_eos=True,
            )
            tokens[rt.add_request([start], params)] = [start]
        rt.mtp_depth = schedule[step % len(schedule)]
        for out in rt.step():
            tokens[out.request_id] += out.new_token_ids
            total += len(out.new_token_ids)
        step += 1
    pairs = [
        torch.stack([torch.tensor(t[:-1]), torch.tensor(t[1:])], dim=1) for t in tokens.values() if len(t) > 1
    ]
    return torch.cat(pairs)[:STREAMED], rt.stats()["depth_histogram"]


def test_top_k_top_p_sampling_follows_the_truncated_chain_through_depth_switches_and_join_leave(markov):
    model, _, draft = markov
    target = _truncated_chain(model)
    assert ((target > 0).sum(-1) > 1).all() and (target == 0).any()  # both cuts matter on this chain
    pairs, depths = _streamed_transitions(model, seed=300)
    assert set(depths) == {0, 1, 2, 3}
    counts = _counts(pairs)
    assert counts[target == 0].sum() == 0, "a token outside top-k/top-p was sampled"
    support = target > 0
    p = min(chi_square_p_value(counts[x][support[x]], target[x][support[x]]) for x in range(VOCAB)) * VOCAB
    assert p > 1e-6, f"chi-square p={p:.2e}"
    early, full = _distance(_counts(pairs[: STREAMED // 16]), target), _distance(counts, target)
    assert full < early / 2 and _distance(counts, draft) > 0.05
