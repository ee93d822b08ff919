"""Whole rounds in turns against turns at every batch: the spread of K=3's speed over K=0's, per round.

The bench's systems K=0 and K=3 at B=1 (benchmarks/auto_trace.py) generate the bench's first
`--timed-prompts` held-out prompts once a round. Rounds alternate between two orders: each system
generating all the prompts in its turn (the bench before run 31), and the two taking turns at every
prompt (`bench.turns`, the bench since). Printed for each order: the ratio of K=3's decode tok/s to
K=0's in each round, their median and range. The more the machine's speed moves within a round, the
wider the first order's range against the second's.

    python benchmarks/turn_granularity.py [--rounds 10] [--timed-prompts 8] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics

from auto_trace import BenchSystems, warm_up

from compiled_mtp.bench import timed_generate, turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of each order (default: 10)")
    parser.add_argument("--timed-prompts", type=int, default=8, help="prompts a round generates (default: 8)")
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: the user's)")
    args = parser.parse_args()
    systems = BenchSystems(1, args.timed_prompts, args.cache_dir)
    runtimes = {k: rt for k, rt in systems.runtimes().items() if k in (0, 3)}
    groups, params = systems.groups, systems.params
    for rt in runtimes.values():
        warm_up(rt, groups, params)
    ratios: dict[str, list[float]] = {"whole rounds": [], "every batch": []}
    for _ in range(args.rounds):
        for order in ratios:
            seconds = dict.fromkeys(runtimes, 0.0)
            if order == "whole rounds":
                schedule = [(group, k) for k in runtimes for group in groups]
            else:
                schedule = [(group, k) for _, group, k in turns(list(runtimes), groups, 1)]
            for group, k in schedule:
                seconds[k] += timed_generate(runtimes[k], group, params).decode_seconds
            ratios[order].append(seconds[0] / seconds[3])
    print(f"K=3 over K=0 at B=1, decode tok/s, {args.rounds} rounds of each order, alternating")
    for order, values in ratios.items():
        values.sort()
        print(
            f"  {order:<13} median {statistics.median(values):.3f}x  range {values[0]:.3f}-{values[-1]:.3f}x"
            f"  (spread {values[-1] - values[0]:.3f})  stdev {statistics.stdev(values):.3f}"
        )


if __name__ == "__main__":
    main()
