"""A random preset's decode steps at every (B, K), each key built in a process of its own, timed in turns.

    python benchmarks/bench_preset.py --device cuda --dtype bfloat16 --batch-sizes 1 8 32 --depths 0 1 2 3
    python benchmarks/bench_preset.py --preset tiny --batch-sizes 1 4 --depths 0 3 --new-tokens 16

The dsv3-proportions preset's 30-layer graphs take minutes each to compile, so every (B, K) runtime
builds its graphs in its own process, all at once. Once they are built (or `--build-seconds` have
passed: a key not built by then is reported and left out), the processes take turns: each runs B
prompts of `--new-tokens` tokens in every round, so a change in the machine's speed meets them all,
and a key's step time is its best round's decode seconds per decode step.

A random model's drafts are never accepted, and graphs have static shapes, so a step's time does not
depend on acceptance. Tokens/s are SIMULATED from the measured step times: a decode run of B requests
in which each draft position is accepted at the shipped model's measured rate at K=3 (held-out text,
train_log.json, made conditional on the position before being accepted), seeded. `auto` is simulated
the same way: the runtime's own DepthPolicy chooses each step's depth, learning its costs from the
measured step times (one per key, as its timers would read them) and its acceptance from the drawn
steps. The simulation leaves out the host's time per step, which the real runtime adds (its policy
included), and the MTP catch-up a change from K=0 runs.

Results are printed and written to --out (JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp import Runtime, SamplingParams  # noqa: E402
from compiled_mtp.bench import timed_generate  # noqa: E402
from compiled_mtp.depth_policy import DepthPolicy  # noqa: E402
from compiled_mtp.graphs.plan import step_plan  # noqa: E402
from compiled_mtp.graphs.state import LAG_WINDOW  # noqa: E402
from compiled_mtp.models.checkpoint import load_model  # noqa: E402
from compiled_mtp.models.synthetic import PRESETS, preset_config, write_random_checkpoint  # noqa: E402
from compiled_mtp.runtime import DTYPES  # noqa: E402

SHIPPED_LOG = ROOT / "compiled_mtp" / "default_model" / "train_log.json"


def conditional_rates(reach: list[float]) -> list[float]:
    """Acceptance per draft position given the one before was accepted, from the share of steps whose
    j-th draft is accepted."""
    return [r / prev for r, prev in zip(reach, [1.0, *reach])]


def shipped_rates() -> list[float]:
    """The shipped model's acceptance at K=3 per draft position, given the one before was accepted."""
    return conditional_rates(json.loads(SHIPPED_LOG.read_text())["acceptance"]["K3"]["per_position"])


def prompts(args: argparse.Namespace, vocab: int, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).tolist()


