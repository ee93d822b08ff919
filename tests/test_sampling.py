"""Properties of compiled_mtp.graphs.sampling: filtered distributions, inverse-CDF draws and
speculative rejection sampling (exact for greedy, distribution-preserving when sampling)."""

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_mtp.graphs.sampling import (
    draft_sample,
    processed_probs,
    rejection_sample,
    sample_from_probs,
)
from tests.stats import chi_square_p_value as chi_square

SETTINGS = settings(derandomize=True, deadline=None, max_examples=100)
LARGEST_BELOW_ONE = math.nextafter(1.0, 0.0)
LARGEST_F32_BELOW_ONE = 1.0 - 2.0**-24

uniforms = st.one_of(
    st.sampled_from([0.0, 0.5, LARGEST_F32_BELOW_ONE]),
    st.floats(0.0, 1.0, exclude_max=True, width=32),
)


@st.composite
def sampling_batches(draw, max_batch=4, max_vocab=12):
    """Logits [B, V] (small integers give exact ties) and per-row sampling params."""
    batch = draw(st.integers(1, max_batch))
    vocab = draw(st.integers(1, max_vocab))
    value = st.one_of(st.integers(-3, 3).map(float), st.floats(-10.0, 10.0, width=32))
    logits = torch.tensor(
        draw(st.lists(st.lists(value, min_size=vocab, max_size=vocab), min_size=batch, max_size=batch)),
        dtype=torch.float32,
    )
    row_params = st.lists(
        st.tuples(
            st.one_of(st.just(0.0), st.floats(0.25, 4.0)),
            st.integers(0, vocab + 1),
            st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
        ),
        min_size=batch,
        max_size=batch,
    )
    temperature, top_k, top_p = zip(*draw(row_params))
    return (
        logits,
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(top_p, dtype=torch.float32),
    )


def random_probs(shape, generator, zero_fraction=0.0):
    """Random distributions over the last dim; some entries zeroed, never a whole row."""
    probs = torch.rand(shape, generator=generator, dtype=torch.float64) + 0.05
    zeros = torch.rand(shape, generator=generator) < zero_fraction
    zeros[..., 0] &= ~zeros[..., 1:].all(-1)
    probs = probs.masked_fill(zeros, 0.0)
    return (probs / probs.sum(-1, keepdim=True)).float()


def draft_from(q, generator):
    """Drafts [B, K] sampled from q [B, K, V] with seeded uniforms."""
    u = torch.rand(q.shape[:-1], generator=generator)
    return sample_from_probs(q, u)


# --- processed_probs -----------------------------------------------------------------------


@SETTINGS
@given(sampling_batches())
def test_processed_probs_is_filtered_softmax(batch):
    logits, temperature, top_k, top_p = batch
    out = processed_probs(logits, temperature, top_k, top_p)
    vocab = logits.shape[-1]
    assert out.dtype == torch.float32 and out.shape == logits.shape
    assert (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(len(logits)), rtol=0, atol=1e-5)
    for row, t, k, p, o in zip(logits, temperature.tolist(), top_k.tolist(), top_p.tolist(), out):
        if t == 0:
            assert torch.equal(o, torch.nn.functional.one_hot(row.argmax(), vocab).float())
            continue
        probs = torch.softmax(row / t, -1)
        ranked, order = probs.sort(descending=True, stable=True)
        kept = o[order] > 0
        m = int(kept.sum())
        assert kept[:m].all(), "kept tokens must be the most likely ones, ties by token id"
        limit = k if 0 < k < vocab else vocab
        assert 1 <= m <= limit
        ranked = ranked.double()
        top_k_mass = ranked[:limit].sum().item()
        kept_mass = ranked[:m].sum().item() / top_k_mass
        if p >= 1:
            assert m == limit
        assert kept_mass >= p - 1e-5 or m == limit
        if m > 1:
            assert kept_mass - ranked[m - 1].item() / top_k_mass < p + 1e-5, "not the smallest prefix"
        torch.testing.assert_close(o[order[:m]].double(), ranked[:m] / ranked[:m].sum(), rtol=1e-5, atol=1e-7)


