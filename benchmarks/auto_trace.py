"""What `mtp_depth="auto"` saw and chose at each decode step of one batch size, beside fixed depths.

The bench's systems (one runtime per depth and one at "auto" over them, the shipped model drafting
among its 1024 most frequent tokens) generate the bench's first `--timed-prompts` held-out prompts,
B at a time: each warmed up with a round at B=1 and one at B (as the bench warms them), then
`--rounds` rounds in turns. For every decode step of auto's bucket after its first timings, a line:
the depth run, the depth the policy holds, the batch's expected tokens at each depth (calibrated),
each depth's cost at the policy's reference speed (ms), their values and the step's own wall time.
Then each runtime's conditional acceptance per draft position, from the steps it ran, and the whole
generations' times. With `--switch HELD PROBE`, auto's runtime then runs a fixed schedule of depths,
and its step times are summed up by their place after a change of depth.

    python benchmarks/auto_trace.py [--batch 4] [--rounds 3] [--timed-prompts 8] [--cache-dir DIR] [--switch 3 1]
        [--depths 0 1 2 3] [--bfloat16-mlps]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from compiled_mtp.bench import add_arguments, bench_prompts, timed_batches, timed_prompts
from compiled_mtp.bench.engine import _runtimes
from compiled_mtp.capture import parallel
from compiled_mtp.depth_policy import DepthPolicy
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.draft_vocab import read_ranking
from compiled_mtp.ops import library
from compiled_mtp.runtime import DTYPES, Runtime, SamplingParams


class BenchSystems:
    """The bench's systems on the shipped model at B = 1 and `batch`: one runtime per depth of `depths`
    and one at "auto" over them, drafting among the 1024 most frequent tokens, with the bench's prompts."""

    def __init__(
        self,
        batch: int,
        count: int,
        cache_dir: str | None,
        depths: Sequence[int] = (0, 1, 2, 3),
        buckets: Sequence[int] = (),
    ) -> None:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        self.args = parser.parse_args(
            [
                "--depths",
                *map(str, depths),
                "--batch-sizes",
                *map(str, sorted({1, batch, *buckets})),
                "--new-tokens",
                "64",
            ]
            + ["--draft-vocab", "1024"]
            + (["--cache-dir", cache_dir] if cache_dir else [])
        )
        a = self.args
        self.model = load_model(a.model, dtype=DTYPES[a.dtype], device=a.device, with_mtp=True)
        self.model.restrict_drafts(
            torch.tensor(read_ranking(a.model, self.model.cfg.vocab_size)[: a.draft_vocab])
        )
        prompts = bench_prompts(
            a.model, self.model.cfg.vocab_size, timed_prompts(count, batch), a.prompt_len
        ).token_ids
        self.groups = timed_batches(prompts, count, batch)
        self.params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)

    def runtimes(self) -> dict[int | str, Runtime]:
        """Every graph of every runtime ready, as the bench has them: one first met in a timed round
        (a fill after 32 steps at depth 0, say) would be timed building."""
        runtimes = _runtimes(self.model, self.args)
        for rt in runtimes.values():
            parallel.ready(rt, list(rt.graphs.keys))
        return runtimes


def warm_up(rt: Runtime, groups: list[list[list[int]]], params: SamplingParams) -> None:
    """As the bench warms a runtime up: a round at B=1 (the first batch's prompts one at a time: a
    batch's last steps run there), then a round at B, untimed."""
    for prompt in groups[0]:
        rt.generate([prompt], params)
    for group in groups:
        rt.generate(group, params)


def conditional_rates(rt: Runtime) -> list[str]:
    """Accepted over tested at each position, pooled over the depths the runtime ran: auto's policy
    counts them; at a fixed depth a draft is tested where every draft before it was accepted."""
    if rt.mtp_depth == "auto":
        tested, accepted = rt._policy.counts()
    else:
        stats = rt.stats()
        accepted = stats["accepted_tokens_per_position"]
        tested = stats["draft_tokens_per_position"][:1] + accepted[:-1]
    return [f"{a / t:.3f}" if t else "-" for t, a in zip(tested, accepted)]


