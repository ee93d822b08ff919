"""Step graphs built at two values of Inductor's cpp.min_chunk_size, decoding in turns in one process.

Inductor splits a generated CPU loop across the threads once each thread would get `min_chunk_size`
of its elements; the step graphs compile with passes.manager.MIN_CHUNK_SIZE (docs/passes.md). This
script builds one runtime per depth of `--depths` at A and one at B (the shipped model, the bench's
held-out prompts, drafts among its 1024 most frequent tokens; the setting is in each graph's cache
key, so both sets live in one capture cache) and has them take turns at every batch
(compiled_mtp.bench.turns), so that the machine's speed, which moves by half within a second here,
meets both alike. Printed: each system's best and median decode tok/s, B's rate over A's at each
depth per round, and each set's depths over its K=0.

    python benchmarks/chunk_ab.py 512 262144 --batch 1 --depths 0 3 [--rounds 8] [--cache-dir DIR]
                                  [--bfloat16-mlps]      (--batch defaults to 4, --depths to 0 1 2 3)
"""

from __future__ import annotations

import argparse
import statistics

from auto_trace import BenchSystems, add_system_arguments, warm_up

from compiled_mtp.bench import Timing, round_ratios, summed, timed_generate, turns
from compiled_mtp.ops import library
from compiled_mtp.passes import manager
from compiled_mtp.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=int, metavar="A", help="the first min_chunk_size (Inductor's default: 512)")
    parser.add_argument("b", type=int, metavar="B", help="the second")
    add_system_arguments(parser, rounds=8)
    args = parser.parse_args()
    library.apply_bfloat16_option(args)
    systems = BenchSystems(args.batch, args.timed_prompts, args.cache_dir, args.depths, args.buckets)
    runtimes: dict[str, Runtime] = {}
    for label, size in (("A", args.a), ("B", args.b)):
        manager.MIN_CHUNK_SIZE = size  # read when a runtime's graphs take their Inductor options
        runtimes |= {f"{label} K={k}": rt for k, rt in systems.runtimes().items() if k != "auto"}
    for rt in runtimes.values():
        warm_up(rt, systems.groups, systems.params)
    timings: dict[str, list[list[Timing]]] = {name: [[] for _ in range(args.rounds)] for name in runtimes}
    for r, group, name in turns(list(runtimes), systems.groups, args.rounds):
        timings[name][r].append(timed_generate(runtimes[name], group, systems.params))
    tokens = sum(map(len, systems.groups)) * (systems.params.max_new_tokens - 1)
    rates = {name: [tokens / summed(t).decode_seconds for t in rounds] for name, rounds in timings.items()}
    print(f"B={args.batch}, min_chunk_size A={args.a}, B={args.b}: decode tok/s over {args.rounds} rounds")
    for name, r in rates.items():
        print(f"  {name:<8} best {max(r):8.1f}  median {statistics.median(r):8.1f}")
    for k in args.depths:
        print(f"  K={k}: B over A {round_ratios(rates[f'B K={k}'], rates[f'A K={k}'], digits=3)}")
    for k in args.depths[1:]:
        for label in "AB":
            print(
                f"  {label}: K={k} over K=0 {round_ratios(rates[f'{label} K={k}'], rates[f'{label} K=0'], digits=3)}"
            )


if __name__ == "__main__":
    main()
