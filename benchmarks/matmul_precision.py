"""Decode tok/s with the dense MLPs multiplying in float32 and in bfloat16, in turns in one process.

torch's CPU float32 precision (torch.backends.mkldnn.matmul.fp32_precision: "ieee", or "bf16" for
`--fp32-precision bf16`) is read by the C++ ops at each call, so the same graphs serve both
(csrc/panels.h, bfloat16_products). The
bench's systems (the shipped model drafting among its 1024 most frequent tokens, a runtime per depth
and one at "auto", the bench's held-out prompts, `--batch` at a time, 64 new tokens) are warmed up at
each precision, then every (precision, system) pair takes turns at each batch of prompts for
`--rounds` rounds. Printed per system: each precision's best round (decode tok/s) and its tokens a
request step, the per-round ratio bf16 over ieee (median and range), and each precision's
speedup over its own K=0. Before the timing, the greedy outputs of every system at each precision
are compared with K=0's at the same precision, and bf16's K=0 with ieee's.

    python benchmarks/matmul_precision.py [--batch 1] [--depths 0 1 2 3] [--rounds 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from auto_trace import BenchSystems, warm_up

from compiled_mtp.bench import timed_generate, turns
from compiled_mtp.ops.library import FP32_PRECISIONS, bfloat16_products

PROMPTS = 8


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
    bench = BenchSystems(args.batch, PROMPTS, args.cache_dir, args.depths)
    runtimes = bench.runtimes()
    outputs: dict[tuple[str, int | str], list[list[int]]] = {}
    for precision in FP32_PRECISIONS:
        torch.backends.mkldnn.matmul.fp32_precision = precision
        for k, rt in runtimes.items():
            warm_up(rt, bench.groups, bench.params)
            outputs[precision, k] = [o.token_ids for g in bench.groups for o in rt.generate(g, bench.params)]
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    if not bfloat16_products():
        print("this machine or build has no bfloat16 dot products: both precisions run the same products")
    tokens = sum(map(len, outputs["ieee", 0]))
    for precision in FP32_PRECISIONS:
        off = {k: differing(outputs[precision, k], outputs[precision, 0]) for k in runtimes if k != 0}
        print(
            f"{precision}: tokens unlike K=0's, of {tokens}: "
            + ", ".join(f"K={k} {n}" for k, n in off.items())
        )
    print(f"bf16's K=0 against ieee's: {differing(outputs['bf16', 0], outputs['ieee', 0])} tokens differ")

    pairs = [(p, k) for k in runtimes for p in FP32_PRECISIONS]
    seconds: defaultdict[tuple[str, int | str], list[float]] = defaultdict(lambda: [0.0] * args.rounds)
    steps: defaultdict[tuple[str, int | str], int] = defaultdict(int)
    for r, group, (precision, k) in turns(pairs, bench.groups, args.rounds):
        torch.backends.mkldnn.matmul.fp32_precision = precision
        timing = timed_generate(runtimes[k], group, bench.params)
        seconds[precision, k][r] += timing.decode_seconds
        steps[precision, k] += timing.request_steps
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    decoded = PROMPTS * (bench.params.max_new_tokens - 1)
    rate = {key: decoded / min(s) for key, s in seconds.items()}
    per_step = {key: args.rounds * PROMPTS * bench.params.max_new_tokens / n for key, n in steps.items()}
    print(f"\nB={args.batch}, decode tok/s, best of {args.rounds} rounds (tokens a request step)")
    for k in runtimes:
        ratios = sorted(h / m for h, m in zip(seconds["ieee", k], seconds["bf16", k]))
        over = "  ".join(f"{p} {rate[p, k] / rate[p, 0]:.2f}x K=0" for p in FP32_PRECISIONS)
        print(
            f"K={k}: ieee {rate['ieee', k]:7.1f} ({per_step['ieee', k]:.2f})  "
            f"bf16 {rate['bf16', k]:7.1f} ({per_step['bf16', k]:.2f})  "
            f"bf16/ieee per round {statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})  {over}"
        )


if __name__ == "__main__":
    main()