@SETTINGS
@given(sampling_batches(max_batch=6))
def test_processed_probs_rows_are_independent(batch):
    logits, temperature, top_k, top_p = batch
    out = processed_probs(logits, temperature, top_k, top_p)
    for b in range(len(logits)):
        alone = processed_probs(logits[b : b + 1], temperature[b : b + 1], top_k[b : b + 1], top_p[b : b + 1])
        assert torch.equal(out[b : b + 1], alone)


def test_processed_probs_leading_dims_and_ties():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])
    temperature = torch.tensor([[0.0, 1.0]])
    out = processed_probs(logits, temperature, torch.tensor([[0, 2]]), torch.tensor([[1.0, 1.0]]))
    assert torch.equal(out[0, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # argmax tie: lowest id
    assert torch.equal(out[0, 1], torch.tensor([0.5, 0.5, 0.0, 0.0]))  # top-k tie: lowest ids


def test_processed_probs_ties_in_a_large_vocab_cut_by_token_id():
    # Many equal logits: an unstable sort would pick arbitrary tied ids.
    logits = torch.zeros(2, 1000)
    logits[:, ::7] = 1.0
    out = processed_probs(logits, torch.ones(2), torch.tensor([10, 0]), torch.tensor([1.0, 0.01]))
    assert out[0].nonzero().flatten().tolist() == list(range(0, 70, 7))
    # Each tied maximum has mass e / (143 e + 857) ~ 0.0022, so top_p = 0.01 needs five of them.
    assert out[1].nonzero().flatten().tolist() == list(range(0, 35, 7))


def test_processed_probs_top_p_edges():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.5, 0.0], [0.5, 0.3, 0.2]]))
    top_k = torch.tensor([2, 0, 0, 0])
    top_p = torch.tensor([0.6, 0.6, 0.5, 0.0])
    kept = processed_probs(logits, torch.ones(4), top_k, top_p) > 0
    # Top-p measures the top-k renormalized mass: 0.5 / 0.8 >= 0.6 keeps one token.
    assert kept[0].tolist() == [True, False, False]
    assert kept[1].tolist() == [True, True, False]
    # Reaching top_p exactly is enough; top_p = 0 still keeps the most likely token.
    assert kept[2].tolist() == [True, False, False]
    assert kept[3].tolist() == [True, False, False]


# --- sample_from_probs ---------------------------------------------------------------------


@st.composite
def sparse_rows(draw):
    vocab = draw(st.integers(1, 10))
    weights = draw(
        st.lists(
            st.one_of(st.just(0.0), st.floats(2.0**-20, 1.0, width=32)), min_size=vocab, max_size=vocab
        ).filter(lambda w: any(x > 0 for x in w))
    )
    return torch.tensor(weights, dtype=torch.float32)


@SETTINGS
@given(st.lists(st.tuples(sparse_rows(), uniforms), min_size=1, max_size=5), st.booleans())
def test_sample_from_probs_never_returns_zero_probability(rows, normalize):
    for probs, u in rows:
        if normalize:
            probs = probs / probs.sum()
        index = sample_from_probs(probs, torch.tensor(u))
        assert index.dtype == torch.int64 and index.shape == ()
        assert probs[index] > 0


def test_sample_from_probs_one_hot_and_exact_quantiles():
    vocab = 7
    u = torch.tensor([0.0, 1e-30, 0.3, 0.5, 0.999, LARGEST_F32_BELOW_ONE, LARGEST_BELOW_ONE])
    for hot in range(vocab):
        one_hot = torch.nn.functional.one_hot(torch.tensor(hot), vocab).float().expand(len(u), vocab)
        assert (sample_from_probs(one_hot, u) == hot).all()
    # Dyadic probabilities and a midpoint grid of u make the counts exact.
    probs = torch.tensor([0.25, 0.0, 0.5, 0.0, 0.125, 0.125, 0.0])
    n = 1024
    grid = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    counts = torch.bincount(sample_from_probs(probs.expand(n, -1), grid), minlength=vocab)
    assert torch.equal(counts, (probs * n).long())


