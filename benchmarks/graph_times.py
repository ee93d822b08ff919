"""Milliseconds per call of each graph a runtime replays while it generates.

Which graph of a step costs what (a catch-up, an extend, a verify), at the process's thread count.

The runtime loads its graphs from a capture cache (built on the first run), generates once to warm
up, then `--rounds` times; each graph's figure is its best round's median call. `--slots N` builds a
largest bucket of N, so the static state holds N slots (a server's), whatever `--batch`. With `--then K`, each
generation switches to depth K halfway (`--depth 0 --then 1`: the MTP layer's fill during the
depth-0 steps and its catch-up at the switch, in one process).

The runtime's host time per decode step (its Python between and around the graphs, over the timed
rounds) is printed below the graphs.

    python benchmarks/graph_times.py [--depth 0] [--then 1] [--batch 4] [--slots 32] [--cache-dir DIR] [--rounds 3]
                                     [--bfloat16-mlps]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
from compiled_mtp.bench import bench_prompts
from compiled_mtp.capture.compiler import CompiledGraphs
from compiled_mtp.depth_policy import depth_arg
from compiled_mtp.graphs.plan import GraphKey
from compiled_mtp.ops import library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=depth_arg, default=0, help="the runtime's mtp_depth (default: 0)")
    parser.add_argument("--then", type=depth_arg, default=None, help="the depth after half the new tokens")
    parser.add_argument("--batch", type=int, default=4, help="prompts generated at once (default: 4)")
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help="the largest batch bucket: the state's slots (default: --batch)",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="capture cache (default: the user's)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default: 128)")
    parser.add_argument("--rounds", type=int, default=3, help="timed generations (default: 3)")
    library.add_bfloat16_option(parser)
    args = parser.parse_args()
    library.apply_bfloat16_option(args)
    rt = timed_runtime(args.depth, args.batch, args.slots, args.cache_dir)
    calls = timing_calls()
    prompts, params = timed_work(rt, args.batch, args.new_tokens)
    generate(rt, prompts, params, args.then)
    rt.reset_stats()
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    for _ in range(args.rounds):
        calls.clear()
        generate(rt, prompts, params, args.then)
        for name, seconds in calls.items():
            best[name] = min(best.get(name, float("inf")), 1e3 * statistics.median(seconds))
            counts[name] = len(seconds)
    then = "" if args.then is None else f", then {args.then}"
    print(
        f"depth {args.depth}{then}, {args.batch} prompts x {args.new_tokens} new tokens; ms per call, "
        "best round's median"
    )
    for name in sorted(best):
        print(f"  {name:<24}{best[name]:8.3f}  ({counts[name]} calls a generation)")
    print(
        f"  {'host, a decode step':<24}{1e3 * rt.stats()['host_seconds_per_step']:8.3f}  (mean over the rounds)"
    )


def timing_calls() -> dict[str, list[float]]:
    """Every graph call's wall time from now on, by graph name: the caller clears it between rounds."""
    calls: dict[str, list[float]] = defaultdict(list)
    replay = CompiledGraphs.__call__

    def timed(graphs: CompiledGraphs, key: GraphKey, *inputs: Any) -> Any:
        start = time.perf_counter()
        out = replay(graphs, key, *inputs)
        calls[key.name].append(time.perf_counter() - start)
        return out

    CompiledGraphs.__call__ = timed  # type: ignore[method-assign]
    return calls


def timed_runtime(depth: int | str, batch: int, slots: int | None, cache_dir: Path | None) -> Runtime:
    """The shipped model at `depth` among the captured depths 0-3, drafting among its 1024 most frequent
    tokens, with buckets 1, `batch` and `slots`, its graphs from `cache_dir` (default: the user's)."""
    return Runtime.from_pretrained(
        mtp_depth=depth,
        mtp_depths=[0, 1, 2, 3],
        batch_sizes=tuple(sorted({1, batch, slots or batch})),
        cache_dir=cache_dir or True,
        draft_vocab=1024,
    )


def timed_work(rt: Runtime, batch: int, new_tokens: int) -> tuple[list[list[int]], SamplingParams]:
    """`batch` held-out prompts of 64 tokens, and greedy params for `new_tokens` each."""
    prompts = bench_prompts(Path(DEFAULT_MODEL), rt.model.cfg.vocab_size, batch, 64).token_ids
    return prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def generate(rt: Runtime, prompts: list[list[int]], params: SamplingParams, then: int | str | None) -> None:
    """The prompts to completion, at the runtime's depth, or at `then` once half the new tokens' steps ran."""
    if then is None:
        rt.generate(prompts, params)
        return
    first, steps = rt.mtp_depth, 0
    for prompt in prompts:
        rt.add_request(prompt, params)
    while rt.has_unfinished():
        rt.mtp_depth = first if steps < params.max_new_tokens // 2 else then
        rt.step()
        steps += 1
    rt.mtp_depth = first


if __name__ == "__main__":
    main()
