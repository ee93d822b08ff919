"""mtp_depth="auto": the depth policy's choices from measured costs and acceptance (the engine's
greedy exactness and distribution under auto are in test_engine.py and test_distribution.py)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compiled_mtp.depth_policy import CALIBRATE_AFTER, NO_HOLD, DepthPolicy, expected_tokens

rates_st = st.lists(st.floats(0, 1), min_size=4, max_size=4)


@given(rates=rates_st, depth=st.integers(0, 4))
def test_expected_tokens_sums_the_chances_of_reaching_each_position(rates, depth):
    brute = 1 + sum(math.prod(rates[: j + 1]) for j in range(depth))
    assert expected_tokens(rates, depth) == pytest.approx(brute)
    assert 1 <= expected_tokens(rates, depth) <= depth + 1
    assert expected_tokens(rates, depth) >= expected_tokens(rates, max(depth - 1, 0))


def _measured(policy: DepthPolicy, bucket: int, costs: dict[int, float], timings: int | None = None) -> None:
    """Each depth's cost timed `timings` times (default: a whole window, so that no depth is probed
    for a cost its few timings might have put too high)."""
    for k, seconds in costs.items():
        policy.record_cost(bucket, k, 100.0)  # the first call compiles: never counted
        policy.record_cost(bucket, k, 50.0)  # the second runs on emptied caches: never counted
        for _ in range(policy.cost_window if timings is None else timings):
            policy.record_cost(bucket, k, seconds)


def _served(
    policy: DepthPolicy,
    bucket: int,
    rates: list[list[float]],
    steps: int,
    seconds: Callable[[int, int], float],
    remaining: list[int] | None = None,
) -> list[int]:
    """The depths the policy chooses over `steps` steps, each timed at seconds(step, depth), for
    requests that each still want `remaining` tokens (default: one request wanting 100)."""
    chosen = []
    for step in range(steps):
        k = policy.choose(bucket, rates, remaining or [100])
        chosen.append(k)
        policy.record_cost(bucket, k, seconds(step, k))
    return chosen


def test_every_depth_is_measured_before_any_is_chosen_on_merit():
    """Each key's two untimed calls run back to back (a load, then a run on the caches it emptied);
    then every key's first timed step, in a row, so that they meet the machine at one speed. A step
    after a change of depth is not timed, so each key runs twice there."""
    policy = DepthPolicy((0, 1, 3))
    tried = []
    for _ in range(12):
        k = policy.choose(1, [[0.9] * 3], [100])
        tried.append(k)
        policy.record_cost(1, k, 0.001)
    assert tried == [0, 0, 1, 1, 3, 3, 0, 0, 1, 1, 3, 3]
    assert policy._timed == set() and policy.values(1, [[0.9] * 3], [100])
    assert policy.choose(2, [[0.9] * 3], [100]) == 0  # another bucket is measured on its own


@given(
    costs=st.lists(st.floats(1e-4, 1e-2), min_size=4, max_size=4),
    rates=st.lists(rates_st, min_size=1, max_size=4),
    remaining=st.one_of(
        st.lists(st.integers(1, 64), min_size=4, max_size=4), st.integers(1, 64).map(lambda n: [n] * 4)
    ),
    current=st.integers(0, 3),
)
def test_choice_is_the_best_value_unless_the_current_one_is_within_the_margin(
    costs, rates, remaining, current
):
    policy = DepthPolicy((0, 1, 2, 3), margin=0.03, zero_margin=0.05)
    _measured(policy, 4, dict(enumerate(costs)))
    policy.current = current
    remaining = remaining[: len(rates)]
    tokens = {k: sum(min(expected_tokens(r, k), n) for r, n in zip(rates, remaining)) for k in range(4)}
    value = {k: tokens[k] / costs[k] for k in range(4)}
    chosen = policy.choose(4, rates, remaining)
    best = max(value.values())
    top = max(range(4), key=lambda k: value[k])
    margin = 0.05 if 0 in (top, current) else 0.03  # a change to or from depth 0 needs more
    if value[current] * (1 + margin) >= best:
        assert chosen == current
    else:
        assert value[chosen] == best


def test_speculation_is_chosen_when_it_pays_and_dropped_when_it_does_not():
    policy = DepthPolicy((0, 1, 2, 3))
    _measured(policy, 1, {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7})
    assert policy.choose(1, [[0.9, 0.8, 0.7]], [100]) == 3  # 3.23 tokens for 1.7 against 1 for 1.0
    assert policy.choose(1, [[0.1, 0.1, 0.1]], [100]) == 0  # drafts rejected: K=0 wins
    assert policy.choose(1, [[0.9, 0.8, 0.7]], [1]) == 0  # one token left: drafting cannot help


def test_each_bucket_holds_its_own_depth():
    """A batch of 4 holds depth 0, 3% ahead of depth 1: within the margin for a change to or from
    depth 0. Its last request then runs alone, at depth 3. Back at 4 requests, the margin counts
    from the depth the bucket of 4 held, not from the lone request's depth 3."""
    policy = DepthPolicy((0, 1, 3))
    policy.current = 0
    _measured(policy, 4, {0: 1.0, 1: 1.79, 3: 3.0})  # at 4 requests of rate 0.84: 1.84 tokens for 1.79
    _measured(policy, 1, {0: 1.0, 1: 1.2, 3: 1.5})
    four, one = [[0.84, 0.7, 0.6]] * 4, [[0.84, 0.7, 0.6]]
    assert policy.choose(4, four, [50, 51, 52, 53]) == 0  # 4 against 4 * 1.84 / 1.79 = 4.11: held
    assert policy.choose(1, one, [40]) == 3
    assert policy.choose(4, four, [30, 31, 32, 33]) == 0  # from depth 3, depth 1 would have been best
    assert policy.choose(1, one, [20]) == 3