# --- rejection_sample ----------------------------------------------------------------------


@st.composite
def speculative_batches(draw):
    """(p [B, K+1, V], drafts [B, K], q [B, K, V], u_accept [B, K], u_final [B])."""
    batch = draw(st.integers(1, 5))
    k = draw(st.integers(0, 4))
    vocab = draw(st.integers(1, 8))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    zero_fraction = draw(st.sampled_from([0.0, 0.5]))
    p = random_probs((batch, k + 1, vocab), generator, zero_fraction)
    # q is either drawn on its own or a copy of p's rows, for drafts that agree with the target often
    q = random_probs((batch, k, vocab), generator, zero_fraction) if draw(st.booleans()) else p[:, :k].clone()
    if draw(st.booleans()):
        drafts = draft_from(q, generator)
    else:  # padded rows may carry drafts outside q's support
        drafts = torch.randint(0, vocab, (batch, k), generator=generator)
    u_accept = torch.tensor(draw(st.lists(uniforms, min_size=batch * k, max_size=batch * k))).view(batch, k)
    u_final = torch.tensor(draw(st.lists(uniforms, min_size=batch, max_size=batch)))
    return p, drafts, q, u_accept, u_final


@SETTINGS
@given(speculative_batches())
def test_rejection_sample_invariants(case):
    p, drafts, q, u_accept, u_final = case
    batch, positions, _ = p.shape
    num_accepted, tokens = rejection_sample(p, drafts, q, u_accept, u_final)
    assert num_accepted.dtype == torch.int64 and num_accepted.shape == (batch,)
    assert tokens.dtype == torch.int64 and tokens.shape == (batch, positions)
    for b, a in enumerate(num_accepted.tolist()):
        assert 0 <= a < positions
        assert torch.equal(tokens[b, :a], drafts[b, :a])
        assert all(p[b, i, drafts[b, i]] > 0 for i in range(a)), "accepted a draft the target rules out"
        assert (tokens[b, a:] == tokens[b, a]).all()
        if a < positions - 1:
            i = a
            d = drafts[b, i]
            assert not u_accept[b, i] * q[b, i, d] < p[b, i, d], "stopped at an accepted draft"
        assert p[b, a, tokens[b, a]] > 0, "final token outside the target's support"


@SETTINGS
@given(speculative_batches(), st.randoms(use_true_random=False))
def test_rejection_sample_batch_independence(case, rng):
    p, drafts, q, u_accept, u_final = case
    perm = list(range(len(p)))
    rng.shuffle(perm)
    perm = torch.tensor(perm)
    num_accepted, tokens = rejection_sample(p, drafts, q, u_accept, u_final)
    shuffled = rejection_sample(p[perm], drafts[perm], q[perm], u_accept[perm], u_final[perm])
    assert torch.equal(shuffled[0], num_accepted[perm])
    assert torch.equal(shuffled[1], tokens[perm])


