"""Two builds of the same graphs called alternately in one process: milliseconds per call of each.

The runtime (this checkout's code) loads its graphs from the capture cache CACHE_B, building what is
missing. For each key it calls, the newest package of the same key name in CACHE_A (another commit's
build: `PYTHONPATH=<worktree> python benchmarks/graph_times.py --cache-dir CACHE_A` fills it) is
loaded beside it, and the runtime's calls of the key alternate between the two, each on the state
the call before left. Both builds must be correct graphs of the same model, so the generated tokens
are checked equal from round to round. Alternating call by call, both meet the machine at the same
moments, where graph_times.py in two processes meets it minutes apart (its speed moves by half within
a fraction of a second here). Printed per key: each build's median call, best round and median round,
and B's time over A's per round.

    python benchmarks/graph_ab.py CACHE_A CACHE_B [--depth 3] [--batch 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graph_times import timed_runtime, timed_work

from compiled_mtp.capture import aot
from compiled_mtp.capture.compiler import CompiledGraphs
from compiled_mtp.graphs.plan import GraphKey


def other_build(cache: Path, key: GraphKey, graphs: CompiledGraphs) -> Callable[..., Any]:
    """The newest package of `key` in `cache`, loaded onto the runtime's model and state."""
    found = sorted(cache.glob(key.name.replace("/", "-") + "-*.pt2"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise SystemExit(f"{cache}: no package of {key.name}; build one there first")
    return aot.load(found[-1], graphs.model, graphs.state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_a", type=Path, help="capture cache of build A (the other commit's)")
    parser.add_argument("cache_b", type=Path, help="capture cache of build B (this checkout's)")
    parser.add_argument("--depth", type=int, default=3, help="the runtime's mtp_depth (default: 3)")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated at once (default: 1)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default: 128)")
    parser.add_argument("--rounds", type=int, default=5, help="timed generations (default: 5)")
    args = parser.parse_args()
    rt = timed_runtime(args.depth, args.batch, None, args.cache_b)
    builds: dict[GraphKey, Callable[..., Any]] = {}
    calls: dict[tuple[str, str], list[float]] = defaultdict(list)
    replay = CompiledGraphs.__call__

    def alternate(graphs: CompiledGraphs, key: GraphKey, *inputs: Any) -> Any:
        if not graphs.replays[key]:
            return replay(graphs, key, *inputs)  # loads (or builds) B's package
        if key not in builds:
            builds[key] = other_build(args.cache_a, key, graphs)
        side = "AB"[graphs.replays[key] % 2 == 0]
        graphs.replays[key] += 1
        run = builds[key] if side == "A" else graphs._graphs[key]
        start = time.perf_counter()
        out = run(*inputs)
        calls[key.name, side].append(time.perf_counter() - start)
        return out

    CompiledGraphs.__call__ = alternate  # type: ignore[method-assign]
    prompts, params = timed_work(rt, args.batch, args.new_tokens)
    first = [out.token_ids for out in rt.generate(prompts, params)]
    rounds: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        calls.clear()
        if [out.token_ids for out in rt.generate(prompts, params)] != first:
            raise SystemExit("the two builds generated different tokens")
        for name_side, seconds in calls.items():
            rounds[name_side].append(statistics.median(seconds))
    print(
        f"depth {args.depth}, B={args.batch}: ms per call, each round's median; A {args.cache_a}, B {args.cache_b}"
    )
    for name in sorted({name for name, _ in rounds}):
        a, b = rounds[name, "A"], rounds[name, "B"]
        if a and b:
            ratios = [y / x for x, y in zip(a, b)]
            print(
                f"  {name:<22} A {1e3 * min(a):.3f} (median {1e3 * statistics.median(a):.3f})"
                f"  B {1e3 * min(b):.3f} (median {1e3 * statistics.median(b):.3f})"
                f"  B/A {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            )


if __name__ == "__main__":
    main()