def test_costs_follow_the_measurements():
    """Depth 2 became slow and depth 0 did not. Depth 2's own steps cannot tell that from a slower
    machine; the next steps of depth 0, timed against them, can. A probe runs two steps and times the
    second. A cost is the median of its timings, so the first probe's cannot outvote the first
    timing: the second probe's does."""
    policy = DepthPolicy((0, 2), probe_every=4, probe_most=4, close=0.0)
    _measured(policy, 1, {0: 1.0, 2: 1.2}, timings=1)
    true_cost = {0: 1.0, 2: 3.0}  # for 1.75 tokens at depth 2, 1 at depth 0
    chosen = _served(policy, 1, [[0.5, 0.5]], 14, lambda step, k: true_cost[k])
    assert chosen == [2] * 4 + [0] * 2 + [2] * 4 + [0] * 4  # 1.75 / 1.2 > 1 / 1.0, until 0 ran twice


def test_the_first_step_after_a_change_times_no_cost():
    """A step after a change of depth takes 1.3x a held one. Depth 1 beats depth 0 by 23% when held
    (1.6 tokens for 1.3 against 1 for 1.0), but by its first steps it would lose (1.6 for 1.69): a
    probe runs two steps and times only the second, so the policy leaves depth 0 at its first probe
    (depth 1's cost the median of 1.69 and 1.3), then holds depth 1 and probes depth 0, two steps at
    a time."""
    policy = DepthPolicy((0, 1), probe_every=8, probe_most=8, close=0.0)
    _measured(policy, 1, {0: 1.0, 1: 1.69}, timings=1)  # depth 1 timed at a first step
    policy.current = 0
    true_cost, last = {0: 1.0, 1: 1.3}, [0]

    def seconds(step: int, k: int) -> float:
        changed, last[0] = last[0] != k, k
        return true_cost[k] * (1.3 if changed else 1.0)

    chosen = _served(policy, 1, [[0.6]], 40, seconds)
    assert chosen[:16] == [0] * 8 + [1] * 8 and policy.current == 1
    runs = [len(list(run)) for k, run in itertools.groupby(chosen[16:]) if k == 0]
    assert runs and set(runs) == {2}  # probes only


def test_a_slower_machine_changes_no_choice():
    """Depth 3 is 5% better than depth 2. The machine then runs 1.5 times slower for 20 steps, and
    the probe of depth 2 falls there: timed against depth 3's steps of the same moment, it stays
    behind. Averaging the probe's raw time with depth 2's cost from the fast moment would put depth 2
    ahead (1.1 against depth 3's 1.56)."""
    policy = DepthPolicy((2, 3), close_probe_every=8, backoff=0)
    _measured(policy, 1, {2: 1.0, 3: 1.04})
    true_cost, rates = {2: 1.0, 3: 1.04}, [[0.86, 0.62, 0.42]]  # 2.39 tokens for 1.0, 2.62 for 1.04
    chosen = _served(policy, 1, rates, 60, lambda step, k: true_cost[k] * (1.5 if 4 <= step < 24 else 1.0))
    assert set(chosen) == {2, 3} and policy.current == 3
    probes = [step for step, k in enumerate(chosen) if k == 2]
    assert probes == [s + i for s in range(8, 60, 10) for i in (0, 1)]  # probes of two steps only


def test_near_depths_take_turns_at_one_close_probe_cadence():
    """Depths 1, 2 and 4 are each within 5% of depth 3's value (1.9 tokens for 0.64, 2.62 for 0.883,
    3.42 for 1.154, against 3.12 for 1.0). Probed every close_probe_every = 8 steps each, they would
    run a probe every third step; as near depths they share that cadence, each probed every 3 x 8
    steps, most valuable first, two steps a probe: the probes of a 26-step cycle are 6 of its steps."""
    costs = {1: 0.64, 2: 0.883, 3: 1.0, 4: 1.154}
    policy = DepthPolicy((1, 2, 3, 4), close_probe_every=8, backoff=0)
    policy.current = 3
    _measured(policy, 1, costs)
    chosen = _served(policy, 1, [[0.9, 0.8, 0.7, 0.6]], 120, lambda step, k: costs[k])
    cycle = [4, 4, 1, 1, 2, 2]
    probes = [(step, k) for step, k in enumerate(chosen) if k != 3]
    assert probes == [(start + i, k) for start in (24, 50, 76, 102) for i, k in enumerate(cycle)]