def worker(conn: Connection, checkpoint: str, batch: int, depth: int, args: argparse.Namespace) -> None:
    """Build the (batch, depth) runtime, say how long it took, then time one run per "run" received."""
    try:
        start = time.perf_counter()
        model = load_model(checkpoint, dtype=DTYPES[args.dtype], device=args.device, with_mtp=depth > 0)
        rt = Runtime(
            model,
            mtp_depth=depth,
            batch_sizes=(batch,),
            max_seq_len=args.prompt_len + args.new_tokens + depth + 1,
            prefill_chunk=args.prompt_len,
        )
        work = prompts(args, model.cfg.vocab_size, batch)
        sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        timed_generate(rt, work, sampling)  # builds the graphs
        timed_generate(rt, work, sampling)  # the caches the first run's compiles left cold
        conn.send(("ready", time.perf_counter() - start))
        while conn.recv() == "run":
            t = timed_generate(rt, work, sampling)
            conn.send((1e3 * t.decode_seconds / t.decode_steps, 1e3 * t.host_seconds / t.decode_steps))
    except Exception as e:  # reported by the coordinator, which goes on with the other keys
        conn.send(
            ("failed", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        )


def build_all(args: argparse.Namespace, checkpoint: Path) -> tuple[dict, dict, dict]:
    """Start every key's process and wait for its graphs: (connections, build seconds, failures)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    keys = [(b, k) for b in args.batch_sizes for k in args.depths]
    # Inductor's compile workers, shared out: every process compiles at once.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // len(keys))))
    conns, procs = {}, {}
    for key in keys:
        ours, theirs = ctx.Pipe()
        procs[key] = ctx.Process(target=worker, args=(theirs, str(checkpoint), *key, args), daemon=True)
        procs[key].start()
        conns[key] = ours
    built, failed, deadline = {}, {}, time.monotonic() + args.build_seconds
    waiting = dict(conns)
    while waiting and (left := deadline - time.monotonic()) > 0:
        for conn in wait(list(waiting.values()), timeout=left):
            key = next(k for k, c in waiting.items() if c is conn)
            del waiting[key]
            try:
                status, detail = conn.recv()
            except EOFError:
                status, detail = "failed", f"the process exited (code {procs[key].exitcode})"
            if status == "ready":
                built[key] = detail
            else:
                failed[key] = detail
            print(
                f"  B={key[0]:2d} K={key[1]}: {status} after {time.monotonic() - deadline + args.build_seconds:.0f} s"
                + ("" if status == "ready" else f": {detail}"),
                flush=True,
            )
    for key in waiting:
        failed[key] = f"not built within {args.build_seconds:.0f} s"
        procs[key].kill()
    return {k: conns[k] for k in built}, built, failed


def time_in_turns(conns: dict, runs: int) -> dict:
    """Each key's best decode ms per step (and host ms per step of that run), the keys taking turns."""
    best: dict = {}
    order = list(conns)
    for r in range(runs):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            conns[key].send("run")
            step, host = conns[key].recv()
            if key not in best or step < best[key][0]:
                best[key] = (step, host)
    for conn in conns.values():
        conn.send("stop")
    return best


def simulate(
    batch: int,
    costs: dict[int, float],
    tokens: int,
    rates: list[float],
    seed: int,
    noise: float = 0.0,
    drift: float = 0.0,
    warm_up: int = 0,
    policy: type[DepthPolicy] = DepthPolicy,
    trace: list[list[int]] | None = None,
    switch: float = 0.0,
    catch_up: tuple[float, float] = (0.0, 0.0),
    tails: dict[int, dict[int, float]] | None = None,
    **settings: float,
) -> dict:
    """Tokens/s of B requests of `tokens` tokens each, with drafts accepted at `rates` per position,
    at the depth `costs` (ms a step) holds one of (fixed) or, with several, chosen by
    policy(**settings) ("auto"); each step's time off its cost by up to +-noise, uniformly, and
    scaled by the machine's speed, which wanders (a log-normal walk of `drift` a millisecond, drawn
    from the seed alone, so every system meets the same machine). The policy first serves the first
    `warm_up` batches of the same requests untimed, as a runtime does before a timed run (the bench
    warms up on a round of them). With `trace` (for each request, the drafts a step at the trace's
    depth, at least the deepest of `costs`, accepts with g tokens generated, at g = 1.., from
    benchmarks/acceptance_trace.py), every request of the trace is served instead, B at a time in a
    seeded order, accepting what its text accepts; `tokens` and `rates` are then unused. A step at
    another depth than the step before costs `switch` more (0.05: 5%), as the first step of other
    graphs does on a real machine. Under several depths, `catch_up` = (C, F) runs M's catch-up before
    a step at K > 0 that follows depth-0 steps, C times a depth-0 step's time, and its fill once
    LAG_WINDOW depth-0 steps lag, F times (runtime.py; the policy records each catch-up's time). With
    `tails` (smaller buckets' ms a step by depth, as `costs`), a batch's requests that outlive the
    others run on the smallest bucket that holds them, as a runtime's do; without, on the batch's. The
    policy then first serves a batch of each smaller bucket's size, untimed, as the bench's runtimes
    serve the smaller batch sizes before the larger."""
    buckets = {**(tails or {}), batch: costs}
    chooser = policy(sorted(costs), **settings)
    speed = _speed_path(seed, drift)
    result: dict = {}
    smaller = [(1 << 21, 1, b) for b in sorted(tails or {})]
    for offset, served, size in (
        smaller + ([(1 << 20, warm_up, batch)] if warm_up else []) + [(0, None, batch)]
    ):
        rng = random.Random(seed + offset)
        groups = _groups(size, tokens, rates, trace, rng)[:served]
        result = _serve(chooser, buckets, groups, rng, noise, speed, switch, catch_up)
    return result


Request = tuple[int, Callable[[int, int], int]]  # tokens wanted; (tokens generated, depth) -> accepted


def _groups(
    batch: int, tokens: int, rates: list[float], trace: list[list[int]] | None, rng: random.Random
) -> list[list[Request]]:
    """The batches a simulated run serves, one after another."""
    if trace is None:
        drawn = lambda g, k: next((j for j in range(k) if rng.random() >= rates[j]), k)  # noqa: E731
        return [[(tokens, drawn)] * batch]
    rows = rng.sample(trace, len(trace))
    replayed = [(len(row) - 1, lambda g, k, row=row: min(k, row[g]) if g < len(row) else 0) for row in rows]
    return [replayed[i : i + batch] for i in range(0, len(replayed), batch)]


@functools.lru_cache(maxsize=64)
def _speed_path(seed: int, drift: float, milliseconds: int = 1 << 16) -> tuple[float, ...]:
    """The machine's speed factor in each millisecond: exp of a walk pulled back towards 0."""
    if not drift:
        return (1.0,)
    rng, x, path = random.Random(-1 - seed), 0.0, []
    for _ in range(milliseconds):
        x = 0.99 * x + drift * rng.gauss(0, 1)
        path.append(math.exp(x))
    return tuple(path)


def _serve(
    policy: DepthPolicy,
    buckets: dict[int, dict[int, float]],
    groups: list[list[Request]],
    rng: random.Random,
    noise: float,
    speed: tuple[float, ...],
    switch: float,
    catch_up: tuple[float, float],
) -> dict:
    depths, seconds, chosen = policy.depths, 0.0, []

    def lagging(share: float, batch: int) -> float:
        """A catch-up's or fill's time: `share` of a depth-0 step of `batch`, at this moment's speed."""
        moment = speed[min(int(seconds * 1e3), len(speed) - 1)]
        return share * buckets[batch][0] / 1e3 * moment * (1 + noise * rng.uniform(-1, 1))

    for group in groups:
        own = [policy.prior() for _ in group]
        left = [wanted for wanted, _ in group]
        lag = 0  # depth-0 steps M has not run over (the prefill leaves it current)
        while any(left):
            live = [i for i in range(len(group)) if left[i]]
            batch = min(b for b in buckets if b >= len(live))
            k = (
                depths[0]
                if len(depths) == 1
                else policy.choose(batch, [own[i] for i in live], [left[i] for i in live])
            )
            plan = step_plan(batch, k, depths)  # as the runtime's step: a catch-up or fill where it runs one
            share = catch_up[0] if plan.catch_up else catch_up[1]
            if lag and (plan.catch_up or (plan.fill and lag >= LAG_WINDOW)) and share:
                extra = lagging(share, batch)
                seconds += extra
                if plan.catch_up:
                    policy.record_catch_up(batch, extra)
                lag = 0
            lag = lag + 1 if plan.fill else 0
            accepted = []
            for i in live:
                wanted, drafts = group[i]
                accepted.append(drafts(1 + wanted - left[i], k))
                left[i] -= min(left[i], accepted[-1] + 1)
            policy.observe([own[i] for i in live], k, accepted)
            moment = speed[min(int(seconds * 1e3), len(speed) - 1)]
            step = buckets[batch][k] / 1e3 * moment * (1 + noise * rng.uniform(-1, 1))
            step *= 1 + switch * (bool(chosen) and chosen[-1] != k)
            seconds += step
            policy.record_cost(batch, k, step)
            chosen.append(k)
    served = sum(wanted for group in groups for wanted, _ in group)
    return {"tok_s": served / seconds, "depths": {k: chosen.count(k) for k in depths}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="dsv3-proportions")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32, help="per request in each timed run")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds, every key once in each")
    parser.add_argument("--build-seconds", type=float, default=1800.0, help="how long to wait for the graphs")
    parser.add_argument("--sim-tokens", type=int, default=256, help="tokens per request in the simulation")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "preset-cpu.json")
    args = parser.parse_args()
    if missing := sorted(set(args.depths) - set(range(len(shipped_rates()) + 1))):
        raise SystemExit(
            f"error: depths: the shipped model's acceptance was measured up to K=3, not at {missing}"
        )
    device = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else f"cpu, {os.cpu_count()} cores"
    )
    print(
        f"random {args.preset}, {args.dtype} on {device}: "
        f"building {len(args.batch_sizes) * len(args.depths)} keys at once",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(
            Path(tmp) / args.preset, preset_config(args.preset), dtype=torch.bfloat16
        )
        conns, built, failed = build_all(args, checkpoint)
        best = time_in_turns(conns, args.runs)
    rates = shipped_rates()
    result = {
        "preset": args.preset,
        "device": device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "acceptance_rates": rates,
        "simulated_tokens": args.sim_tokens,
        "rows": [],
        "failed": {},
    }
    for (b, k), why in sorted(failed.items()):
        result["failed"][f"B={b} K={k}"] = why
    print("\n  B  K   step ms  host ms   simulated tok/s   vs K=0   (build s)")
    for b in args.batch_sizes:
        costs = {k: best[b, k][0] for k in args.depths if (b, k) in best}
        sims = {k: simulate(b, {k: ms}, args.sim_tokens, rates, seed=b) for k, ms in costs.items()}
        if len(costs) > 1:
            sims["auto"] = simulate(b, costs, args.sim_tokens, rates, seed=b)
        for k, sim in sims.items():
            step, host = best[b, k] if k != "auto" else (None, None)
            vs = sim["tok_s"] / sims[0]["tok_s"] if 0 in sims else None
            result["rows"].append(
                {
                    "B": b,
                    "K": k,
                    "step_ms": step,
                    "host_ms": host,
                    "build_s": built.get((b, k)),
                    "simulated_tok_s": sim["tok_s"],
                    "vs_k0": vs,
                    "depths": sim["depths"],
                }
            )
            timing = f"{step:9.3f} {host:8.3f}" if step is not None else f"{'':18s}"
            print(
                f"{b:3d} {k!s:>4} {timing} {sim['tok_s']:17.1f}   {vs or float('nan'):6.2f}x"
                + (f"   ({built[b, k]:.0f})" if k != "auto" else f"   depths {sim['depths']}")
            )
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
