"""The engine's systems and llama.cpp's, timed in turns at every batch of prompts, and acceptance."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from ..capture import parallel
from ..llama_cpp_peer import LlamaCpp, LlamaCppMTP
from ..models.family import CausalLM
from ..passes.manager import without
from ..runtime import Runtime, SamplingParams, acceptance_length
from .prompts import Prompts
from .results import Acceptance, EngineRun, PeerRun

S = TypeVar("S")  # a system's name
G = TypeVar("G")  # the work a system runs in one turn


@dataclass
class Timing:
    """One run of `timed_generate`: wall seconds, and what the decode-only steps after the first took."""

    seconds: float  # the whole run, prefill included
    decode_seconds: float  # the steps after the first
    decode_steps: int  # runtime decode steps in those
    host_seconds: float  # runtime Python outside graph calls in those
    request_steps: int  # every decode step's, the one beside the prefill included


def timed_generate(rt: Runtime, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """Run `prompts` to completion through `step()` and time it. They must all fit the largest bucket,
    so that the first step prefills every prompt and the later ones only decode: those give the
    per-iteration figures."""
    start, initial = time.perf_counter(), rt.stats()["request_steps"]
    for prompt in prompts:
        rt.add_request(prompt, params)
    rt.step()
    before, first = rt.stats(), time.perf_counter()
    while rt.has_unfinished():
        rt.step()
    end, after = time.perf_counter(), rt.stats()
    return Timing(
        end - start,
        end - first,
        after["decode_steps"] - before["decode_steps"],
        after["host_seconds"] - before["host_seconds"],
        after["request_steps"] - initial,
    )


def summed(timings: Sequence[Timing]) -> Timing:
    """The figures of several timed generations, added up."""
    return Timing(*(sum(getattr(t, f.name) for t in timings) for f in fields(Timing)))


def turns(systems: list[S], groups: Sequence[G], rounds: int) -> Iterator[tuple[int, G, S]]:
    """(round, group, system) in the order the systems take turns: in each round every system runs a
    group before the next group starts, the order shifted by one at each group. The machine's memory
    speed moves by half within a fraction of a second here, so systems that each ran a whole round in
    turn met different speeds; taking turns at every group, each meets the same moments, and no system
    always runs right after the same other one."""
    shift = 0
    for r in range(rounds):
        for group in groups:
            for system in systems[shift:] + systems[:shift]:
                yield r, group, system
            shift = (shift + 1) % len(systems)


def timed_prompts(count: int, b: int) -> int:
    """The prompts a round generates at batch b: `count` rounded up to a multiple of b."""
    return -(-count // b) * b


def timed_batches(prompts: list[list[int]], count: int, b: int) -> list[list[list[int]]]:
    """The batches a round generates at batch b: the first timed_prompts(count, b) prompts, b at a time."""
    return [prompts[i : i + b] for i in range(0, timed_prompts(count, b), b)]


def measure_acceptance(rt: Runtime, prompts: list[list[int]], new_tokens: int) -> Acceptance:
    """Greedy acceptance at the runtime's depth; `rt` must be fresh, since stats() accumulate."""
    rt.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    s = rt.stats()
    rate = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
    assert isinstance(rt.mtp_depth, int), "acceptance is measured at a fixed depth"
    return Acceptance(
        rt.mtp_depth,
        s["acceptance_length"],
        rate,
        s["acceptance_rate_per_position"],
        s["draft_tokens"],
        s["accepted_tokens"],
    )


def engine_run(k: int | str, b: int, prompts: int, new_tokens: int, timings: list[Timing]) -> EngineRun:
    """The best of `timings` (rounds of the same `prompts` prompts at depth k, b at a time)."""
    # Every request emits new_tokens - 1 tokens in decode steps (the first comes from its prefill).
    length = acceptance_length(
        prompts * (new_tokens - 1) * len(timings), sum(t.request_steps for t in timings)
    )
    best = min(timings, key=lambda t: t.seconds)
    iteration = best.decode_seconds / best.decode_steps
    host = best.host_seconds / best.decode_steps
    return EngineRun(
        k,
        b,
        prompts * new_tokens / best.seconds,
        prompts * (new_tokens - 1) / best.decode_seconds,
        best.seconds,
        1e3 * iteration,
        1e3 * host,
        host / iteration,
        length,
        best.decode_steps,
        decode_runs=[prompts * (new_tokens - 1) / t.decode_seconds for t in timings],
    )


def _runtimes(model: CausalLM, args: argparse.Namespace) -> dict[int | str, Runtime]:
    """One runtime per depth, so each one's stats() hold only that depth, and one at "auto" over them
    all (when there is more than one). Depth 0 alone loads no MTP state, as `mtp_depth=0` does."""
    systems = list(args.depths) + ["auto"] * (len(args.depths) > 1 and max(args.depths) > 0)
    return {
        k: Runtime(
            model,
            mtp_depth=k,
            mtp_depths=args.depths if k == "auto" else None,
            batch_sizes=args.batch_sizes,
            max_seq_len=args.prompt_len + args.new_tokens,
            prefill_chunk=min(64, args.prompt_len),  # the runtime's default chunk, which must fit max_seq_len
            compile_backend=args.backend,
            cache_dir=None if args.no_cache else args.cache_dir,
            passes=without(args.disable_pass),
        )
        for k in systems
    }


