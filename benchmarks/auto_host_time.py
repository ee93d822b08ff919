"""Host time per decode step at a fixed depth and at "auto", and the policy's share of it.

The bench's systems at B (benchmarks/auto_trace.py): K=`--depth`, "auto" with this checkout's
DepthPolicy and, for each REV, "auto" with that commit's (auto_commits.py), warmed up as the bench
warms them, then `--rounds` rounds in turns at every batch. Printed per system: host time per decode
step (stats()["host_seconds"]: the step's wall time less its graphs') and, within it, the wall time
of the policy's calls (`choose`, `observe`, `record_cost`, `record_repeats`), each per step.

    python benchmarks/auto_host_time.py [REV...] [--batch 1] [--depth 3] [--rounds 4] [--cache-dir DIR]
                                        [--bfloat16-mlps]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable

from auto_commits import autos_at
from auto_trace import BenchSystems, warm_up

from compiled_mtp.bench import timed_generate, turns
from compiled_mtp.depth_policy import DepthPolicy
from compiled_mtp.ops import library

CALLS = ("choose", "observe", "record_cost", "record_repeats")


def timed_calls(policy: DepthPolicy, seconds: Counter[str]) -> None:
    """Add the wall time of each of the policy's CALLS to `seconds`, by name."""
    for name in CALLS:
        call: Callable | None = getattr(policy, name, None)
        if call is None:  # a commit's policy from before the call
            continue

        def timed(*args: object, _call: Callable = call, _name: str = name) -> object:
            start = time.perf_counter()
            out = _call(*args)
            seconds[_name] += time.perf_counter() - start
            return out

        setattr(policy, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="commits whose policy runs beside this checkout's")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated at once (default: 1)")
    parser.add_argument("--depth", type=int, default=3, help="the fixed depth compared (default: 3)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds in turns (default: 4)")
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: the user's)")
    library.add_bfloat16_option(parser)
    args = parser.parse_args()
    library.apply_bfloat16_option(args)
    systems = BenchSystems(args.batch, 8, args.cache_dir)
    runtimes = {k: rt for k, rt in systems.runtimes().items() if k in (args.depth, "auto")}
    runtimes.update(autos_at(systems, args.revs))
    groups, params = systems.groups, systems.params
    calls: dict[int | str, Counter[str]] = {}
    for k, rt in runtimes.items():
        warm_up(rt, groups, params)
        rt.reset_stats()
        calls[k] = Counter()
        if rt.mtp_depth == "auto":  # a fixed depth's steps leave the policy alone
            timed_calls(rt._policy, calls[k])
    for _, group, k in turns(list(runtimes), groups, args.rounds):
        timed_generate(runtimes[k], group, params)
    print(f"B={args.batch}, {args.rounds} rounds in turns: us per decode step")
    for k, rt in runtimes.items():
        stats = rt.stats()
        steps = stats["decode_steps"]
        parts = "  ".join(f"{name} {1e6 * calls[k][name] / steps:5.1f}" for name in CALLS)
        name = f"K={k}" if isinstance(k, int) else k
        depths = dict(sorted(stats["depth_histogram"].items()))
        host = 1e6 * stats["host_seconds"] / steps
        print(f"  {name:<16} host {host:6.1f}  of which {parts}  steps per depth {depths}")


if __name__ == "__main__":
    main()