def test_a_near_tie_that_keeps_losing_its_probes_waits_longer_after_each():
    """Depth 3 is 5% better than depth 2, a near tie probed every close_probe_every = 8 steps. Each
    probe that depth 2 loses doubles its wait, up to 2**backoff = 4 times. At step 80 depth 3 turns
    10% slower; depth 3's own steps read that as the machine's speed, and depth 2's next probes,
    timed against them, would win on their own timing. Depth 2 lost its probes before, so they keep
    its 32-step wait, and the third such timing outvotes the older ones: the depth changes. Depth 3,
    held until then and now the near tie, waits 8 steps, then 16."""
    policy = DepthPolicy((2, 3), margin=0.02, close_probe_every=8, backoff=2)
    _measured(policy, 1, {2: 1.0, 3: 1.04})
    rates = [[0.86, 0.62, 0.42]]  # 2.39 tokens for 1.0, 2.62 for 1.04
    chosen = _served(
        policy, 1, rates, 200, lambda step, k: 1.0 if k == 2 else 1.04 * (1.1 if step >= 80 else 1)
    )
    starts = [step for step in range(1, 200) if chosen[step] != chosen[step - 1]]
    assert starts[:12:2] == [8, 26, 60, 94, 128, 162]  # 8, 16, 32, then 32 steps after each probe
    assert chosen[162:170] == [2] * 8  # the third probe since step 80 won
    assert starts[11::2] == [170, 188]


def test_a_batchs_last_steps_at_depth_0_keep_the_near_ties_waits():
    """As above, depth 2 a near tie of depth 3, but every 30 steps the batch's request wants one
    token more for two steps, as a batch's last steps do, and depth 0 runs them. Those changes of
    depth are no probe lost or won: depth 2's wait still doubles after each probe it loses, up to
    32 steps."""
    costs = {0: 0.5, 2: 0.883, 3: 1.0}
    policy = DepthPolicy((0, 2, 3), margin=0.02, close_probe_every=8, backoff=2, probe_every=1000)
    policy.current = 3
    _measured(policy, 1, costs)
    chosen = []
    for step in range(200):
        chosen.append(policy.choose(1, [[0.9, 0.8, 0.7]], [1 if step % 30 >= 28 else 100]))
        policy.record_cost(1, chosen[-1], costs[chosen[-1]])
    assert [step for step, k in enumerate(chosen) if k == 0] == [
        s + i for s in range(28, 200, 30) for i in (0, 1)
    ]
    probes = [step for step in range(1, 200) if chosen[step] == 2 != chosen[step - 1]]
    assert probes == [8, 26, 60, 94, 128, 162, 196]


def test_a_stretch_held_on_a_requests_rates_keeps_the_near_ties_waits():
    """Depth 1 is a near tie of depth 2 (2.375 against 2.575) and loses its probes at steps 8 and
    26. In a stretch of hard text (steps 60-69), the request's rates make depth 1 worth more, and it
    is held; then depth 2 again. Depth 1 won no probe, so its wait stays at 32 steps."""
    costs = {1: 0.8, 2: 1.0}
    policy = DepthPolicy((1, 2), margin=0.02, close_probe_every=8, backoff=2, probe_every=1000)
    policy.current = 2
    _measured(policy, 1, costs)
    chosen = []
    for step in range(160):
        rates = [0.9, 0.2] if 60 <= step < 70 else [0.9, 0.75]
        chosen.append(policy.choose(1, [rates], [100]))
        policy.record_cost(1, chosen[-1], costs[chosen[-1]])
    assert chosen[60:72] == [1] * 10 + [2] * 2
    assert [step for step in range(1, 160) if chosen[step] == 1 != chosen[step - 1]] == [8, 26, 60, 102, 136]


def test_each_depth_is_valued_at_its_own_steps_acceptance():
    """Steps at depth 3 accept their first draft more often (0.9) than steps at depth 1 (0.7):
    each depth's steps start at different places in the text. Pooled rates would value depth 1
    best; each depth's own history shows depth 3 is."""
    policy = DepthPolicy((1, 3), close=0.0)
    _measured(policy, 1, {1: 1.0, 3: 1.5})
    random = np.random.default_rng(0)
    for _ in range(200):
        policy.observe([[0.5] * 3], 1, [int(random.random() < 0.7)])
        first, second, third = random.random(3) < [0.9, 0.6, 0.5]
        policy.observe([[0.5] * 3], 3, [first * (1 + second * (1 + third))])
    pooled = policy.prior()
    assert expected_tokens(pooled, 3) / 1.5 < expected_tokens(pooled, 1) / 1.0
    scale = policy.calibration()
    assert scale[1] < 1 < scale[3]
    assert policy.choose(1, [pooled], [100]) == 3


