"""`mtp_depth="auto"`: each decode step's depth, chosen from measured step cost and live acceptance.

Before a step the runtime asks for the depth K, among the captured ones, that maximises expected
committed tokens per second for the batch now running:

    value(K) = sum over requests of min(E_K(request), tokens it still wants) / cost(bucket, K)

E_K = 1 + a_1 + a_1 a_2 + ... + a_1..a_K, where a_j is the request's chance that draft j is accepted
given that draft j - 1 was: an exponential moving average over the request's own steps, started from
the runtime's history (accepted over proposed at each position, smoothed towards the position before).
cost(bucket, K) is a moving average of the wall time of the decode steps the runtime ran with that key,
the first UNTIMED_CALLS left out: the first compiles or loads the graphs, and the second runs on the
caches that loading emptied (up to 60% slower than the steps after it, here). A key never run is
tried before any choice is made from the others, so every cost is measured, never typed in. The depth changes only when
another's value beats the current one's by `margin` (hysteresis: a near tie is within the noise of
the estimates), or by `zero_margin` for a change to or from depth 0, which costs more than the steps
it is timed on: leaving depth 0 first runs the MTP catch-up, and the requests of a batch that drafts
finish at different steps, so its last steps run the bucket for fewer rows.

A cost is only as current as the last step run at that key, and the machine's speed drifts (memory
speed here changes from minute to minute): a depth that lost once would never be measured again.
So every depth that has not run for `probe_every` steps of a bucket runs one step, the runner-up
first, and a cost older than that is replaced by the new measurement rather than averaged with it:
probing only the runner-up left a third depth whose one measurement came out high at that cost for
good (docs/design.md gives the run).
A runner-up within `close` of the current depth's value runs every `close_probe_every` steps
instead, its cost averaged over those probes: a near tie is what one noisy measurement decides
wrongly, and a probe of a depth worth nearly as much costs nearly nothing.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

Key = tuple[int, int]  # (bucket, depth)
UNTIMED_CALLS = 2  # a key's first calls, never counted in its cost


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
        request_alpha: float = 0.3,
        cost_alpha: float = 0.2,
        margin: float = 0.02,
        zero_margin: float = 0.05,
        probe_every: int = 64,
        close: float = 0.1,
        close_probe_every: int = 16,
    ) -> None:
        self.depths = tuple(sorted(depths))
        self.request_alpha = request_alpha
        self.cost_alpha = cost_alpha
        self.margin = margin
        self.zero_margin = zero_margin
        self.probe_every = probe_every
        self.close = close
        self.close_probe_every = close_probe_every
        self.current = self.depths[-1]
        self._cost: dict[Key, float] = {}
        self._seen: Counter[Key] = Counter()
        self._steps: Counter[int] = Counter()  # choices made per bucket
        # The bucket's step count when each key's cost was last measured.
        self._measured_at: dict[Key, int] = {}
        width = self.depths[-1]
        self._proposed = [0] * width
        self._accepted = [0] * width

    def prior(self) -> list[float]:
        """Acceptance per position from every step so far, each smoothed towards the one before."""
        rates, previous = [], 0.5
        for proposed, accepted in zip(self._proposed, self._accepted):
            previous = (accepted + 2 * previous) / (proposed + 2)
            rates.append(previous)
        return rates

    def observe(self, rates: list[float], depth: int, accepted: int) -> None:
        """One request's step at `depth` with `accepted` drafts accepted: update its rates in place and
        the history. Positions past the first rejection were not tested and stay as they were."""
        for j in range(min(accepted + 1, depth)):
            hit = j < accepted
            self._proposed[j] += 1
            self._accepted[j] += hit
            rates[j] += self.request_alpha * (hit - rates[j])

    def record_cost(self, bucket: int, depth: int, seconds: float) -> None:
        key = (bucket, depth)
        self._seen[key] += 1
        if self._seen[key] <= UNTIMED_CALLS:
            return  # the first loads the key's graphs, the next runs on caches the load emptied
        old = self._cost.get(key)
        stale = self._steps[bucket] - self._measured_at.get(key, 0) > self.probe_every
        self._cost[key] = seconds if old is None or stale else old + self.cost_alpha * (seconds - old)
        self._measured_at[key] = self._steps[bucket]

    def choose(self, bucket: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> int:
        """The depth for the next step of a batch in `bucket`: its requests' rates and wanted tokens."""
        untried = [k for k in self.depths if (bucket, k) not in self._cost]
        if untried:
            return untried[0]
        expected = [_expected_by_depth(r, self.depths[-1]) for r in rates]
        value = {
            k: sum(min(e[k], n) for e, n in zip(expected, remaining)) / self._cost[bucket, k]
            for k in self.depths
        }
        best = max(self.depths, key=lambda k: value[k])
        margin = self.zero_margin if 0 in (best, self.current) else self.margin
        if value[best] > value[self.current] * (1 + margin):
            self.current = best
        self._steps[bucket] += 1
        others = [k for k in self.depths if k != self.current]
        runner_up = max(others, key=lambda k: value[k], default=self.current)
        near = value[runner_up] * (1 + self.close) >= value[self.current]
        every = self.close_probe_every if near else self.probe_every

        def age(k: int) -> int:
            return self._steps[bucket] - self._measured_at[bucket, k]

        if age(runner_up) > every:
            return runner_up  # one step to measure it again
        stalest = max(others, key=age, default=self.current)
        if age(stalest) > self.probe_every:
            return stalest  # a cost measured too high would otherwise never be measured again
        return self.current


def depth_arg(text: str) -> int | str:
    """A command line's depth: an integer >= 0 or "auto"."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or 'auto', got {text!r}")
    return int(text)
