"""`mtp_depth="auto"`: each decode step's depth, chosen from measured step cost and live acceptance.

Before a step the runtime asks for the depth K, among the captured ones, that maximises expected
committed tokens per second for the batch now running:

    value(K) = sum over requests of min(E_K(request), tokens it still wants) / cost(bucket, K)

E_K comes from each request's own acceptance per draft position (a moving average started from the
runtime's history) and a per-depth correction; cost is the median of the key's recent wall times,
each from a step that followed one at the same depth, divided by the machine's speed of its moment. A bucket
changes depth only by a margin, probes the depths it does not hold on a schedule that backs off when
they keep losing, and repeats a choice while its inputs stand. The design and the measurements
behind each rule and setting: docs/design.md, "Choosing the depth".
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
    """Chooses decode depths and learns from each step's acceptance and wall time.

    Settings (docs/design.md, "Choosing the depth"):
    - request_alpha: the weight of a step in a request's acceptance averages.
    - cost_window: the timings whose median is a key's cost (and a bucket's catch-up's).
    - speed_alpha: the weight of a held step in its bucket's speed.
    - margin, zero_margin: how much better another depth's value must be to take over; the second
      for a change to or from depth 0.
    - probe_every: steps after which a depth not run is probed.
    - close, close_probe_every: the near ties (within `close` of the held value) take turns, one
      probe every close_probe_every steps each, the wait doubled for each probe lost, up to
      2**backoff times.
    - probe_share, probe_most: a costly probe waits until its loss is at most probe_share of the
      time since the last one, but at most probe_most steps.
    - probe_steps: the steps a probe runs; its first is not timed.
    - recheck_every: at K > 0, the steps a choice is held while only the rates move.
    - spread: how far below its few timings a depth's true cost may lie (over sqrt(n) for n).
    """

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
        first step after a change takes longer than the held steps after it (docs/design.md, "Cost")."""
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
        # the tokens each still wants (docs/design.md, "The policy's own time": a batch holding depth 0
        # moves none).
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
