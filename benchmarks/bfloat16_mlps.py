"""Decode tok/s with the dense MLPs multiplying in float32 and in bfloat16, in turns in one process.

The C++ ops read `compiled_mtp.ops.library.bfloat16_products` at each call, so the same graphs serve
both (csrc/panels.h). The bench's systems (the shipped model drafting among its 1024 most frequent
tokens, a runtime per depth and one at "auto", the bench's held-out prompts, `--batch` at a time, 64
new tokens) are warmed up each way, then every (products, system) pair takes turns at each batch of
prompts for `--rounds` rounds. The runtimes hold the bench's buckets, 1, 4 and 8, so that a capture cache
the bench filled serves them. Printed first: the greedy outputs of every system each way against
K=0's the same way, and bfloat16's K=0 against float32's. Then per system: each way's best round
(decode tok/s) with its tokens a request step, the per-round ratio bfloat16 over float32 (median and
range), and each way's speedup over its own K=0. Then each graph of the batch's bucket: the best
round's median call each way, and their ratio per round.

    python benchmarks/bfloat16_mlps.py [--batch 1] [--depths 0 1 2 3] [--rounds 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from auto_trace import BenchSystems, warm_up
from graph_times import timing_calls

from compiled_mtp.bench import timed_generate, turns
from compiled_mtp.ops.library import bfloat16_products

PROMPTS = 8
BUCKETS = (1, 4, 8)  # the bench's: its capture cache serves every graph
WAYS = {"float32": False, "bfloat16": True}


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens that differ between two sets of outputs, position by position."""
    return sum(x != y for p, q in zip(a, b) for x, y in zip(p, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="prompts generated at once (default: 1)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3], help="default: 0 1 2 3")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: the user's)")
    args = parser.parse_args()
    bench = BenchSystems(args.batch, PROMPTS, args.cache_dir, args.depths, BUCKETS)
    runtimes = bench.runtimes()
    if not bfloat16_products(True):
        print("this machine or build has no bfloat16 dot products: both ways run the same products")
    outputs: dict[tuple[str, int | str], list[list[int]]] = {}
    for way, on in WAYS.items():
        bfloat16_products(on)
        for k, rt in runtimes.items():
            warm_up(rt, bench.groups, bench.params)
            outputs[way, k] = [o.token_ids for g in bench.groups for o in rt.generate(g, bench.params)]
    tokens = sum(map(len, outputs["float32", 0]))
    for way in WAYS:
        off = ", ".join(f"K={k} {differing(outputs[way, k], outputs[way, 0])}" for k in runtimes if k != 0)
        print(f"{way}: tokens unlike K=0's, of {tokens}: {off}")
    print(
        f"bfloat16's K=0 against float32's: {differing(outputs['bfloat16', 0], outputs['float32', 0])} differ"
    )

    calls = timing_calls()
    pairs = [(way, k) for k in runtimes for way in WAYS]
    seconds: defaultdict[tuple[str, int | str], list[float]] = defaultdict(lambda: [0.0] * args.rounds)
    steps: defaultdict[tuple[str, int | str], int] = defaultdict(int)
    per_call: defaultdict[tuple[str, str], list[list[float]]] = defaultdict(
        lambda: [[] for _ in range(args.rounds)]
    )
    for r, group, (way, k) in turns(pairs, bench.groups, args.rounds):
        bfloat16_products(WAYS[way])
        calls.clear()
        timing = timed_generate(runtimes[k], group, bench.params)
        seconds[way, k][r] += timing.decode_seconds
        steps[way, k] += timing.request_steps
        for name, times in calls.items():
            if f"/B{args.batch}/" in name:
                per_call[name, way][r] += times
    bfloat16_products(False)
    decoded = PROMPTS * (bench.params.max_new_tokens - 1)
    rate = {key: decoded / min(s) for key, s in seconds.items()}
    per_step = {key: args.rounds * PROMPTS * bench.params.max_new_tokens / n for key, n in steps.items()}
    print(f"\nB={args.batch}, decode tok/s, best of {args.rounds} rounds (tokens a request step)")
    for k in runtimes:
        ratios = sorted(f / b for f, b in zip(seconds["float32", k], seconds["bfloat16", k]))
        over = "  ".join(f"{way} {rate[way, k] / rate[way, 0]:.2f}x K=0" for way in WAYS)
        print(
            f"K={k}: float32 {rate['float32', k]:7.1f} ({per_step['float32', k]:.2f})  "
            f"bfloat16 {rate['bfloat16', k]:7.1f} ({per_step['bfloat16', k]:.2f})  "
            f"bfloat16/float32 per round {statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})  {over}"
        )
    print(
        "\nms per call, best round's median; bfloat16 over float32 per round (rounds that called it both ways)"
    )
    for name in sorted({name for name, _ in per_call}):
        both = [(f, b) for f, b in zip(per_call[name, "float32"], per_call[name, "bfloat16"]) if f and b]
        if not both:
            continue
        best = [1e3 * min(statistics.median(times) for times in way) for way in zip(*both)]
        ratios = sorted(statistics.median(b) / statistics.median(f) for f, b in both)
        print(
            f"  {name:<24} float32 {best[0]:7.3f}  bfloat16 {best[1]:7.3f}  "
            f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


if __name__ == "__main__":
    main()
