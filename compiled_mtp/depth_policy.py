"""`mtp_depth="auto"`: each decode step's depth, chosen from measured step cost and live acceptance.

Before a step the runtime asks for the depth K, among the captured ones, that maximises expected
committed tokens per second for the batch now running:

    value(K) = sum over requests of min(E_K(request), tokens it still wants) / cost(bucket, K)

E_K = (1 + a_1 + a_1 a_2 + ... + a_1..a_K) * c_K, where a_j is the request's chance that draft j is
accepted given that draft j - 1 was: an exponential moving average over the request's own steps
(`request_alpha` a step: a larger weight lets one rejection move a lone request off the best depth;
benchmarks/auto_simulate.py), started from the runtime's history (accepted over proposed at each
position, smoothed towards the position before). The same position accepts at different rates at
different depths, because each depth's steps start at different places in the text, so c_K scales the
request's rates by how much more (or less) the runtime's steps at depth K have committed than its steps
at every depth: the ratio of the two histories' expected tokens, depth K's shrunk towards the pooled one
by PSEUDO_STEPS.

cost(bucket, K) is a key's wall time at a reference speed of the machine, the first UNTIMED_CALLS left
out: the first compiles or loads the graphs, and the second runs on the caches that loading emptied (up
to 60% slower than the steps after it, here). The machine's speed itself moves by half within a fraction
of a second here, so a cost is only compared with costs taken at the same speed: a step at the depth the
bucket holds updates the bucket's speed (its time over its key's cost), and a probe's step updates its
key's cost: the median of the key's last `cost_window` timings, each over the speed of its moment. Only
steps at the depth of the bucket's step before them are timed. The first step after a change takes
longer than the held steps after it (at B=4 here, a change from depth 0 up 1.12-1.22x: the Python
between the graphs and the graphs themselves run on caches the other depth's steps filled), and costs
taken from first steps favoured whichever depth was held: every other depth's cost carried its first
step's extra time. At B=4 they put K=1, K=2 and K=3 at 1.85x, 2.33x and 2.82x K=0's cost, where auto's
own held steps at B=4 took 1.58x and 2.12x for K=1 and K=2, and auto held K=0, 0.82x the best fixed
depth. So a probe runs `probe_steps` steps at its depth, and the first is not timed; nor is the first
step after a change of the held depth. One step's time is off the next one's by 20-30% here: in a trace
at B=4, one K=1 step timed in a slow moment replaced K=1's cost (3.87 ms at the reference speed, then
5.13) and moved auto to K=0 and K=2 for the rest of a round in which K=1 was the fastest fixed depth. A
key never run is tried before any choice is made from the others, so every cost is measured, never typed
in: each key's two untimed calls run back to back, then each key's first timed step (its second after
the change to it), one key after another, at one speed. The depth changes only when another's value
beats the current one's by `margin` (hysteresis: a near tie is within the noise of the estimates; at 2%,
a lone request's rates moved it from K=3 to K=2, 0.93x as fast, on a quarter of its steps), or by
`zero_margin` for a change to or from depth 0, which costs more than the steps it is timed on: leaving
depth 0 first runs the MTP catch-up, and the requests of a batch that drafts finish at different steps,
so its last steps run the bucket for fewer rows. The current depth is each bucket's own: a batch whose
last request runs alone at depth 3 comes back to its own depth 0 with the margin counted from there.

A batch of several requests finishes when its last request does, and at K > 0 its requests commit
random numbers of tokens, so they part and the batch's last steps run for its last requests alone, on
a smaller bucket's graphs. So no depth is charged for that tail at the full bucket's cost (which held
depth 0 where drafting paid: benchmarks/README.md, "Auto without the tail valuation"); `zero_margin`
stands for the catch-up and the parting.

A cost is only as current as the last step run at that key: a depth that lost once would never be
measured again. So every depth not run for `probe_every` steps of a bucket runs a probe; the depths
within `close` of the current one's value take turns, one every `close_probe_every` steps (each every
close_probe_every times their number): a near tie is what one noisy measurement decides wrongly, and a
probe of a depth worth nearly as much costs little, though not nothing, since a step after a change of
depth runs slower. Probed every close_probe_every steps each, the three or four near ties of depths
0-6 at B=1 took 6-8 of every 22-24 steps. So each probe that a near depth loses (the bucket holds
another depth after it) doubles that depth's wait, up to 2**`backoff` times, until it wins one:
where several depths nearly tie, probes at one cadence put a large share of auto's steps at depths
other than the one it held (benchmarks/README.md, "Near ties that keep losing"), and each probe is
two changes of depth. A change of depth for any other reason keeps the waits: a batch's last steps,
whose requests want fewer tokens than a deeper step drafts, change the depth to 0 and back, and a
lone request's rates move it to a shallower depth in hard text and back, every few dozen steps at
B=1, without any probe lost or won.

A depth whose last timing alone would beat the current one waits no longer than a lone near tie
would, close_probe_every steps doubled for each probe it lost in a row, however far behind its median
puts it: two more timings outvote the older ones. Not doubled, that wait cost auto 0.7 points where
depths tie within the noise of one timing (K=0, K=1 and K=2 at B=4 here): some depth's last timing
beats the current one's cost most of the time, and its probes came every close_probe_every steps,
each two changes of depth (benchmarks/README.md, "Probes of a near tie's fast timing"). Across
depth 0 such a probe runs a catch-up, so there the last timing must beat the current depth by the
margin a change needs: where depths nearly tie with K=0 a step (B=4 here), one fast timing each
would have them probed every 16 steps, a catch-up each.
Of the depths due, the most valuable runs first.

A cost taken from few timings may itself be one slow moment's: a depth timed once at 1.3x its true
cost, far enough behind to be spaced by the loss rule below, waited 400-2000 steps for its next
probe, and a runtime could hold the wrong depth for all of a bench's rounds. So while fewer than
cost_window timings make the cost of a depth more than `close` behind, it is also probed at the near
ties' doubled cadence where it would beat the current depth by the margin a change needs at the
cheapest cost those timings allow: `spread` (25%) below one timing, spread / sqrt(n) below the
median of n. Each such probe adds a timing, until the cost is settled or the hope fails: a depth
that truly loses stops after one to three. Simulated on two bench runs' step times, each step off
its cost by up to 20%, at B = 1, 4 and 8 over 32 seeds each, auto's runs below 0.93x the best fixed
depth on the same seed went from 31 to 19 of 384 (benchmarks/README.md, "Hope for a depth timed on
few steps").

A probe of a depth far behind costs more: its steps take longer than the current depth would for the
same tokens. So does any probe across depth 0, near tie or not: leaving depth 0 first runs the MTP
catch-up (whose time the runtime reports), and so does the first step back at K > 0 after a probe of
depth 0. Such a depth waits, beyond `probe_every`, until its probe's loss is at most `probe_share`
of the time of the steps since its last one, but never more than `probe_most` steps: where K=0 wins
by far (a large batch), three probes of deeper steps every 64 cost several percent, and where K=1
ties with K=0, a catch-up every 16 steps costs about as much. A probe from depth 0 of a batch of
several requests costs its whole time beyond a depth-0 step: the batch ends with its slowest request,
which the probe's step moves on by one token, as a depth-0 step would, unless every request has a
draft accepted; the other requests' extra tokens end no step sooner. The other depths' probes share
one probe_share between them, so that holding a depth costs the same whatever the depths captured.
probe_most bounds how stale a cost may grow. Where a deeper depth loses by far, the loss rule asks
for more: 3000-4000 steps for K=2 and K=3 at B=8 here, each probe a catch-up and two steps of 3-4
depth-0 steps' time. Bounded at 512 steps, those probes cost auto a point more than at 2048 there
(benchmarks/README.md, "Probes of a near tie's fast timing").

Working a choice out takes tens of microseconds of Python at a large batch, about 2% of its step.
A batch holding depth 0 moves none of the choice's inputs (its steps test no draft and, steady, time
no cost anew), so until a probe falls due, a request leaves or joins, or a cost or catch-up is timed
anew, the policy repeats its choice without working it out again: the same choice, exactly. Requests
nearing their last tokens only take tokens away from every depth (each request's count is capped at
what it still wants), so a held choice stands while the held depth's capped tokens stay above what
would keep every other depth's value at the choice, now an upper bound, behind it by the margin
(`_need`). So probes are scheduled on the values without the caps, which a batch's last tokens leave
as they are, and a probe that falls due waits while a cap binds its depth's tokens (benchmarks/
README.md, "Choices held through a batch's last tokens"). At K > 0 every step tests drafts, so the
rates move at every step. Each step moves a request's rate at a position by request_alpha at most,
and the choice changes only when another depth's value beats the current one's by the margin, so
while nothing but the rates and the drafts tested move, the choice is worked out again every
`recheck_every` steps: a change of depth comes up to recheck_every - 1 steps late.

Even a repeated choice costs two calls a step on caches the step's graphs have just emptied. So a
choice that holds depth 0 also says how many of the batch's next steps repeat it (`repeats`: those
before the next probe falls due and before its first request's last token; at depth 0 every request
counts one token a step, so no cap ends the hold sooner), and a runtime runs them without asking,
until a request joins or leaves, and reports their times at its next call (`record_repeats`), which
keeps the step counts and the machine's speed as calls at every step would.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from functools import partial
from operator import is_

Key = tuple[int, int]  # (bucket, depth)
# A choice's bucket and cost changes, the requests' rate lists, the drafts tested by then, each
# request's expected tokens at the held depth, the fewest of those (each capped at what its request still
# wants) that keep the held depth ahead of every other, the last step it holds to, and the last it holds
# to while the rates move.
Hold = tuple[object, tuple[Sequence[float], ...], int, tuple[float, ...], float, float, float]
NO_HOLD: Hold = (None, (), -1, (), math.inf, -math.inf, -math.inf)
UNTIMED_CALLS = 2  # a key's first calls, never counted in its cost
PSEUDO_STEPS = 16  # the pooled history's weight, in steps, in a depth's own acceptance rates
CALIBRATE_AFTER = 64  # calibration() is worked out again after a 64th more drafts were tested


def expected_tokens(rates: Sequence[float], depth: int) -> float:
    """Expected tokens a step at `depth` commits, for conditional acceptance rates per position."""
    return _expected_by_depth(rates, depth)[depth]


def _expected_by_depth(rates: Sequence[float], depth: int) -> list[float]:
    """expected_tokens(rates, k) for every k in 0..depth, in one pass."""
    out, reach = [1.0], 1.0
    for rate in rates[:depth]:
        reach *= rate
        out.append(out[-1] + reach)
    return out + [out[-1]] * (depth + 1 - len(out))


class DepthPolicy:
    """Chooses decode depths and learns from each step's acceptance and wall time."""

    def __init__(
        self,
        depths: Sequence[int],
        *,
        request_alpha: float = 0.15,
        cost_window: int = 5,
        speed_alpha: float = 0.3,
        margin: float = 0.06,
        zero_margin: float = 0.06,
        probe_every: int = 64,
        close: float = 0.1,
        close_probe_every: int = 16,
        probe_share: float = 0.005,
        probe_most: int = 2048,
        probe_steps: int = 2,
        recheck_every: int = 32,
        backoff: int = 3,
        spread: float = 0.25,
    ) -> None:
        self.depths = tuple(sorted(depths))
        self.request_alpha = request_alpha
        self.cost_window = cost_window
        self.speed_alpha = speed_alpha
        self.margin = margin
        self.zero_margin = zero_margin
        self.probe_every = probe_every
        self.close = close
        self.close_probe_every = close_probe_every
        self.probe_share = probe_share
        self.probe_most = probe_most
        self.probe_steps = probe_steps
        self.recheck_every = recheck_every
        self.backoff = backoff
        self.spread = spread
        self.current = self.depths[-1]  # the depth held by the bucket of the last choice
        self._held_by: dict[int, int] = {}  # the depth each bucket holds
        self._soonest = min(close_probe_every, probe_every)  # no depth is probed sooner
        self._timed: set[int] = set()  # buckets whose every key has a cost
        self._changes = 0  # costs and catch-ups measured anew: the choice's inputs besides a batch's
        self._hold: Hold = NO_HOLD  # the last choice's inputs, their cap and the step it holds to
        # The next steps of the last choice's batch that repeat it without a call (record_repeats).
        self.repeats = 0
        self._cost: dict[Key, float] = {}  # seconds at the bucket's speed 1
        self._speed: dict[int, float] = {}  # each bucket's time over its keys' costs, lately
        self._last: dict[int, int] = {}  # the depth of each bucket's last step
        # Each bucket's probe in progress: its depth, and the bucket's step count when it ends.
        self._probing: dict[int, tuple[int, int]] = {}
        # Each key's probes lost in a row: after each, its bucket held another depth.
        self._lost: Counter[Key] = Counter()
        self._seen: Counter[Key] = Counter()
        self._steps: Counter[int] = Counter()  # choices made per bucket
        # The bucket's step count when each key's cost was last measured.
        self._measured_at: dict[Key, int] = {}
        # Drafts proposed and accepted at each position, by the depth of the step.
        self._proposed = {k: [0] * k for k in self.depths}
        self._accepted = {k: [0] * k for k in self.depths}
        self._observed = 0  # drafts tested so far: calibration() changes only with them
        self._calibrated: tuple[int, dict[int, float]] = (-1, {})
        self._catch_up: dict[int, float] = {}  # each bucket's MTP catch-up, seconds at its speed 1
        # Each key's last cost_window timings at its speed 1, and each bucket's catch-ups'.
        window: partial[deque[float]] = partial(deque, maxlen=cost_window)
        self._samples: defaultdict[Key, deque[float]] = defaultdict(window)
        self._catch_up_samples: defaultdict[int, deque[float]] = defaultdict(window)
        self._catch_ups: Counter[int] = Counter()

    def counts(self) -> tuple[list[int], list[int]]:
        """Drafts proposed and accepted at each position, over the steps of every depth."""
        n = self.depths[-1]
        return (
            [sum(p[j] for p in self._proposed.values() if j < len(p)) for j in range(n)],
            [sum(a[j] for a in self._accepted.values() if j < len(a)) for j in range(n)],
        )

    def prior(self) -> list[float]:
        """Acceptance per position from every step so far, each smoothed towards the one before."""
        rates, previous = [], 0.5
        for proposed, accepted in zip(*self.counts()):
            previous = (accepted + 2 * previous) / (proposed + 2)
            rates.append(previous)
        return rates

    def calibration(self) -> dict[int, float]:
        """c_K for every depth: expected tokens from depth K's own steps over those from all steps.
        Computed again once the drafts tested since the last time reach a CALIBRATE_AFTER-th of those
        tested by then: each draft moves it by about that share at most, and working it out at every
        step took about a third of the policy's time on the host at B=1."""
        last = self._calibrated[0]
        if self._observed > last + last // CALIBRATE_AFTER:
            self._calibrated = (self._observed, self._calibrate())
        return self._calibrated[1]

    def _calibrate(self) -> dict[int, float]:
        pooled = self.prior()
        base = _expected_by_depth(pooled, self.depths[-1])
        out = {}
        for k in self.depths:
            own = [
                (a + PSEUDO_STEPS * r) / (p + PSEUDO_STEPS)
                for p, a, r in zip(self._proposed[k], self._accepted[k], pooled)
            ]
            out[k] = expected_tokens(own, k) / base[k]
        return out

    def observe(self, rates: Sequence[list[float]], depth: int, accepted: Sequence[int]) -> None:
        """A step at `depth` in which request i accepted accepted[i] drafts: update its rates[i] in
        place, and the history: the rate lists are the policy's to change, and choose() takes them as
        observe() left them. Positions past a request's first rejection were not tested and stay
        as they were. One call a step, not one a request: each call on the caches the step's graphs
        have just emptied costs microseconds."""
        alpha, proposed, hits = self.request_alpha, self._proposed[depth], self._accepted[depth]
        for own, a in zip(rates, accepted):
            tested = min(a + 1, depth)
            self._observed += tested
            for j in range(tested):
                hit = j < a
                proposed[j] += 1
                hits[j] += hit
                own[j] += alpha * (hit - own[j])

    def record_cost(self, bucket: int, depth: int, seconds: float) -> None:
        """A step's wall time. Only a step at the depth of the bucket's step before it counts: the
        first step after a change takes longer than the held steps after it (the module's docstring)."""
        key = (bucket, depth)
        self._seen[key] += 1
        steady, self._last[bucket] = self._last.get(bucket) == depth, depth
        if self._seen[key] <= UNTIMED_CALLS or not steady:
            # The first loads the key's graphs, the next runs on caches the load emptied, and a step
            # after a change of depth runs on caches the other depth's steps filled.
            return
        speed = self._speed.get(bucket, 1.0)
        if key in self._cost and depth == self._held_by.get(bucket):  # the machine's speed moved
            self._speed[bucket] = speed + self.speed_alpha * (seconds / self._cost[key] - speed)
        else:
            self._cost[key] = self._median_of(self._samples[key], seconds / speed)
            self._changes += 1
        self._measured_at[key] = self._steps[bucket]

    def record_catch_up(self, bucket: int, seconds: float) -> None:
        """The wall time of an MTP catch-up before a step of `bucket` (its first calls not counted)."""
        self._catch_ups[bucket] += 1
        if self._catch_ups[bucket] > UNTIMED_CALLS:
            cost = seconds / self._speed.get(bucket, 1.0)
            self._catch_up[bucket] = self._median_of(self._catch_up_samples[bucket], cost)
            self._changes += 1

    @staticmethod
    def _median_of(samples: deque[float], sample: float) -> float:
        """The median of the last `cost_window` samples, `sample` the newest: one step timed in a
        slow or fast moment moves it only within the others."""
        samples.append(sample)  # the oldest drops out at maxlen
        return statistics.median(samples)

    def expected(self, rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> dict[int, float]:
        """Tokens a batch is expected to commit in one step at each depth: its requests' rates,
        calibrated for the depth, each request's count capped at the tokens it still wants."""
        return {k: sum(map(min, column, remaining)) for k, column in zip(self.depths, self._columns(rates))}

    def _columns(self, rates: Sequence[Sequence[float]]) -> list[tuple[float, ...]]:
        """For each depth, each request's expected tokens a step there, uncapped."""
        scale, depths = self.calibration(), self.depths
        rows = []
        for r in rates:
            e = _expected_by_depth(r, depths[-1])
            rows.append([e[k] * scale[k] for k in depths])
        return list(zip(*rows)) or [()] * len(depths)

    def choose(self, bucket: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> int:
        """The depth for the next step of a batch in `bucket`: its requests' rates and wanted tokens."""
        # A held choice first, with the fewest lookups (the step's graphs have just emptied the
        # caches): a hold is made only where no probe starts, and its requests fix its bucket. They are
        # known by their own rate lists, by identity: a request that left or joined ends a hold, however
        # alike the rates (its cap holds the choice only while its tokens wanted fall). Only observe()
        # changes a rate, so the rates stand while no draft was tested since.
        self.repeats = 0  # but for a choice worked out below that holds depth 0
        inputs = (bucket, self._changes)
        held, held_rates, observed, mine, need, until, settled = self._hold
        step = self._steps[bucket] + 1
        if (
            inputs == held
            and len(rates) == len(held_rates)
            and all(map(is_, rates, held_rates))
            and step <= until
            and sum(map(min, mine, remaining)) >= need
            and (step <= settled or self._observed == observed)
        ):
            self._steps[bucket] = step
            return self.current
        depth, end = self._probing.get(bucket, (-1, -1))
        if self._steps[bucket] < end and self._last.get(bucket) == depth:  # the probe's timed steps
            self._steps[bucket] += 1
            return depth
        if bucket not in self._timed:
            loading = [k for k in self.depths if self._seen[bucket, k] < UNTIMED_CALLS]
            untried = [k for k in self.depths if (bucket, k) not in self._cost]
            if loading or untried:
                return (loading or untried)[0]  # each key's first timing back to back, at one speed
            self._timed.add(bucket)  # a cost, once measured, is only ever replaced
        # The choice rests on the requests' rates, the drafts tested, the costs and, through the cap,
        # the tokens each still wants (the module's docstring: a batch holding depth 0 moves none).
        self.current = self._held_by.get(bucket, self.current)
        value, ahead, columns = self._valued(bucket, rates, remaining)
        best = max(value, key=value.__getitem__)
        if value[best] > value[self.current] * (1 + self._margin(best)):
            self.current = best
        self._judge_probe(bucket)
        self._held_by[bucket] = self.current
        self._steps[bucket] += 1
        near = self._near(ahead)
        due = {
            k: self._due_after(bucket, k, ahead, remaining, near) for k in self.depths if k != self.current
        }
        # A probe waits while a request's cap binds its depth's tokens: its steps would commit fewer
        # than that depth is worth (benchmarks/README.md, "Choices held through a batch's last tokens").
        probes = [k for k, after in due.items() if self._steps[bucket] > after and value[k] == ahead[k]]
        until = min(due.values(), default=math.inf)
        settled = self._steps[bucket] + self.recheck_every - 1
        mine, need = columns[self.depths.index(self.current)], self._need(bucket, value)
        now = (inputs, tuple(rates), self._observed, mine, need, until, settled)
        self._hold = NO_HOLD if probes else now
        self.repeats = 0 if probes or self.current else self._repeats_of(bucket, until, remaining)
        probe = max(probes, key=ahead.__getitem__, default=self.current)
        if probe != self.current:
            self._probing[bucket] = (probe, self._steps[bucket] + self.probe_steps - 1)
        return probe

    def _need(self, bucket: int, value: dict[int, float]) -> float:
        """The fewest expected tokens at the current depth, each request's capped at the tokens it
        still wants, with which no other depth's value in `value` beats the current one's by the margin
        a change needs. As requests near their last tokens, caps only take tokens away, so no other
        depth's value rises above `value`'s while the held depth keeps these."""
        cost = self._cost[bucket, self.current]
        others = (value[k] / (1 + self._margin(k)) for k in self.depths if k != self.current)
        return cost * max(others, default=-math.inf) * (1 + 1e-9)  # the last factor against rounding

    def _repeats_of(self, bucket: int, until: float, remaining: Sequence[int]) -> int:
        """How many of the batch's next steps a depth-0 hold just made repeats: those up to `until`, and
        before its first request's last token (a request that finishes changes the batch, and the
        runtime asks again). At depth 0 each running request counts one token a step, so no cap ends
        such a hold."""
        last = min(remaining, default=1) - 1
        if until < math.inf:
            last = min(last, math.floor(until) - self._steps[bucket])
        return max(last, 0)

    def record_repeats(self, bucket: int, depth: int, seconds: Sequence[float]) -> None:
        """Steps run at `depth` as `repeats` allowed, without calling choose(), each's wall time in
        order: the bookkeeping choose() and record_cost() keep for each (a held choice's step count,
        the machine's speed). A runtime holding depth 0 so saves two calls a step on caches the step's
        graphs have just emptied (benchmarks/README.md, "Repeats of a depth-0 hold")."""
        for step_seconds in seconds:
            self._steps[bucket] += 1
            self.record_cost(bucket, depth, step_seconds)

    def _judge_probe(self, bucket: int) -> None:
        """After the bucket's probe, if one just ended: the probed depth lost once more, or won (the
        bucket holds it) and starts afresh."""
        probed, _ = self._probing.pop(bucket, (None, None))
        if probed == self.current:
            del self._lost[bucket, probed]
        elif probed is not None:
            self._lost[bucket, probed] += 1

    def values(
        self, bucket: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]
    ) -> dict[int, float]:
        """Each depth's expected tokens a second for a batch in `bucket` (every key timed): its
        expected tokens a step over the key's cost."""
        return self._valued(bucket, rates, remaining)[0]

    def _valued(
        self, bucket: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]
    ) -> tuple[dict[int, float], dict[int, float], list[tuple[float, ...]]]:
        """values(); the same without the caps, on which probes are scheduled (a batch's last tokens
        say nothing of what a depth costs); and _columns()."""
        columns, depths = self._columns(rates), self.depths
        costs = [self._cost[bucket, k] for k in depths]
        value = {k: sum(map(min, c, remaining)) / cost for k, c, cost in zip(depths, columns, costs)}
        ahead = {k: sum(c) / cost for k, c, cost in zip(depths, columns, costs)}
        return value, ahead, columns

    def _margin(self, k: int) -> float:
        """How much better depth k's value must be than the current depth's to replace it."""
        return self.zero_margin if 0 in (k, self.current) else self.margin

    def _near(self, value: dict[int, float]) -> list[int]:
        """The depths within `close` of the current one's value, on its side of depth 0 (a probe across
        depth 0 runs a catch-up: it costs more than a near tie's step)."""
        current = value[self.current]
        return [
            k
            for k in self.depths
            if k != self.current and value[k] * (1 + self.close) >= current and 0 not in (k, self.current)
        ]

    def _due_after(
        self, bucket: int, k: int, value: dict[int, float], remaining: Sequence[int], near: list[int]
    ) -> float:
        """The bucket's step after which a probe of depth k is due (at the shortest wait when that
        has not passed yet, without working out which wait applies). The `near` depths take turns:
        each is probed every close_probe_every steps times their number, doubled for each probe it
        lost in a row (up to `backoff` times). A depth that would win at its last timing, or at a cost
        its few timings allow (_hopes), waits the doubled close_probe_every alone."""
        measured = self._measured_at[bucket, k]
        if self._steps[bucket] - measured <= self._soonest:
            return measured + self._soonest
        soon = self.close_probe_every << min(self._lost[bucket, k], self.backoff)
        every = soon * len(near) if k in near else self._far_every(bucket, k, value, remaining)
        last = value[k] * self._cost[bucket, k] / self._samples[bucket, k][-1]  # valued at its last timing
        # Across depth 0 a probe runs a catch-up: worth it where its last timing would change the
        # depth, not merely beat the current one.
        needed = self._margin(k) if 0 in (k, self.current) else 0.0
        if last > value[self.current] * (1 + needed) or self._hopes(bucket, k, value):
            every = min(every, soon)  # its last timing alone, or a cost its few timings allow, would win
        return measured + every

    def _hopes(self, bucket: int, k: int, value: dict[int, float]) -> bool:
        """Whether depth k, more than `close` behind the current depth while fewer than cost_window
        timings make its cost, would beat it by the margin a change needs at the cheapest cost those
        timings allow: `spread` below one timing, spread / sqrt(n) below the median of n. Not a closer
        depth: a near tie takes its turns anyway, and one across depth 0 would have a probe, a
        catch-up each, every 16 steps where the two tie."""
        samples, current = self._samples[bucket, k], value[self.current]
        if len(samples) >= self.cost_window or value[k] * (1 + self.close) >= current:
            return False
        return value[k] / (1 - self.spread / math.sqrt(len(samples))) > current * (1 + self._margin(k))

    def _far_every(self, bucket: int, k: int, value: dict[int, float], remaining: Sequence[int]) -> float:
        """Steps between probes of depth k, far behind the current depth or on the other side of
        depth 0: its probe's loss (the time its probe_steps steps take beyond what the current depth
        takes for the same tokens, plus the catch-up that leaving depth 0, or coming back to speculation
        after the probe, runs) at most probe_share of the steps' time between, in
        probe_every..probe_most. A batch of several requests ends with its slowest one, so a probe from
        depth 0 shortens it by a step only if every request has a draft accepted; its loss is counted as
        its whole cost beyond depth-0 steps. The other depths share one probe_share."""
        current = self.current
        loss = self.probe_steps * self._cost[bucket, k] * max(0.0, 1 - value[k] / value[current])
        share = self.probe_share / (len(self.depths) - 1)  # the other depths' probes share one budget
        if current == 0 and len(remaining) > 1:
            loss = max(loss, self.probe_steps * (self._cost[bucket, k] - self._cost[bucket, 0]))
        if 0 in (k, current):
            loss += self._catch_up.get(bucket, 0.0)
        steps = loss / (share * self._cost[bucket, current])
        return min(self.probe_most, max(self.probe_every, steps))


def depth_arg(text: str) -> int | str:
    """A command line's depth: an integer >= 0 or "auto"."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or 'auto', got {text!r}")
    return int(text)