Peers = dict[str, LlamaCpp | LlamaCppMTP]  # by the system name the report shows


def bench_engine(
    model: CausalLM, prompts: Prompts, args: argparse.Namespace, peers: Peers | None = None
) -> tuple[list[Acceptance], list[EngineRun], list[PeerRun], int, int]:
    """Acceptance at every depth, then timings: per B, each system warmed up, then `runs` rounds in
    which the systems take turns; at B = 1 the peers take their turns too. Returns (acceptance,
    runs, peer runs, compiles, recompiles)."""
    peers = peers or {}
    runtimes = _runtimes(model, args)
    for rt in runtimes.values():  # every graph now: one first met in a timed round would be timed building
        parallel.ready(rt, list(rt.graphs.keys))
    acceptance = []
    for k, rt in runtimes.items():
        if isinstance(k, int) and k > 0:  # not "auto"
            acceptance.append(
                measure_acceptance(rt, prompts.token_ids[: args.accept_prompts], args.new_tokens)
            )
            print(f"  K={k}: acceptance length {acceptance[-1].acceptance_length:.2f}", flush=True)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    runs, peer_runs = [], []
    for b in args.batch_sizes:
        groups = timed_batches(prompts.token_ids, args.timed_prompts, b)
        count = sum(map(len, groups))
        for _, group, k in turns(list(runtimes), groups, 1):  # a round untimed
            timed_generate(runtimes[k], group, params)
        peers_now = peers if b == 1 else {}
        for peer in peers_now.values():
            peer.generate(groups[0][0], args.new_tokens)
        depths_before = runtimes["auto"].stats()["depth_histogram"] if "auto" in runtimes else {}
        timings: dict[int | str, list[list[Timing]]] = {k: [[] for _ in range(args.runs)] for k in runtimes}
        peer_seconds = {name: [0.0] * args.runs for name in peers_now}
        for r, group, name in turns([*runtimes, *peers_now], groups, args.runs):
            if isinstance(name, str) and name in peers_now:
                peer_seconds[name][r] += _peer_seconds(peers_now[name], group[0], args.new_tokens)
            else:
                timings[name][r].append(timed_generate(runtimes[name], group, params))
        expected = next(iter(runtimes.values())).generate(groups[0], params)[0].token_ids if peers_now else []
        for name, peer in peers_now.items():
            run = _compared_peer_run(name, peer, groups[0][0], expected, peer_seconds[name], count)
            peer_runs.append(run)
            print(f"  {name} B=1: {peer_runs[-1].tokens_per_s:.1f} tok/s", flush=True)
        for k, rt in runtimes.items():
            runs.append(engine_run(k, b, count, args.new_tokens, [summed(t) for t in timings[k]]))
            if k == "auto":
                after = rt.stats()["depth_histogram"]
                runs[-1].depth_histogram = {
                    d: n - depths_before.get(d, 0) for d, n in after.items() if n > depths_before.get(d, 0)
                }
            print(f"  K={k} B={b}: {runs[-1].tokens_per_s:.1f} tok/s", flush=True)
    stats = [rt.stats() for rt in runtimes.values()]
    return acceptance, runs, peer_runs, sum(s["compiles"] for s in stats), sum(s["recompiles"] for s in stats)


def _peer_seconds(peer: LlamaCpp | LlamaCppMTP, prompt: list[int], new_tokens: int) -> float:
    start = time.perf_counter()
    peer.generate(prompt, new_tokens)
    return time.perf_counter() - start


def _compared_peer_run(
    name: str,
    peer: LlamaCpp | LlamaCppMTP,
    prompt: list[int],
    expected: list[int],
    seconds: list[float],
    prompts: int,
) -> PeerRun:
    """The peer's run over `prompts` prompts, its tokens from one more generation of the first (which its
    MTP counts are taken over)."""
    if isinstance(peer, LlamaCppMTP):
        peer.drafted = peer.accepted = 0
    run = peer_run(peer.generate(prompt, len(expected)), expected, seconds, name, prompts)
    if isinstance(peer, LlamaCppMTP):
        run.drafted, run.accepted = peer.drafted, peer.accepted
    return run


def peer_run(
    tokens: list[int], expected: list[int], seconds: list[float], system: str = "llama.cpp", prompts: int = 1
) -> PeerRun:
    """A peer's best of `seconds`, each the time of `prompts` generations of len(expected) tokens; a token
    of the first that differs from the engine's is reported, not hidden."""
    differ = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if differ is None and len(tokens) != len(expected):
        differ = min(len(tokens), len(expected))
    return PeerRun(system, 1, prompts * len(expected) / min(seconds), min(seconds), differ is None, differ)