def test_a_depth_that_lost_on_a_stale_cost_is_measured_again():
    """Depth 0 was measured once, slow (the machine was busy), so depth 1 won and depth 0 never ran
    again. Every probe_every steps the runner-up runs two steps, the second timed; its cost is the
    median of its timings, so the second fresh one outvotes the stale one, and the policy moves to it,
    then keeps probing the depth it left."""
    policy = DepthPolicy((0, 1), probe_every=8, probe_most=8, close=0.0)  # no near tie (next test)
    _measured(policy, 4, {0: 10.0, 1: 2.0}, timings=1)
    true_cost = {0: 1.0, 1: 2.0}  # 1 token for 1.0 beats 1.84 for 2.0
    chosen = _served(policy, 4, [[0.84]], 40, lambda step, k: true_cost[k])
    assert chosen[:20] == ([1] * 8 + [0] * 2) * 2  # the probes of the stale depth, 10 steps apart
    assert chosen[20] == 0 and policy.current == 0  # the second fresh timing won
    assert chosen[20:].count(1) == 4 and chosen[-1] == 0  # a probe of depth 1 every 10 steps


def test_a_depth_behind_the_runner_up_on_a_stale_cost_is_measured_again():
    """Depth 2 was measured once, slow (6.0 for a true 3.9), which put it behind depth 3 as well as
    depth 1; probing only the runner-up (depth 3) would never run it again. Every depth not run for
    probe_every steps runs a probe, the runner-up first, and depth 2's fresh costs win at its second
    probe, when they outvote the stale one."""
    policy = DepthPolicy((1, 2, 3), margin=0.02, probe_every=8, probe_most=8, close=0.0)  # no near tie
    _measured(policy, 4, {1: 3.0, 2: 6.0, 3: 5.0}, timings=1)
    true_cost, rates = {1: 3.0, 2: 3.9, 3: 5.0}, [[0.84, 0.74, 0.58]]  # 1.84, 2.46 and 2.82 tokens
    chosen = _served(policy, 4, rates, 26, lambda step, k: true_cost[k])
    probes = [3, 3, 2, 2]  # the runner-up, then the stalest, two steps each
    assert chosen[:12] == [1] * 8 + probes and chosen[18:22] == probes
    assert chosen[22:26] == [2] * 4 and policy.current == 2  # 2.46 / 3.9 beats 1.84 / 3.0 by 3%


@pytest.mark.parametrize("close", [0.1, 0.0])
def test_a_near_tie_is_probed_often_and_its_cost_taken_over_the_probes(close):
    """Depth 3 is 5% better than depth 2, but its one measurement came on a slow moment (1.15 for a
    true 1.04), which puts it 5% behind. Within `close` of the current depth, it runs every
    close_probe_every steps, its cost the median of its timings, until it wins (and depth 2, now the
    near runner-up, is probed in turn); without the rule its next measurement is 64 steps away."""
    policy = DepthPolicy((2, 3), margin=0.02, close=close, close_probe_every=4, probe_every=64, backoff=0)
    _measured(policy, 1, {2: 1.0, 3: 1.15})
    true_cost, rates = {2: 1.0, 3: 1.04}, [[0.86, 0.62, 0.42]]  # 2.39 tokens for 1.0, 2.62 for 1.04
    chosen = _served(policy, 1, rates, 40, lambda step, k: true_cost[k])
    if close:
        assert chosen[:12] == ([2] * 4 + [3] * 2) * 2  # a probe of two steps after every 4
        assert policy.current == 3 and chosen[-12:] == ([3] * 4 + [2] * 2) * 2
    else:
        assert chosen == [2] * 40


def test_one_timing_in_a_fast_moment_moves_no_choice():
    """Depth 3 is 5% better than depth 2, and both have been timed several times at their true costs.
    Then one probe of depth 2 falls in a moment twice as fast: its cost is the median of its last
    timings, so the outlier leaves it where it was (an average weighing it 0.2 put depth 2 ahead)."""
    policy = DepthPolicy((2, 3), margin=0.02, close_probe_every=4, backoff=0)
    _measured(policy, 1, {2: 1.0, 3: 1.04})
    true_cost, rates = {2: 1.0, 3: 1.04}, [[0.86, 0.62, 0.42]]  # 2.39 tokens for 1.0, 2.62 for 1.04
    chosen = _served(policy, 1, rates, 16, lambda step, k: true_cost[k])
    assert chosen.count(2) == 4 and policy.current == 3  # two probes, each timed at its true cost
    fast = iter([1.0, 0.5])  # the next probe of depth 2 only, its second step: the one timed
    chosen = _served(policy, 1, rates, 20, lambda step, k: true_cost[k] * (next(fast, 1.0) if k == 2 else 1))
    assert chosen.count(2) == 8 and policy.current == 3  # four probes only


