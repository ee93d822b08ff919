"""Where a batch's decode time goes at each depth: its full steps, and the tail after its first request
finishes.

The bench's systems at B (benchmarks/auto_trace.py), the chosen ones, warmed up as the bench warms
them, then `--rounds` rounds in turns, each the first `--timed-prompts` held-out prompts, B at a time,
64 new tokens each. Every decode step is timed whole (the runtime's `_decode`, the policy's choice and
any catch-up or fill included) and filed as a full step (B requests running) or a tail step (fewer).
Printed per system: decode time and tokens per ms over the generations, then the full steps and the
tail steps a generation, ms a step and tokens a step of each; for "auto", its full steps by depth.
`--zero` holds "auto" at depth 0 (its choice replaced by 0; the MTP layer's fill still runs).

    python benchmarks/batch_tail.py 0 1 2 auto [--batch 4] [--rounds 10] [--zero] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from auto_trace import BenchSystems, warm_up

from compiled_mtp.bench import timed_generate, turns
from compiled_mtp.depth_policy import depth_arg
from compiled_mtp.runtime import Runtime

Step = tuple[int, int, int, float]  # (requests running, depth, tokens committed, seconds)


def timed_steps(rt: Runtime, steps: list[Step]) -> None:
    """Append each decode step of `rt` to `steps`, timed whole, with the depth it ran at."""
    decode: Callable[..., Any] = rt._decode
    choose: Callable[..., int] = rt._choose_depth
    chosen: list[int] = []

    def choose_and_note(reqs: list, bucket: int) -> int:
        chosen.append(choose(reqs, bucket))
        return chosen[-1]

    def timed(reqs: list) -> list:
        start = time.perf_counter()
        out = decode(reqs)
        steps.append(
            (len(reqs), chosen[-1], sum(len(o.new_token_ids) for o in out), time.perf_counter() - start)
        )
        return out

    rt._choose_depth = choose_and_note  # type: ignore[method-assign]
    rt._decode = timed  # type: ignore[method-assign]


def summary(steps: list[Step]) -> str:
    """Count, ms a step and tokens a step of `steps`."""
    count = max(len(steps), 1)
    ms, tokens = 1e3 * sum(s[3] for s in steps) / count, sum(s[2] for s in steps) / count
    return f"{len(steps)} steps, {ms:.3f} ms and {tokens:.2f} tokens a step"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("systems", nargs="+", type=depth_arg, help="depths and/or auto")
    parser.add_argument("--batch", type=int, default=4, help="prompts generated at once (default: 4)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds in turns (default: 10)")
    parser.add_argument("--zero", action="store_true", help="hold auto at depth 0")
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: the user's)")
    args = parser.parse_args()
    systems = BenchSystems(args.batch, 8, args.cache_dir)
    runtimes = {k: rt for k, rt in systems.runtimes().items() if k in args.systems}
    steps: dict[int | str, list[Step]] = defaultdict(list)
    for k, rt in runtimes.items():
        warm_up(rt, systems.groups, systems.params)
        timed_steps(rt, steps[k])
        if k == "auto" and args.zero:
            rt._policy.choose = lambda *_: 0  # type: ignore[method-assign]
    generations: dict[int | str, int] = defaultdict(int)
    for _, group, k in turns(list(runtimes), systems.groups, args.rounds):
        timed_generate(runtimes[k], group, systems.params)
        generations[k] += 1
    print(
        f"B={args.batch}, {args.rounds} rounds in turns, {generations[next(iter(runtimes))]} generations each"
    )
    for k, rt_steps in steps.items():
        n = generations[k]
        seconds, tokens = sum(s[3] for s in rt_steps), sum(s[2] for s in rt_steps)
        full = [s for s in rt_steps if s[0] == args.batch]
        tail = [s for s in rt_steps if s[0] < args.batch]
        name = f"K={k}" if isinstance(k, int) else k
        print(
            f"  {name:<5} decode {1e3 * seconds / n:7.1f} ms a generation, {tokens / seconds / 1e3:.3f} tokens a ms"
        )
        print(
            f"        full: {summary(full)}; tail: {summary(tail)}, {sum(s[3] for s in tail) / seconds:.1%} of the time"
        )
        print(f"        a generation: {len(full) / n:.1f} full steps, {len(tail) / n:.1f} tail steps")
        if k == "auto":
            for depth in sorted({s[1] for s in full}):
                print(
                    f"        auto's full steps at K={depth}: {summary([s for s in full if s[1] == depth])}"
                )


if __name__ == "__main__":
    main()
