"""Prometheus metrics, under vLLM's names with the prefix `compiled_mtp:` (a dashboard written for
vLLM's `vllm:` series reads these with the prefix swapped).

Speculative decoding counters come from the runtime's cumulative statistics, as differences after
each step; request latencies are observed by the engine thread as it hands tokens out. Each server
has its own registry, so that several can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime import Runtime

PREFIX = "compiled_mtp:"
# Seconds: 1 ms to 2 min, the range from one CPU decode step to a long request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The server's series, and the runtime counts they were last updated from."""

    def __init__(self, runtime: Runtime) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.num_drafts = Counter(
            p + "spec_decode_num_drafts", "Request-steps that drafted (depth > 0)", registry=r
        )
        self.num_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft)",
            ["position"],
            registry=r,
        )
        depths = [*runtime.depths, runtime.depths[-1] + 1]  # a bucket edge at each depth
        self.depth = Histogram(
            p + "spec_decode_depth", "Draft depth K chosen for each decode step", buckets=depths, registry=r
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "From arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "From arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time per output token after the first (a step's gap shared among the tokens it gave)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(p + "num_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a slot", registry=r)
        self.slots_in_use = Gauge(p + "cache_slots_in_use", "KV-cache slots held by requests", registry=r)
        self.slots = Gauge(p + "cache_slots", "KV-cache slots (the largest batch bucket)", registry=r)
        self.slots.set(runtime.num_slots)
        self._drafted: list[int] = []  # per position, as of the last update
        self._accepted: list[int] = []
        self._depths: dict[int, int] = {}

    def update(self, runtime: Runtime) -> None:
        """Count what the runtime's steps did since the last update, and set the gauges."""
        stats = runtime.stats()
        drafted, accepted = stats["draft_tokens_per_position"], stats["accepted_tokens_per_position"]
        new_drafted = _growth(drafted, self._drafted)
        new_accepted = _growth(accepted, self._accepted)
        if new_drafted:
            self.num_drafts.inc(new_drafted[0])
            self.num_draft_tokens.inc(sum(new_drafted))
            self.num_accepted_tokens.inc(sum(new_accepted))
            for position, n in enumerate(new_accepted):
                self.accepted_per_pos.labels(position=str(position)).inc(n)
        for depth, n in stats["depth_histogram"].items():
            for _ in range(n - self._depths.get(depth, 0)):
                self.depth.observe(depth)
        self._drafted, self._accepted, self._depths = drafted, accepted, stats["depth_histogram"]
        self.running.set(runtime.num_running)
        self.slots_in_use.set(runtime.num_running)
        self.waiting.set(runtime.num_waiting)

    def observe_tokens(self, arrival: float, last: float | None, now: float, tokens: int) -> None:
        """A request gained `tokens` at `now`; `last` is when it last gained any (None: these are its
        first, the one token its prefill samples)."""
        if last is None:
            self.ttft.observe(now - arrival)
            return
        for _ in range(tokens):
            self.itl.observe((now - last) / tokens)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)


def _growth(now: list[int], before: list[int]) -> list[int]:
    """Per-position increase of a count list that only grows (in length too)."""
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]