@given(accepted=st.integers(0, 3), depth=st.integers(1, 3), rates=rates_st)
def test_observe_updates_only_the_tested_positions(accepted, depth, rates):
    accepted = min(accepted, depth)
    policy = DepthPolicy((0, 1, 2, 3, 4))
    before = list(rates)
    policy.observe([rates], depth, [accepted])
    tested = min(accepted + 1, depth)
    for j in range(4):
        if j >= tested:
            assert rates[j] == before[j]
        elif j < accepted:
            assert before[j] <= rates[j] <= 1
        else:
            assert 0 <= rates[j] <= before[j]
    prior = policy.prior()
    assert len(prior) == 4 and all(0 < p < 1 for p in prior)


@given(steps=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=4)), max_size=40))
def test_the_pooled_counts_tally_every_step_of_every_depth(steps):
    """counts() over steps of any depth and batch: position j of a request's step at depth K was tested
    where K > j and every draft before it was accepted, and accepted where the request accepted more
    than j drafts."""
    policy = DepthPolicy((0, 1, 2, 3))
    tested, hits = [0] * 3, [0] * 3
    for depth, accepted in steps:
        accepted = [min(a, depth) for a in accepted]
        policy.observe([[0.5] * 3 for _ in accepted], depth, accepted)
        for a in accepted:
            for j in range(depth):
                tested[j] += j <= a
                hits[j] += j < a
    assert policy.counts() == (tested, hits)


def test_a_far_depth_is_probed_as_often_as_its_loss_allows():
    """K=0 wins by far, as at a large batch: a step of depth 3 takes 4.0 for 2.05 tokens, which take
    2.05 at depth 0 (a loss of 1.95), a probe runs two such steps, and leaving depth 0 runs a catch-up
    of 1.2 first. At probe_share 2%, which the two other depths share, 1% of the steps' time a probe:
    depth 3 would wait 510 steps, capped at probe_most = 200; depth 1, losing 2 x 0.2 + 1.2, waits 160
    (159.99..., the floats' rounding); without the catch-up, probe_every = 64."""
    rates = [[0.6, 0.5, 0.5]]  # 1.6 tokens at depth 1, 2.05 at depth 3
    true_cost = {0: 1.0, 1: 1.8, 3: 4.0}
    policy = DepthPolicy((0, 1, 3), probe_share=0.02, probe_most=200, close=0.0)
    _measured(policy, 8, true_cost)
    for seconds in (5.0, 5.0, 1.2):  # the first two calls are never counted
        policy.record_catch_up(8, seconds)
    chosen = _served(policy, 8, rates, 420, lambda step, k: true_cost[k])
    probes = {k: [step for step, c in enumerate(chosen) if c == k] for k in (1, 3)}
    assert probes[1] == [159, 160, 321, 322] and probes[3] == [200, 201, 402, 403]
    policy = DepthPolicy((0, 1, 3), probe_share=0.02, probe_most=200, close=0.0)
    _measured(policy, 8, true_cost)
    chosen = _served(policy, 8, rates, 140, lambda step, k: true_cost[k])
    assert [step for step, c in enumerate(chosen) if c == 1] == [64, 65, 130, 131]