@SETTINGS
@given(
    st.integers(1, 5),
    st.integers(0, 4),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_rejection_sample_greedy_is_exact(batch, k, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values make ties and matching drafts common.
    target_logits = torch.randint(0, 3, (batch, k + 1, vocab), generator=generator).float()
    draft_logits = torch.randint(0, 3, (batch, k, vocab), generator=generator).float()
    zeros = torch.zeros(batch, dtype=torch.int64)
    ones = torch.ones(batch)
    p = processed_probs(
        target_logits, torch.zeros(batch, k + 1), zeros.new_zeros(batch, k + 1), torch.ones(batch, k + 1)
    )
    drafts, q = [], []
    for i in range(k):
        d, q_i = draft_sample(
            draft_logits[:, i], torch.zeros(batch), zeros, ones, torch.rand(batch, generator=generator)
        )
        drafts.append(d)
        q.append(q_i)
    drafts = torch.stack(drafts, 1) if k else zeros.new_zeros(batch, 0)
    q = torch.stack(q, 1) if k else torch.zeros(batch, 0, vocab)
    u_accept = torch.rand(batch, k, generator=generator)
    u_accept[:, ::2] = LARGEST_F32_BELOW_ONE
    u_accept[:, 1::3] = 0.0
    num_accepted, tokens = rejection_sample(p, drafts, q, u_accept, torch.rand(batch, generator=generator))

    def lowest_argmax(row):
        row = row.tolist()
        return row.index(max(row))

    for b in range(batch):
        assert drafts[b].tolist() == [lowest_argmax(draft_logits[b, i]) for i in range(k)]
        a = 0
        while a < k and drafts[b, a] == lowest_argmax(target_logits[b, a]):
            a += 1
        final = lowest_argmax(target_logits[b, a])
        assert num_accepted[b] == a
        assert tokens[b].tolist() == drafts[b, :a].tolist() + [final] * (k + 1 - a)


def test_rejection_sample_accepts_everything_when_draft_equals_target():
    generator = torch.Generator().manual_seed(7)
    batch, k, vocab = 4096, 3, 9
    p = random_probs((batch, k + 1, vocab), generator, zero_fraction=0.3)
    q = p[:, :k].clone()
    drafts = draft_from(q, generator)
    u_accept = torch.rand(batch, k, generator=generator)
    u_accept[::3] = LARGEST_F32_BELOW_ONE
    num_accepted, tokens = rejection_sample(p, drafts, q, u_accept, torch.rand(batch, generator=generator))
    assert (num_accepted == k).all()
    assert torch.equal(tokens[:, :k], drafts)
    assert (p[:, k].gather(-1, tokens[:, k:]) > 0).all()


# --- distribution ----------------------------------------------------------------------------


def chi_square_p_value(samples, probs):
    """Goodness-of-fit p-value of integer samples against probs [V] (all positive)."""
    return chi_square(torch.bincount(samples, minlength=len(probs)), probs)


def emitted_tokens(k, trials, seed, resample_from_target=False):
    """Run N speculative trials with position-wise p_j, q_j that ignore the prefix.

    With ``resample_from_target`` the correction after a rejection is drawn from p_a instead
    of the residual: a classic bug that the distribution test must catch.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = 6
    p_rows = torch.softmax(torch.randn(k + 1, vocab, generator=generator), -1)
    q_rows = torch.softmax(1.5 * torch.randn(k, vocab, generator=generator), -1)
    p = p_rows.expand(trials, -1, -1)
    q = q_rows.expand(trials, -1, -1)
    drafts = draft_from(q, generator)
    u_final = torch.rand(trials, generator=generator)
    num_accepted, tokens = rejection_sample(p, drafts, q, torch.rand(trials, k, generator=generator), u_final)
    if resample_from_target:
        rows = p.gather(1, num_accepted.view(-1, 1, 1).expand(-1, 1, vocab)).squeeze(1)
        final = sample_from_probs(rows, u_final)
        rejected = num_accepted < k
        arange = torch.arange(k + 1)
        tokens = torch.where(rejected[:, None] & (arange >= num_accepted[:, None]), final[:, None], tokens)
    return p_rows, q_rows, num_accepted, tokens


# Each call below asserts at family-wise false-failure rate 1e-4: Bonferroni over the K+1
# positions, alpha = 1e-4 / (K+1) per position (the seeds are fixed, so a pass is stable).
FAMILY_ALPHA = 1e-4
TRIALS = 40_000


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sample_preserves_target_distribution(k):
    p_rows, q_rows, num_accepted, tokens = emitted_tokens(k, TRIALS, seed=100 + k)
    alpha = FAMILY_ALPHA / (k + 1)
    for j in range(k + 1):
        emitted = tokens[num_accepted >= j, j]
        assert len(emitted) > 2000
        assert chi_square_p_value(emitted, p_rows[j]) > alpha, f"position {j} is not distributed as p_{j}"
    # Acceptance at position i, given it is reached, is sum_v min(p_i, q_i) (binomial, 6 sigma).
    for i in range(k):
        reached = num_accepted >= i
        rate = (num_accepted[reached] > i).double().mean().item()
        beta = torch.minimum(p_rows[i], q_rows[i]).sum().item()
        sigma = math.sqrt(beta * (1 - beta) / int(reached.sum()))
        assert abs(rate - beta) < 6 * sigma


@pytest.mark.parametrize("k", [1, 3])
def test_distribution_test_has_power(k):
    p_rows, q_rows, num_accepted, tokens = emitted_tokens(k, TRIALS, seed=100 + k)
    alpha = FAMILY_ALPHA / (k + 1)
    # The drafts' own distribution is not the target's.
    assert chi_square_p_value(tokens[num_accepted >= 0, 0], q_rows[0]) < alpha
    # Correcting from p_a instead of the residual skews every non-bonus position.
    p_rows, _, num_accepted, tokens = emitted_tokens(k, TRIALS, seed=100 + k, resample_from_target=True)
    for j in range(k):
        assert chi_square_p_value(tokens[num_accepted >= j, j], p_rows[j]) < alpha


# --- compile -------------------------------------------------------------------------------


def verify_step(target_logits, draft_logits, temperature, top_k, top_p, u_draft, u_accept, u_final):
    """A target_verify-shaped step: filter both distributions, draft, verify."""
    batch, k = draft_logits.shape[:2]
    drafts, q = [], []
    for i in range(k):
        d, q_i = draft_sample(draft_logits[:, i], temperature, top_k, top_p, u_draft[:, i])
        drafts.append(d)
        q.append(q_i)
    expand = lambda x: x.unsqueeze(1).expand(batch, k + 1)  # noqa: E731
    p = processed_probs(target_logits, expand(temperature), expand(top_k), expand(top_p))
    num_accepted, tokens = rejection_sample(p, torch.stack(drafts, 1), torch.stack(q, 1), u_accept, u_final)
    return num_accepted, tokens, p


def test_compiled_matches_eager():
    generator = torch.Generator().manual_seed(3)
    batch, k, vocab = 4, 2, 16
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    draft_logits = target_logits[:, :k] + 0.5 * torch.randn(batch, k, vocab, generator=generator)
    args = (
        target_logits,
        draft_logits,
        torch.tensor([0.0, 0.7, 1.0, 1.3]),
        torch.tensor([0, 5, 0, 3]),
        torch.tensor([1.0, 0.9, 0.5, 1.0]),
        torch.rand(batch, k, generator=generator),
        torch.rand(batch, k, generator=generator),
        torch.rand(batch, generator=generator),
    )
    torch._dynamo.reset()
    compiled = torch.compile(verify_step, fullgraph=True, dynamic=False)
    expected = verify_step(*args)
    actual = compiled(*args)
    assert torch.equal(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-5, atol=1e-6)


# --- the fused verify op ---------------------------------------------------------------------


@st.composite
def verify_cases(draw):
    """Everything verify_sample reads, drawn: logits [B, K+1, V] with ties, mixed per-request
    parameters, drafts that are the target's argmax or anything, q one-hot (greedy drafts) or spread."""
    batch, k, vocab = draw(st.integers(1, 4)), draw(st.integers(0, 3)), draw(st.integers(1, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 3
    if draw(st.booleans()):
        logits = logits.round()  # exact ties
    params = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                st.integers(0, vocab + 1),
                st.sampled_from([1.0, 0.9, 0.5, 0.05]),
            ),
            min_size=batch,
            max_size=batch,
        )
    )
    temperature, top_k, top_p = (torch.tensor(v) for v in zip(*params))
    drafts, q, noise = drafts_and_noise(draw, logits, gen, agree=0.6)
    return logits, temperature.float(), top_k.long(), top_p.float(), drafts, q, noise


def drafts_and_noise(draw, logits: torch.Tensor, gen: torch.Generator, agree: float):
    """For logits [B, K+1, V]: drafts [B, K] that are the target's argmax with probability `agree`
    (else anything), q one-hot (greedy drafts) or spread, and uniforms [B, K+1]."""
    batch, rows, vocab = logits.shape
    k = rows - 1
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1)
    if draw(st.booleans()):
        q = torch.zeros_like(q).scatter(-1, q.argmax(-1, keepdim=True), 1.0)
    drafts = torch.where(
        torch.rand(batch, k, generator=gen) < agree,
        logits[:, :k].argmax(-1),
        torch.randint(0, vocab, (batch, k), generator=gen),
    )
    noise = torch.tensor(draw(st.lists(uniforms, min_size=batch * rows, max_size=batch * rows))).view(
        batch, rows
    )
    return drafts, q, noise


