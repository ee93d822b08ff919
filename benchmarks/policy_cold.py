"""DepthPolicy's calls timed on cold caches, this checkout's against REV's, on simulated steps.

Between two steps of a generation the graphs read tens of MB, so the policy's Python meets caches that
hold none of its objects. Here each simulated step first reads a 64 MB buffer, then times `choose`,
`observe` and `record_cost` on a batch of B requests whose drafts are accepted at `--rate` each (seeded),
each step at its depth's cost off by up to 10%. Three cases: depth 1 held at B=8, depth 0 held at B=8
(depth 1 made dearer), depth 3 held at B=1. Printed: us per step of each call, after 100 steps of
warm-up, each case twice in turns. SIMULATED steps; the calls are the real ones. In situ, beside the
graphs, see benchmarks/auto_host_time.py.

    python benchmarks/policy_cold.py REV [--steps 600] [--rate 0.85]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np
from auto_commits import policy_at

from compiled_mtp.depth_policy import DepthPolicy

CASES = {  # (B, ms a step at each depth)
    "B=8, depth 1 held": (8, {0: 1.7, 1: 3.0, 2: 4.5, 3: 5.5}),
    "B=8, depth 0 held": (8, {0: 1.7, 1: 3.6, 2: 4.5, 3: 5.5}),
    "B=1, depth 3 held": (1, {0: 1.2, 1: 1.4, 2: 1.6, 3: 1.75}),
}
CALLS = ("choose", "observe", "record_cost")


def served(policy: DepthPolicy, batch: int, costs: dict[int, float], steps: int, rate: float) -> Counter[str]:
    """Seconds a step in each of the policy's CALLS, over `steps` after 100 untimed, each on cold caches."""
    cold = np.ones(16 << 20, dtype=np.float32)
    random = np.random.default_rng(0)
    rates = [policy.prior() for _ in range(batch)]
    remaining = [10**6] * batch
    seconds: Counter[str] = Counter()
    for step in range(100 + steps):
        cold.sum()
        t0 = time.perf_counter()
        k = policy.choose(batch, rates, remaining)
        t1 = time.perf_counter()
        accepted = [next((j for j in range(k) if random.random() >= rate), k) for _ in range(batch)]
        wall = costs[k] * 1e-3 * random.uniform(0.9, 1.1)
        t2 = time.perf_counter()
        policy.observe(rates, k, accepted)
        t3 = time.perf_counter()
        policy.record_cost(batch, k, wall)
        t4 = time.perf_counter()
        if step >= 100:
            seconds.update({"choose": t1 - t0, "observe": t3 - t2, "record_cost": t4 - t3})
    return Counter({name: s / steps for name, s in seconds.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit whose policy runs beside this checkout's")
    parser.add_argument("--steps", type=int, default=600, help="timed steps a case (default: 600)")
    parser.add_argument("--rate", type=float, default=0.85, help="each draft's acceptance (default: 0.85)")
    args = parser.parse_args()
    policies: dict[str, type[DepthPolicy]] = {"this checkout": DepthPolicy, args.rev: policy_at(args.rev)}
    for case, (batch, costs) in CASES.items():
        totals: dict[str, Counter[str]] = {name: Counter() for name in policies}
        for _ in range(2):
            for name, policy in policies.items():
                totals[name] += served(policy(tuple(costs)), batch, costs, args.steps, args.rate)
        print(f"{case}: us a step")
        for name, seconds in totals.items():
            parts = "  ".join(f"{call} {1e6 * seconds[call] / 2:5.1f}" for call in CALLS)
            print(f"  {name:<14} {parts}  all {1e6 * sum(seconds.values()) / 2:5.1f}")


if __name__ == "__main__":
    main()