@given(steps=st.lists(st.tuples(st.sampled_from([0, 1, 3]), st.integers(0, 3), st.booleans()), max_size=150))
def test_calibration_is_recomputed_once_a_64th_more_drafts_were_tested(steps):
    """Asked between observations or not, calibration() is what the counts gave when the drafts
    tested since were at most a 64th of those tested then (while fewer than 64: none)."""
    policy = DepthPolicy((0, 1, 3))
    fresh = {0: policy._calibrate()}  # by drafts tested
    for depth, accepted, ask in steps:
        policy.observe([[0.5] * 3], depth, [min(accepted, depth)])
        fresh[policy._observed] = policy._calibrate()
        if ask:
            policy.calibration()
        now = policy._observed
        assert any(policy.calibration() == c for n, c in fresh.items() if now <= n + n // CALIBRATE_AFTER)


@pytest.mark.parametrize(
    ("rates", "current", "catch_up", "probes"),
    [([0.75], 0, 0.52, [140, 141, 282, 283]), ([0.9], 1, 1.0, [115, 116, 232, 233])],
)
def test_a_near_tie_across_depth_0_is_probed_as_its_catch_up_allows(rates, current, catch_up, probes):
    """Depths 0 and 1 are within 5% of each other, as on the shipped model at B=4. A probe of depth 1
    from depth 0 runs a catch-up first, and one of depth 0 from depth 1 a catch-up at the next step
    back: not a near tie's almost free step (every close_probe_every = 16), so the loss rule spaces
    them. A probe runs two steps. Depth 1 at 0.951 against depth 0's 1.0 loses 2 x 1.84 x 0.049 +
    0.52 a probe: 140 steps of 1.0 at 0.5%. Depth 0 at 1.0 against 1.033 loses 2 x 0.032 + 1.0: 115
    steps of 1.84."""
    true_cost = {0: 1.0, 1: 1.84}
    policy = DepthPolicy((0, 1), zero_margin=0.05, close_probe_every=16, probe_share=0.005, probe_most=256)
    _measured(policy, 4, true_cost)
    for seconds in (5.0, 5.0, catch_up):  # the first two are never counted
        policy.record_catch_up(4, seconds)
    chosen = _served(policy, 4, [rates], 300, lambda step, k: true_cost[k])
    assert policy.current == current
    assert [i for i, k in enumerate(chosen) if k != current] == probes


@pytest.mark.parametrize(
    ("remaining", "depth", "spacing"),
    [([100], 1, 240), ([100], 3, 1700), ([100, 99], 1, 640), ([100, 99], 3, 2400), ([100, 100], 3, 2400)],
)
def test_a_probe_from_depth_0_of_a_batch_counts_its_whole_extra_cost(remaining, depth, spacing):
    """Depths 1 and 3 are behind depth 0 (1.5 tokens for 1.8 and 1.875 for 4.0, against 1 for 1.0).
    A probe runs two steps, and the two deeper depths' probes share one budget, probe_share 0.005:
    0.0025 each. A lone request's probe of depth 3 loses 2 x 4.0 x (1 - 0.469) = 4.25, so it runs
    every 1700 steps; depth 1's loses 2 x 0.3, 240 steps. A batch of several requests ends with its
    slowest one, which a probe's step moves on by one token unless every request has a draft
    accepted: its loss is its whole cost beyond depth-0 steps, 2 x 0.8 and 2 x 3.0: 640 and 2400
    steps."""
    costs = {0: 1.0, 1: 1.8, 3: 4.0}
    policy = DepthPolicy((0, 1, 3), probe_share=0.005, probe_every=64, probe_most=4096)
    policy.current = 0
    _measured(policy, 2, costs)
    chosen = []
    for _ in range(5000):
        k = policy.choose(2, [[0.5] * 3] * len(remaining), remaining)
        chosen.append(k)
        policy.record_cost(2, k, costs[k])
    probes = [step for step, k in enumerate(chosen) if k == depth]
    assert len(probes) >= 4 and {b - a for a, b in itertools.pairwise(probes)} == {1, spacing + 1}


@pytest.mark.parametrize("true_cost", [1.5, 3.0])
def test_a_depth_whose_last_timing_would_win_is_probed_again_soon(true_cost):
    """Depth 1 was timed once slow (3.0), so depth 0 holds: 1 token for 1.0 against 1.84 for 3.0. A
    probe of depth 1, two steps, loses 2 x 3.0 x (1 - 0.613) = 2.32, so it waits 464 steps at
    probe_share 0.005. If it comes out at 1.5, depth 1 would win on that timing alone, but the median
    of [3.0, 1.5] does not let it: the next probe comes twice close_probe_every steps later (the
    probe it lost doubles the wait), and its timing, the second of three, moves the policy to depth 1.
    There depth 0, whose cost rests on one timing that may be 25% high (1.33 against depth 1's 1.227
    and the margin), is probed 16 steps later; its second timing leaves no such hope, and probe_every
    spaces the next. If depth 1 comes out at 3.0 again, the loss rule spaces its next probe."""
    policy = DepthPolicy((0, 1), close=0.0, probe_every=64, close_probe_every=16, probe_share=0.005)
    _measured(policy, 4, {0: 1.0, 1: 3.0}, timings=1)
    costs = {0: 1.0, 1: true_cost}
    chosen = _served(policy, 4, [[0.84]], 700, lambda step, k: costs[k])
    probes = [step for step, k in enumerate(chosen) if k == 1]
    if true_cost < 1.84:
        assert probes[:4] == [464, 465, 498, 499]
        assert policy.current == 1 and chosen[498:514] == [1] * 16
        depth_0_probes = [514, 515, 580, 581, 646, 647]
        assert [step for step, k in enumerate(chosen) if k == 0 and step >= 498] == depth_0_probes
    else:
        assert policy.current == 0 and probes == [464, 465]


def test_a_probe_across_depth_0_comes_soon_only_if_its_last_timing_would_change_the_depth():
    """As above, but depth 1's probe comes out at 1.786, 3% better than depth 0 on that timing alone:
    within zero_margin, so it would not change the depth. A probe across depth 0 runs a catch-up,
    so the next one waits the loss rule's 221 steps (then 64, on the median of three), not 16."""
    policy = DepthPolicy((0, 1), close=0.0, probe_every=64, close_probe_every=16, probe_share=0.005)
    _measured(policy, 4, {0: 1.0, 1: 3.0}, timings=1)
    costs = {0: 1.0, 1: 1.786}
    chosen = _served(policy, 4, [[0.84]], 800, lambda step, k: costs[k])
    assert [step for step, k in enumerate(chosen) if k == 1] == [464, 465, 687, 688, 753, 754]
    assert policy.current == 0


@pytest.mark.parametrize("true_cost", [1.5, 2.0])
def test_a_depth_timed_slow_on_few_steps_is_probed_soon_while_its_spread_could_win(true_cost):
    """Four requests at depth 0, depth 1 timed once in a slow moment at 2.0: 7.36 tokens for 2.0
    against 4 for 1.0, 8% behind, short of the margin (4.24). Its probe from depth 0 of a batch
    counts its whole extra cost, 2 x (2.0 - 1.0), so the loss rule alone waits 400 steps (spread=0).
    But a cost timed once may be 25% too high (spread / sqrt(n) for the median of n timings): at 1.5
    it would win, so it is probed at the near-tie cadence (16 steps, doubled for each probe lost)
    until the median of three timings moves the policy to it. Where 2.0 was its true cost, the hope
    shrinks with each timing, and after three probes the loss rule spaces the next. No depth is a
    near tie here (close=0); with close=0.1, 8% behind is one, and it waits as without the spread."""
    costs = {0: 1.0, 1: true_cost}
    probes = {}
    for spread, close in ((0.25, 0.0), (0.0, 0.0), (0.25, 0.1)):
        policy = DepthPolicy((0, 1), close=close, probe_every=64, close_probe_every=16, spread=spread)
        _measured(policy, 4, {0: 1.0, 1: 2.0}, timings=1)
        chosen = _served(policy, 4, [[0.84]] * 4, 700, lambda step, k: costs[k], remaining=[100] * 4)
        probes[spread, close] = [step for step, k in enumerate(chosen) if k == 1]
    if true_cost == 1.5:
        assert probes[0.25, 0.0][:5] == [16, 17, 50, 51, 52] and probes[0.25, 0.0][-1] == 699  # held from 50
        assert probes[0.0, 0.0][:3] == [400, 401, 434]
    else:
        assert probes[0.25, 0.0] == [16, 17, 50, 51, 116, 117, 518, 519]
        assert probes[0.0, 0.0] == [400, 401]
    assert probes[0.25, 0.1][:3] == probes[0.0, 0.0][:3]  # its first probe as late


def _serve_both(seed: int, batch: int, rates: list[float], costs: dict[int, float], steps: int):
    """A policy serving batches of requests (seeded acceptance, step times off their cost by up to
    30%, a catch-up before a step at K > 0 after depth 0, requests of 20-120 tokens joining a batch of
    up to `batch` as others finish, in buckets 1, 2, 4 and 8), driven as the runtime drives it (after
    a choice, its `repeats` next steps of the same batch run without a call, their times reported at
    the next call), beside a twin asked at every step that works every choice out afresh. Returns
    each step's pair of choices, how many steps repeated a choice unasked, and both policies."""
    # Every choice held only while all its inputs stand (next test for those held while rates move).
    policy, fresh = DepthPolicy((0, 1, 2, 3), recheck_every=1), DepthPolicy((0, 1, 2, 3))
    random = np.random.default_rng(seed)
    requests: list[list] = []  # [wanted, policy's rates, twin's rates]
    pairs, repeated, pending, left, unasked, last = [], 0, [], 0, (0, 0), None
    for _ in range(steps):
        while len(requests) < batch and (not requests or random.random() < 0.2):  # batches part and fill
            requests.append([int(random.integers(20, 120)), policy.prior(), fresh.prior()])
            left = 0  # a request joined: another batch
        bucket = next(b for b in (1, 2, 4, 8) if b >= len(requests))
        remaining = [r[0] for r in requests]
        repeat = left > 0
        if repeat:
            left, k = left - 1, unasked[1]
        else:
            policy.record_repeats(*unasked, pending)
            pending = []
            k = policy.choose(bucket, [r[1] for r in requests], remaining)
            left, unasked = policy.repeats, (bucket, k)
        fresh._hold = NO_HOLD
        pairs.append((k, fresh.choose(bucket, [r[2] for r in requests], remaining)))
        if k and last == 0:
            seconds = float(random.uniform(0.5, 1.5))
            policy.record_catch_up(bucket, seconds)
            fresh.record_catch_up(bucket, seconds)
        seconds = costs[k] * float(random.uniform(0.7, 1.3))
        accepted = [next((j for j in range(k) if random.random() >= rates[j]), k) for _ in requests]
        if repeat:  # a depth-0 step: no draft tested
            pending.append(seconds)
            repeated += 1
        else:
            policy.observe([r[1] for r in requests], k, accepted)  # one call a step, as the runtime makes it
            policy.record_cost(bucket, k, seconds)
        fresh.observe([r[2] for r in requests], k, accepted)
        fresh.record_cost(bucket, k, seconds)
        for r, a in zip(requests, accepted):
            r[0] -= min(r[0], a + 1)
        staying = [r for r in requests if r[0] > 0 and random.random() > 0.01]  # some stop early
        left = left if len(staying) == len(requests) else 0
        requests, last = staying, k
    policy.record_repeats(*unasked, pending)
    return pairs, repeated, policy, fresh


@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.sampled_from([1, 4, 8]),
    rates=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    zero_cost=st.floats(0.2, 2.0),
)
def test_a_held_choice_is_the_one_worked_out_afresh(seed, batch, rates, zero_cost):
    """Repeating the last choice while its inputs stand (a batch at depth 0, no probe due), asked or
    unasked (`repeats`), chooses exactly what working every choice out afresh does, step for step,
    and leaves the policy's step counts, costs and speeds as that does."""
    costs = {0: zero_cost, 1: 1.4, 2: 1.8, 3: 2.2}
    pairs, _, policy, fresh = _serve_both(seed, batch, rates, costs, 300)
    assert [a for a, _ in pairs] == [b for _, b in pairs]
    assert (policy._steps, policy._cost, policy._speed) == (fresh._steps, fresh._cost, fresh._speed)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_held_choice_is_the_one_worked_out_afresh_in_near_ties(batch):
    """Depth 0 and depth 1 near a tie, as at B=4 on the shipped model: the noisy timings move the
    choice back and forth, and each new cost or catch-up timing must end a hold."""
    for seed in range(20):
        pairs, *_ = _serve_both(seed, batch, [0.8, 0.6, 0.5], {0: 1.0, 1: 1.8, 2: 2.3, 3: 2.7}, 300)
        assert [a for a, _ in pairs] == [b for _, b in pairs], f"seed {seed}"


