"""Auto's choices, simulated on a bench run's measured step times, against the best fixed depth.

    python benchmarks/auto_simulate.py                                  # the policy as it ships
    python benchmarks/auto_simulate.py --setting request_alpha=0.3 --setting probe_most=64
    python benchmarks/auto_simulate.py --noise 0.2 --drift 0 0.03 --rev HEAD~1   # HEAD~1's policy beside
    python benchmarks/auto_simulate.py --trace benchmarks/acceptance-trace.json  # real acceptance

Each (B, K) step costs the iteration time `compiled-mtp bench` measured (benchmarks/bench-cpu.json, host
time included), or the step time of a bench_preset.py JSON (`--bench preset-cuda-depths.json`); each
draft position is accepted at the held-out rate the bench measured at its deepest depth (the shipped
model's at K=3 from train_log.json for a JSON without acceptance), conditional on the position before,
seeded. For each B, B requests of `--tokens` tokens run at every fixed depth and under DepthPolicy with
each `--setting` (the defaults first) and each `--rev`'s DepthPolicy, the policy having served as many
untimed first (a runtime's warm-up; with `--warm-up N`, the first N batches of them only: the bench's
runtimes warm up on a round, 8 batches at B=1 and 2 at B=4; before run 32, on one). Each step's time is
off its cost by up to +-`--noise`, and scaled by a machine speed that wanders by `--drift` a millisecond
(this machine's memory speed moves by half within a fraction of a second; every system meets the same
wandering, drawn from the seed); the mean over `--seeds` seeds is printed against the best fixed
depth's, then how many seeds' runs came below `--low` times the best fixed depth on the same seed, and
the worst such ratio. With `--trace`, acceptance is replayed from the real held-out generations instead
(benchmarks/acceptance_trace.py): each seed serves every traced request, B at a time in a seeded order,
and each step accepts what a step from that point of that text accepts, so a request's acceptance rises
and falls as its text does. With `--catch-up C F`, auto's runtime runs M's catch-up before a step at
K > 0 after depth-0 steps, C times a depth-0 step's time, and its fill after LAG_WINDOW depth-0 steps,
F times (0.45 and 0.27 at B=8 here, 0.34 and 0.19 at B=1: benchmarks/README.md, "The fill"); a fixed
depth runs neither. A batch's last requests run on the smallest bucket of the bench's that holds
them, at its cost, as the bench's runtimes do (with --full-tails, at the batch's own bucket's), and
each policy first serves a batch of each smaller bucket's size. SIMULATED: without --catch-up neither
runs, and the costs do not move with the depth schedule as a real machine's do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from auto_commits import policy_at  # noqa: E402
from bench_preset import conditional_rates, shipped_rates, simulate  # noqa: E402

from compiled_mtp.depth_policy import DepthPolicy  # noqa: E402


def setting(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    return name, int(value) if value.isdigit() else float(value)  # a window's length is a count


def step_costs(path: Path) -> dict[int, dict[int, float]]:
    """B -> K -> ms a step, from `compiled-mtp bench`'s JSON (its iterations) or bench_preset.py's."""
    data = json.loads(path.read_text())
    if "engine" in data:
        rows = [(r["batch"], r["k"], r["iteration_ms"]) for r in data["engine"]]
    else:
        rows = [(r["B"], r["K"], r["step_ms"]) for r in data["rows"]]
    costs: dict[int, dict[int, float]] = {}
    for batch, k, ms in rows:
        if k != "auto":
            costs.setdefault(batch, {})[k] = ms
    return costs


def bench_rates(path: Path) -> list[float]:
    """Acceptance per draft position, given the one before was accepted, at the deepest depth the bench
    measured; the shipped model's K=3 rates where it measured none."""
    measured = json.loads(path.read_text()).get("acceptance") or []
    if not measured:
        return shipped_rates()
    return conditional_rates(max(measured, key=lambda a: a["k"])["per_position"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=ROOT / "benchmarks" / "bench-cpu.json")
    parser.add_argument(
        "--setting", type=setting, action="append", default=[], help="NAME=VALUE of DepthPolicy"
    )
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.2])
    parser.add_argument("--drift", type=float, nargs="+", default=[0.0, 0.03])
    parser.add_argument(
        "--switch", type=float, default=0.0, help="a step's extra cost after a change of depth (0.05: 5%%)"
    )
    parser.add_argument(
        "--catch-up",
        type=float,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("C", "F"),
        help="auto's MTP catch-up and fill, each a share of a depth-0 step (default: 0 0, not run)",
    )
    parser.add_argument(
        "--full-tails",
        action="store_true",
        help="a batch's last requests at its own bucket's cost (before December 7, 2026), not the smaller ones'",
    )
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--rev", action="append", default=[], help="a commit whose policy runs too")
    parser.add_argument(
        "--warm-up", type=int, default=1 << 30, help="batches served untimed first (default: all)"
    )
    parser.add_argument("--trace", type=Path, help="replay the acceptance of acceptance_trace.py's JSON")
    parser.add_argument(
        "--low", type=float, default=0.93, help="count the seeds below this ratio (default: 0.93)"
    )
    args = parser.parse_args()
    costs = step_costs(args.bench)
    trace = None
    if args.trace:
        traced = json.loads(args.trace.read_text())
        depth = traced.get("depth", 3)  # traces written before --depth ran at K=3
        deepest = max(k for by_depth in costs.values() for k in by_depth)
        if depth < deepest:  # a trace of K=D steps tells nothing of the drafts past D
            parser.error(f"--trace: its steps ran at K={depth}, the bench's reach K={deepest}")
        trace = traced["accepted"]
    rates = bench_rates(args.bench)
    policies: list[tuple[str, type[DepthPolicy], dict[str, float]]] = [("as shipped", DepthPolicy, {})]
    policies += [(f"{name}={value:g}", DepthPolicy, {name: value}) for name, value in args.setting]
    policies += [(f"at {rev}", policy_at(rev), {}) for rev in args.rev]

    def per_seed(
        batch: int,
        depths: dict[int, float],
        machine: tuple[float, float],
        policy: type[DepthPolicy] = DepthPolicy,
        **settings: float,
    ) -> list[float]:
        """tok/s of each seed's run."""
        tails = None if args.full_tails else {b: {k: costs[b][k] for k in depths} for b in costs if b < batch}
        return [
            simulate(
                batch,
                depths,
                args.tokens,
                rates,
                s,
                *machine,
                warm_up=args.warm_up,
                policy=policy,
                trace=trace,
                switch=args.switch,
                catch_up=tuple(args.catch_up),
                tails=tails,
                **settings,
            )["tok_s"]
            for s in range(args.seeds)
        ]

    for batch, cost in sorted(costs.items()):
        for machine in itertools.product(args.noise, args.drift):
            fixed = {k: per_seed(batch, {k: ms}, machine) for k, ms in cost.items()}
            best = max(fixed, key=lambda k: statistics.mean(fixed[k]))
            line = f"B={batch} noise {machine[0]:.0%} drift {machine[1]:g}: "
            line += f"best fixed K={best} {statistics.mean(fixed[best]):.0f} tok/s; auto"
            # Each seed's run against the best fixed depth on the same seed (the same requests, the
            # same machine): the runs a policy loses most in, where one mean hides them.
            seed_best = [max(runs) for runs in zip(*fixed.values())]
            for name, policy, settings in policies:
                runs = per_seed(batch, cost, machine, policy, **settings)
                ratios = [run / top for run, top in zip(runs, seed_best)]
                line += f"  {name} {statistics.mean(runs) / statistics.mean(fixed[best]):.3f}x"
                line += (
                    f" ({sum(r < args.low for r in ratios)} below {args.low:g}x, worst {min(ratios):.2f}x)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
