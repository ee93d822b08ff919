"""Auto's depth policy as it was at several commits, in one process, in turns, beside fixed depths.

Each REV's `compiled_mtp/depth_policy.py` (host code on the step times and acceptance the runtime
reports; it imports nothing of the package) is loaded as a module of its own and put into a runtime at
"auto", beside the bench's systems of this checkout (benchmarks/auto_trace.py): one runtime per depth
of `--depths` (default 0..3) and one at "auto" over them with this checkout's policy, all sharing one
set of graphs. Each is warmed up at B=1 and at B, then `--rounds` rounds run them in turns at each
batch (as the bench), each round the first `--timed-prompts` held-out prompts, B at a time, 64 new
tokens each. Printed: each system's decode tok/s over all rounds, its ratio to the best fixed depth's
over all rounds, the same ratio round by round (median, range) and auto's steps per depth. In one
process, since two processes' step times differ by up to 30% here at the same schedule.

With `--trials T`, the rounds run T times over, and before each time after the first every auto
starts a policy afresh and is warmed up again: the bench's conditions (a policy that has seen only
the warm-up, then 5 rounds) T times, where the rounds of one long run judge a policy that has long
settled. The ratios are then also given trial by trial.

With `--pinned K...`, an auto runtime for each K whose policy works every choice out as auto does
(after a warm-up as auto, which times every key) but whose steps all run at depth K: against the fixed
K=K runtime, what auto's Python (and at K=0 its fills) costs without its choices; against auto, what its
choices cost.

    python benchmarks/auto_commits.py 392d5b5~1 [--batch 4] [--rounds 20] [--trials 1] [--timed-prompts 8]
        [--cache-dir DIR] [--depths 0 1 2 3] [--bfloat16-mlps] [--pinned K...]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import subprocess
import types
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from auto_trace import BenchSystems, add_system_arguments, warm_up

from compiled_mtp.bench import timed_generate, turns
from compiled_mtp.depth_policy import DepthPolicy
from compiled_mtp.ops import library
from compiled_mtp.runtime import Runtime, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def policy_at(rev: str) -> type[DepthPolicy]:
    """The DepthPolicy class of `rev`'s depth_policy.py."""
    path = "compiled_mtp/depth_policy.py"
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    module = types.ModuleType(f"depth_policy_at_{rev}")
    exec(compile(source.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    policy: type[DepthPolicy] = module.DepthPolicy
    if not hasattr(policy, "record_repeats"):
        policy = type(policy.__name__, (policy,), {"repeats": 0})  # older: every step asks, none repeats
    if "Sequence" in inspect.signature(policy.observe).parameters["rates"].annotation:
        return policy

    class PerStep(policy):  # type: ignore[valid-type, misc]
        """Before December 2026, observe() took one request's step: called here once a request."""

        def observe(self, rates: Sequence[list[float]], depth: int, accepted: Sequence[int]) -> None:
            for own, a in zip(rates, accepted):
                super().observe(own, depth, a)

    return PerStep


def autos_at(systems: BenchSystems, revs: list[str]) -> dict[str, Runtime]:
    """A runtime at "auto" with each REV's policy, by the name the scripts print."""
    out = {}
    for rev in revs:
        rt = systems.runtimes()["auto"]
        rt._policy = policy_at(rev)(rt._policy.depths)
        out[f"auto at {rev}"] = rt
    return out


class Pinned(DepthPolicy):
    """This checkout's policy, working every choice out as auto does, whose steps run at `target` once
    pinned (after the warm-up, which times every key, so that the choices weigh real costs): auto's
    Python, and at K=0 its fills, without its choices. Each step's time is recorded as the chosen
    depth's, so that the policy holds its choices as auto does (a step at another depth than the
    held one would count as a probe's, and end every hold)."""

    target = 0
    pinned = False
    chosen = 0

    def choose(self, bucket: int, rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> int:
        self.chosen = super().choose(bucket, rates, remaining)
        if self.pinned and self.target != self.chosen:
            self.repeats = 0  # the runtime would repeat the pinned depth's steps unobserved
        return self.target if self.pinned else self.chosen

    def record_cost(self, bucket: int, depth: int, seconds: float) -> None:
        super().record_cost(bucket, self.chosen if self.pinned else depth, seconds)


def pinned_at(systems: BenchSystems, depths: list[int]) -> dict[str, Runtime]:
    """A runtime at "auto" with a Pinned policy for each of `depths`, not pinned yet."""
    out = {}
    for depth in depths:
        rt = systems.runtimes()["auto"]
        rt._policy = type(f"PinnedAt{depth}", (Pinned,), {"target": depth})(rt._policy.depths)
        out[f"auto at K={depth}"] = rt
    return out


def pin(runtimes: dict[int | str, Runtime]) -> None:
    """Every Pinned policy's steps from now on at its depth."""
    for rt in runtimes.values():
        if isinstance(rt._policy, Pinned):
            rt._policy.pinned = True


def fresh_autos(
    runtimes: dict[int | str, Runtime], groups: list[list[list[int]]], params: SamplingParams
) -> None:
    """Every auto runtime's policy started afresh (of its own class) and warmed up as the bench's."""
    for rt in runtimes.values():
        if rt.mtp_depth == "auto":
            rt._policy = type(rt._policy)(rt._policy.depths)
            warm_up(rt, groups, params)


def ratios(seconds: list[float], best: list[float], every: int) -> str:
    """The best fixed depth's time over a system's, summed over each `every` rounds: median (range)."""
    spans = range(0, len(seconds), every)
    out = sorted(sum(best[i : i + every]) / sum(seconds[i : i + every]) for i in spans)
    return f"{statistics.median(out):.3f}x ({out[0]:.2f}-{out[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="commits whose policy runs beside this checkout's")
    add_system_arguments(parser, rounds=20)
    parser.add_argument("--trials", type=int, default=1, help="times the rounds run, each auto afresh")
    parser.add_argument(
        "--pinned", type=int, nargs="*", default=[], help="depths an auto runtime's steps are pinned to"
    )
    args = parser.parse_args()
    library.apply_bfloat16_option(args)
    systems = BenchSystems(args.batch, args.timed_prompts, args.cache_dir, args.depths, args.buckets)
    runtimes = {**systems.runtimes(), **autos_at(systems, args.revs), **pinned_at(systems, args.pinned)}
    groups, params = systems.groups, systems.params
    for rt in runtimes.values():
        warm_up(rt, groups, params)
    pin(runtimes)
    steps: dict[int | str, Counter[int]] = {k: Counter() for k in runtimes}
    seconds: dict[int | str, list[float]] = {k: [] for k in runtimes}
    for trial in range(args.trials):
        if trial:
            fresh_autos(runtimes, groups, params)
            pin(runtimes)
        before = {k: Counter(rt.stats()["depth_histogram"]) for k, rt in runtimes.items()}
        trial_seconds = {k: [0.0] * args.rounds for k in runtimes}
        for r, group, k in turns(list(runtimes), groups, args.rounds):
            trial_seconds[k][r] += timed_generate(runtimes[k], group, params).decode_seconds
        for k, rt in runtimes.items():
            seconds[k] += trial_seconds[k]
            steps[k] += Counter(rt.stats()["depth_histogram"]) - before[k]
    rounds = args.rounds * args.trials
    tokens = sum(map(len, groups)) * (params.max_new_tokens - 1)
    fixed = [k for k in runtimes if isinstance(k, int)]
    best = min(fixed, key=lambda k: sum(seconds[k]))
    print(
        f"B={args.batch}, {args.trials} x {args.rounds} rounds in turns; ratios against the best fixed depth, K={best}"
    )
    for k in runtimes:
        line = (
            f"  {'K=' + str(k) if k in fixed else k:<16} {tokens * rounds / sum(seconds[k]):7.1f} decode tok/s"
            f"  {sum(seconds[best]) / sum(seconds[k]):.3f}x  per round {ratios(seconds[k], seconds[best], 1)}"
        )
        if args.trials > 1:
            line += f"  per trial {ratios(seconds[k], seconds[best], args.rounds)}"
        if k not in fixed:
            line += f"  steps per depth {dict(sorted(steps[k].items()))}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