@SETTINGS
@given(verify_cases())
def test_fused_verify_op_gives_the_traced_tokens(case):
    """Also with fewer spare buckets past the cut, so top-k/top-p rows take the candidate sort with
    candidates that only just decide the cut, and (SPARE_BUCKETS < 0) often the full sort."""
    from unittest import mock

    from compiled_mtp.graphs.sampling import verify_sample
    from compiled_mtp.ops import verify_sample as kernel

    expected = verify_sample(*case)
    for spare in (kernel.SPARE_BUCKETS, 0, -3):
        with mock.patch.object(kernel, "SPARE_BUCKETS", spare):
            got = kernel.verify_sample(*case)
            # the C++ op hands a batch that is not all greedy to the one above, and takes the rest itself
            native = torch.ops.compiled_mtp.greedy_verify_sample(*case)
        for result in (got, native):
            assert torch.equal(expected[0], result[0]) and torch.equal(expected[1], result[1]), spare


@SETTINGS
@given(verify_cases())
def test_fused_draft_op_gives_the_traced_drafts(case):
    """The draft op on the first row of each drawn verify case: the traced definition's tokens, and
    its q up to rounding (also with candidates that only just decide a top-k/top-p cut)."""
    from unittest import mock

    from compiled_mtp.graphs.sampling import draft_sample
    from compiled_mtp.ops import draft_sample as draft_kernel
    from compiled_mtp.ops import verify_sample as kernel

    logits, temperature, top_k, top_p, _, _, noise = case
    args = (logits[:, 0], temperature, top_k, top_p, noise[:, 0])
    tokens, q = draft_sample(*args)
    for spare in (kernel.SPARE_BUCKETS, 0, -3):
        with mock.patch.object(kernel, "SPARE_BUCKETS", spare):
            got_tokens, got_q = draft_kernel.draft_sample(*args)
            # the C++ op hands a batch that is not all greedy to the one above, and takes the rest itself
            native_tokens, native_q = torch.ops.compiled_mtp.greedy_draft_sample(*args)
        assert torch.equal(tokens, got_tokens) and torch.equal(tokens, native_tokens), spare
        torch.testing.assert_close(got_q, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(native_q, q, rtol=1e-5, atol=1e-6)


@st.composite
def greedy_cases(draw):
    """A batch of greedy requests for the C++ path: vocabularies within one vector, over several
    blocks and over several threads' parts of a row; ties with the row's maximum, NaN and infinities
    at drawn places (also whole rows of -inf); drafts that are the argmax or anything; and 1-8 threads
    (more threads than rows split each row)."""
    batch, k = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    vocab = draw(st.sampled_from([1, 5, 513, 1500, 40001, 40001]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    rows = logits.view(-1, vocab)
    specials = st.tuples(
        st.integers(0, len(rows) - 1),
        st.integers(0, vocab - 1),
        st.sampled_from(["tie", "nan", "inf", "-inf", "-inf row"]),
    )
    for row, at, kind in draw(st.lists(specials, max_size=6)):
        if kind == "-inf row":
            rows[row] = -math.inf
        else:
            rows[row, at] = rows[row].max() if kind == "tie" else float(kind)
    drafts, q, noise = drafts_and_noise(draw, logits, gen, agree=0.7)
    params = torch.zeros(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch)
    return (logits, *params, drafts, q, noise), draw(st.sampled_from([1, 2, 3, 8]))


@contextlib.contextmanager
def threads(count: int):
    """torch's thread count set to `count` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@SETTINGS
@given(greedy_cases())
def test_greedy_batches_take_the_cpp_path_with_the_traced_tokens(case):
    """The verify op, and the draft ops on each request's first row, for batches of greedy requests:
    the C++ paths (ops/csrc/greedy_sample.cpp) take them, and give the definition's tokens and q,
    as the draft op's general path does."""
    from unittest import mock

    from compiled_mtp.graphs.sampling import draft_sample, verify_sample
    from compiled_mtp.ops import draft_sample as draft_kernel
    from compiled_mtp.ops import verify_sample as kernel

    args, num_threads = case
    logits, temperature, top_k, top_p, _, _, noise = args
    draft_args = (logits[:, 0], temperature, top_k, top_p, noise[:, 0])
    with threads(num_threads):
        with mock.patch.object(kernel, "verify_by_kind", wraps=kernel.verify_by_kind) as general:
            native = torch.ops.compiled_mtp.greedy_verify_sample(*args)
        assert not general.called  # the C++ path took the batch
        expected, got = verify_sample(*args), kernel.verify_sample(*args)
        (tokens, q), (got_tokens, got_q) = draft_sample(*draft_args), draft_kernel.draft_sample(*draft_args)
        native_tokens, native_q = torch.ops.compiled_mtp.greedy_draft_sample(*draft_args)
    for result in (got, native):
        assert torch.equal(expected[0], result[0]) and torch.equal(expected[1], result[1])
    assert torch.equal(tokens, got_tokens) and torch.equal(q, got_q)
    assert torch.equal(tokens, native_tokens) and torch.equal(q, native_q)


def test_greedy_path_leaves_sampled_batches_and_other_dtypes_to_the_general_path():
    """compiled_mtp::greedy_verify_sample, which verify graphs call on CPU: a sampled request or
    bfloat16 logits send the batch to compiled_mtp::verify_sample, whose results it returns; a
    greedy float32 batch stays in C++."""
    from unittest import mock

    from compiled_mtp.ops import verify_sample as kernel

    gen = torch.Generator().manual_seed(0)
    logits, q, noise = (
        torch.randn(2, 3, 50, generator=gen),
        torch.rand(2, 2, 50, generator=gen),
        torch.rand(2, 3, generator=gen),
    )
    drafts = logits[:, :2].argmax(-1)
    params = torch.zeros(2, dtype=torch.long), torch.ones(2)
    cases = {
        "sampled": (logits, torch.tensor([0.0, 0.7]), *params, drafts, q, noise),
        "bfloat16": (logits.bfloat16(), torch.zeros(2), *params, drafts, q.bfloat16(), noise),
        "greedy": (logits, torch.zeros(2), *params, drafts, q, noise),
    }
    for name, args in cases.items():
        expected = kernel.verify_sample(*args)
        with mock.patch.object(kernel, "verify_by_kind", wraps=kernel.verify_by_kind) as general:
            got = torch.ops.compiled_mtp.greedy_verify_sample(*args)
        assert general.called == (name != "greedy"), name
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]), name