def _served_lone(recheck_every: int) -> tuple[list[int], list[int]]:
    """A lone request's depths over 60 steps, every draft accepted for 31 steps and none after, and
    the steps at which its choice was worked out."""
    policy = DepthPolicy((0, 1, 2, 3), recheck_every=recheck_every, close=0.0, probe_every=1000)
    costs = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7}
    _measured(policy, 1, costs)
    chosen: list[int] = []
    worked: list[int] = []
    valued = policy._valued
    policy._valued = lambda *args: worked.append(len(chosen)) or valued(*args)  # type: ignore[method-assign]
    rates = [0.9, 0.8, 0.7]
    for step in range(60):
        k = policy.choose(1, [rates], [100])
        chosen.append(k)
        policy.observe([rates], k, [k if step < 31 else 0])
        policy.record_cost(1, k, costs[k])
    return chosen, worked


def test_at_k_above_0_a_choice_is_worked_out_again_every_recheck_every_steps():
    """At K > 0 the rates move at every step. With nothing else moving, the choice is worked out at
    every 4th step, and when acceptance collapses the depth drops at most 3 steps after it does for a
    policy that works every choice out."""
    chosen, worked = _served_lone(4)
    every, every_worked = _served_lone(1)
    assert chosen[:30] == every[:30] == [3] * 30 and every_worked[:30] == list(range(30))
    assert [step for step in worked if step < 30] == list(range(0, 30, 4))
    fresh_drop = next(step for step, k in enumerate(every) if k != 3)
    drop = next(step for step, k in enumerate(chosen) if k != 3)
    assert 31 < fresh_drop < drop <= fresh_drop + 3  # 41 and 44: worked out at step 40, then 44