def traced(policy: DepthPolicy, bucket: int, lines: list[str]) -> None:
    """Log every choice at `bucket` once each depth has a cost, and the wall time recorded after it."""
    choose, record = policy.choose, policy.record_cost

    def logged_choose(b: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> int:
        depth = choose(b, rates, remaining)
        if b == bucket and all((b, k) in policy._cost for k in policy.depths):
            tokens = policy.expected(rates, remaining)
            value = policy.values(b, rates, remaining)
            cost = {k: 1e3 * policy._cost[b, k] for k in policy.depths}
            lines.append(
                f"{depth:>3} {policy.current:>4}  "
                + "  ".join(f"{tokens[k]:5.2f}" for k in policy.depths)
                + " |"
                + "  ".join(f"{cost[k]:5.2f}" for k in policy.depths)
                + " |"
                + "  ".join(f"{value[k] / 1e3:5.3f}" for k in policy.depths)
            )
        return depth

    def logged_record(b: int, depth: int, seconds: float) -> None:
        if b == bucket and lines and not lines[-1].endswith("ms"):
            lines[-1] += f" | {1e3 * seconds:5.2f} ms"
        record(b, depth, seconds)

    policy.choose, policy.record_cost = logged_choose, logged_record  # type: ignore[method-assign]


def switch_costs(
    rt: Runtime, prompts: list[list[int]], params: SamplingParams, held: int, probe: int
) -> None:
    """Does a step right after a change of depth cost more? Auto's choices replaced by a schedule
    (14 steps at `held`, then 2 at `probe`, over and over) for 16 generations; the median step time
    of each depth by its place after a change."""
    policy, bucket = rt._policy, len(prompts)
    schedule = itertools.cycle([held] * 14 + [probe] * 2)
    timed: list[tuple[int, float]] = []
    record = policy.record_cost
    policy.choose = lambda b, rates, remaining: next(schedule)  # type: ignore[method-assign]

    def logged_record(b: int, depth: int, seconds: float) -> None:
        if b == bucket:
            timed.append((depth, seconds))
        record(b, depth, seconds)

    policy.record_cost = logged_record  # type: ignore[method-assign]
    for _ in range(16):
        rt.generate(prompts, params)
    places: dict[tuple[int, str], list[float]] = defaultdict(list)
    for i, (depth, seconds) in enumerate(timed[1:], start=1):
        run = next((n for n in range(1, i + 1) if timed[i - n][0] != depth), i + 1)  # steps at depth so far
        places[depth, "first" if run == 1 else "second" if run == 2 else "held"].append(1e3 * seconds)
    print(f"\nB={bucket}, 14 steps at K={held} then 2 at K={probe}: median ms by place after a change")
    for (depth, place), times in sorted(places.items()):
        print(f"  K={depth} {place:<6} {statistics.median(times):7.3f}  ({len(times)} steps)")


def add_system_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options of the scripts that run BenchSystems in turns: --batch, --rounds (default `rounds`),
    --timed-prompts, --cache-dir, --depths, --buckets and --bfloat16-mlps (library.apply_bfloat16_option)."""
    parser.add_argument("--batch", type=int, default=4, help="prompts generated at once (default: 4)")
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"timed rounds in turns (default: {rounds})"
    )
    parser.add_argument(
        "--timed-prompts", type=int, default=8, help="prompts a round generates, B at a time (default: 8)"
    )
    parser.add_argument("--cache-dir", default=None, help="capture cache (default: the user's)")
    parser.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="fixed depths, and auto's (default: 0 1 2 3)",
    )
    parser.add_argument(
        "--buckets",
        type=int,
        nargs="*",
        default=[],
        help="batch buckets beside 1 and --batch, where a batch's last requests run (the bench's: 4 8)",
    )
    library.add_bfloat16_option(parser)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_system_arguments(parser, rounds=3)
    parser.add_argument(
        "--switch",
        type=int,
        nargs=2,
        metavar=("HELD", "PROBE"),
        help="then time steps after a change of depth: 14 at HELD, 2 at PROBE, repeated",
    )
    args = parser.parse_args()
    library.apply_bfloat16_option(args)
    systems = BenchSystems(args.batch, args.timed_prompts, args.cache_dir, args.depths, args.buckets)
    runtimes, groups, params = systems.runtimes(), systems.groups, systems.params
    lines: list[str] = []
    traced(runtimes["auto"]._policy, args.batch, lines)
    seconds: dict[int | str, list[float]] = {k: [] for k in runtimes}
    for rt in runtimes.values():
        warm_up(rt, groups, params)
    for r in range(args.rounds):
        lines.append(f"round {r}")
        for k, rt in runtimes.items():
            start = time.perf_counter()
            for group in groups:
                rt.generate(group, params)
            seconds[k].append(time.perf_counter() - start)
    depths = runtimes["auto"]._policy.depths
    print(f"B={args.batch}: depth run, depth held | tokens | cost ms | value, at depths {depths} | step ms")
    print("\n".join(lines))
    print("\nconditional acceptance per position, from each runtime's own steps:")
    for k, rt in runtimes.items():
        print(f"  K={k}: {' '.join(conditional_rates(rt))}")
    print("\ngeneration ms (warm-up excluded):")
    for k, times in seconds.items():
        print(f"  K={k}: " + " ".join(f"{1e3 * t:.1f}" for t in times) + f"  best {1e3 * min(times):.1f}")
    if args.switch:
        switch_costs(runtimes["auto"], groups[0], params, *args.switch)


if __name__ == "__main__":
    main()