def test_a_choice_holds_through_last_tokens_until_they_could_change_it():
    """Eight requests at depth 1 (the others' costs far off, no probe due), reaching their last
    tokens one after another: the caps take tokens from every depth, and the choice is worked out
    again only when the held depth's capped tokens fall to where another depth's value at the last
    working-out could beat it (step 12: depth 2's), and at step 21, when depth 0 wins. A twin working
    every choice out afresh chooses the same at every step."""
    costs = {0: 1.0, 1: 1.2, 2: 1.9, 3: 2.6}
    policy, fresh = (DepthPolicy((0, 1, 2, 3), probe_every=10**4, close_probe_every=10**4) for _ in range(2))
    for p in (policy, fresh):
        _measured(p, 8, costs)
    worked: list[int] = []
    valued = policy._valued
    policy._valued = lambda *args: worked.append(step) or valued(*args)  # type: ignore[method-assign]
    rates = [[0.8, 0.7, 0.6] for _ in range(8)]
    chosen, twin = [], []
    for step in range(24):
        remaining = [max(1, 4 + 3 * i - step) for i in range(8)]  # request i's last token at step 3 + 3i
        fresh._hold = NO_HOLD
        chosen.append(policy.choose(8, rates, remaining))
        twin.append(fresh.choose(8, rates, remaining))
        policy.record_cost(8, chosen[-1], costs[chosen[-1]])
        fresh.record_cost(8, twin[-1], costs[twin[-1]])
    assert chosen == twin == [1] * 21 + [0] * 3
    assert worked == [0, 12, 21]  # every step from the 2nd on, when a binding cap ended a hold


def test_a_batch_holding_depth_0_works_its_choice_out_only_when_a_probe_falls_due():
    """K=0 wins by far (a large batch), by more than one timing 30% off can hide: most steps repeat
    the held choice without asking the policy; the rest time each bucket's depths first, or come
    after a request left or joined, or with a probe due."""
    pairs, repeated, _, _ = _serve_both(1, 8, [0.6, 0.5, 0.4], {0: 1.0, 1: 3.0, 2: 4.0, 3: 5.0}, 400)
    assert [a for a, _ in pairs] == [b for _, b in pairs]
    assert sum(a == 0 for a, _ in pairs) > 360 and repeated > 250
