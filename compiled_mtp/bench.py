"""`compiled-mtp bench`: the engine against HF transformers and the memory-bandwidth bound, in one process.

What it measures (greedy decoding throughout, the same prompts for every system):

- acceptance on held-out text: for each K > 0, a fresh runtime at depth K generates from every
  acceptance prompt; its `stats()` give the acceptance length (tokens per request and decode step)
  and the acceptance rate per draft position;
- tokens/s of the engine for each (K, B), and with `mtp_depth="auto"` (each step's depth chosen among
  the measured ones): with a capture cache, every system loads (or builds) all of its graphs first,
  as a server does from its capture profile, since a graph first met in a timed round (auto's fill,
  say) would be timed building; one untimed round warms every system up (auto learns its costs
  there, as a server's runtime has long before its steady state), then `--runs` rounds in which the
  systems take turns at every batch of prompts (`turns`), so a change in memory speed meets them
  all; the best run counts, prompts * new tokens / wall seconds of the run (prefill
  included). Each row's speedup over K=0 at its B is set beside the bandwidth bound's speedup and the
  fraction of it achieved. The goals' ratios of two systems, of their best runs, come with the same
  ratio taken round by round (median and range), in which a drift in memory speed between rounds
  cancels. Host time per iteration is stats()["host_seconds"] / decode steps over the decode-only
  steps of the best run (every step after a batch's first, which prefills its B prompts); its share is
  that over the decode-only wall time per step;
- HF transformers `generate` at each B and `generate(use_mtp=True)` at B = 1 (HF refuses batches),
  on the first B prompts only (HF is slow): warm-up run, best of `--runs`, whole-call wall time;
- on CPU, where llama-cpp-python is installed, llama.cpp at B = 1 on a GGUF export of the same
  checkpoint (llama_cpp_peer.py), taking its turns with the engine's systems: its plain greedy
  decoding, and for each K > 0 its own MTP graph drafting K tokens a step (with the drafts it
  accepted in the compared generation); each row's greedy tokens are compared with the engine's. A
  llama.cpp without the MTP graph leaves those rows out with a one-line note;
- the memory-bandwidth bound: weight bytes one step must read, as the engine's kernels read them (a
  weight the C++ ops read from bfloat16 panels, or the graphs from a bfloat16 copy, counts half its
  float32 bytes, at every step): the target's parameters, counting one embedding row and of a MoE
  layer's routed experts only those the step's rows are routed to, plus per draft step the MTP
  layer's, the shared LM head and one embedding row. A K-step at B runs B (K + 1) rows through the
  target's verify and B through each of its draft steps, the draft extend among them: the extend runs
  all B (K + 1) rows only through the parts of MTP layer 0 that write its cache entries (where the
  family's layer splits there, `CausalLM.mtp_every_row_modules`; DeepSeek-V4's block runs every row
  through everything). Rows routed apart read the union of their experts, which an eager pass over
  the prompts measures (expert_reads.py). Over the measured bandwidth the bytes give the most steps per second; times B
  and the row's acceptance length they bound tokens/s. The bandwidth is the faster of a large copy's
  (memory's, as STREAM's Copy counts it) and a warm read of as many bytes as a K=1 step of one row
  reads: a decode reads the same weights at every step, so where they fit the last-level cache they
  stay there, and the cache's speed bounds a step;
- the roofline: the same bytes, and the multiply-adds of those weights (2 per element of every
  matrix, per row: B (K + 1) rows of the target's verify and of the extend's cache-entry parts, B of
  the rest of each draft step; attention over the cache not counted) at the rate a large torch.mm reaches on the same
  threads, or, for products of as many rows as run on AMX's tiles (a CPU that has them, bfloat16
  weights), at the rate the C++ ops' tile products reach on a weight in cache. A step takes at least
  the longer of the two, so the roofline's speedup over K=0 is at most the bandwidth bound's, and below
  it where a verify of B (K + 1) rows is more arithmetic than reading. Both bound tokens/s, not the
  ratios of two rows: a K=0 step that runs far from its bound (its fixed costs) leaves a deeper step,
  which spreads those costs over more tokens, room to beat the ratio of the two bounds.

Prompts are held-out text when the checkpoint has a tokenizer: windows of `--prompt-len` tokens one
third into each file that the shipped model's training holds out (compiled_mtp/corpus.py), as its
own acceptance measurement (train_log.json) takes them; else seeded random token ids. In each round
every system at batch B generates the first `--timed-prompts` prompts (rounded up to a multiple of
B), B at a time, so that a B = 1 row's speed rests on the acceptance of several prompts, not one; the
acceptance measurement takes the first `--accept-prompts`.

Results go to OUT/bench-<device type>.json (the dataclasses below, as dicts; `bound.steps_per_s`,
`bound.roofline_steps_per_s`, `bound.routed_bytes` and `bound.verify_experts` are keyed by "K/B")
and a plot to OUT/bench-<device type>.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from . import corpus, hf_baseline, llama_cpp_peer
from .capture import parallel, weight_copies
from .capture.cache import user_cache
from .capture.compiler import BACKENDS
from .capture.profile import DEFAULT_MODEL
from .expert_reads import Reader, Routing, experts_read, is_stacked_experts, record
from .llama_cpp_peer import LlamaCpp, LlamaCppMTP
from .models.checkpoint import load_model
from .models.draft_vocab import read_ranking
from .models.family import CausalLM
from .models.gguf_export import LAYOUTS, export_gguf
from .models.registry import read_config
from .ops import library
from .passes.manager import add_pass_switch, without
from .runtime import DTYPES, Runtime, SamplingParams, acceptance_length, check_device
from .tokenizer import Tokenizer

S = TypeVar("S")  # a system's name
G = TypeVar("G")  # the work a system runs in one turn

GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
MATPLOTLIB_MISSING = "matplotlib is not installed: install the bench extra: pip install 'compiled_mtp[bench]'"


# ------------------------------------------------------------------------------------------ results


@dataclass
class Meta:
    """What was run, where, and on which prompts."""

    model: str
    device: str
    device_name: str
    dtype: str
    backend: str
    threads: int
    torch: str
    transformers: str
    python: str
    date: str
    new_tokens: int
    prompt_len: int
    runs: int
    depths: list[int]
    batch_sizes: list[int]
    prompt_source: str  # "held-out" or "random"
    prompts: str  # where the prompts came from, for people
    accept_prompts: int
    draft_vocab: int | None = None  # drafts among this many most frequent tokens (None: all)
    hf_attention: str = ""
    bfloat16_mlps: bool = False  # the dense MLPs multiplied in bfloat16 (--bfloat16-mlps)
    compiles: int = 0
    recompiles: int = 0


@dataclass
class Acceptance:
    """Greedy draft acceptance at depth K over the acceptance prompts."""

    k: int
    acceptance_length: float  # tokens per request and decode step, in [1, K + 1]
    acceptance_rate: float  # accepted / drafted
    per_position: list[float]  # acceptance rate of draft position 1..K
    draft_tokens: int
    accepted_tokens: int


@dataclass
class EngineRun:
    """compiled_mtp at depth K (or "auto") and batch B."""

    k: int | str
    batch: int
    tokens_per_s: float  # prompts * new tokens / best wall seconds (prefill included)
    decode_tokens_per_s: float  # prompts * (new tokens - 1) / its decode seconds: what speculation changes
    seconds: float  # best run
    iteration_ms: float  # decode-only wall time per step of the best run
    host_ms: float  # runtime Python outside graph calls per step
    host_share: float  # host_ms / iteration_ms
    acceptance_length: float  # tokens per request and decode step over the timed runs
    decode_steps: int  # of the best run
    bound_tokens_per_s: float = 0.0  # the memory-bandwidth bound at this K, B and acceptance length
    speedup: float = 0.0  # decode_tokens_per_s over K=0's at this B (the bound counts no prefill either)
    bound_speedup: float = 0.0  # bound_tokens_per_s over K=0's
    bound_fraction: float = 0.0  # speedup / bound_speedup
    roofline_tokens_per_s: float = 0.0  # the roofline (bytes or multiply-adds) at this K, B and acc. length
    roofline_speedup: float = 0.0  # roofline_tokens_per_s over K=0's
    depth_histogram: dict[int, int] | None = None  # auto: decode steps run at each depth, timed runs
    decode_runs: list[float] = field(default_factory=list)  # decode tok/s of each timed run, by round


@dataclass
class HFRun:
    """HF transformers at batch B: `generate` (k = 0) or `generate(use_mtp=True)` (k = its draft count)."""

    system: str
    k: int
    batch: int
    tokens_per_s: float
    seconds: float
    acceptance_length: float | None = None  # generate(use_mtp=True) only
    acceptance_rate: float | None = None


@dataclass
class PeerRun:
    """Another engine on the same checkpoint, prompts and token counts, timed in turns with ours at
    B = 1: llama.cpp's plain greedy decoding, and its MTP speculative decoding at each depth."""

    system: str
    batch: int
    tokens_per_s: float
    seconds: float
    same_tokens: bool  # its greedy tokens equal the engine's
    first_difference: int | None = None  # index of the first token that differs
    drafted: int | None = None  # MTP rows: drafts made and accepted in the compared generation
    accepted: int | None = None


@dataclass
class Bound:
    """Weight bytes per step over measured bandwidth: the most steps per second memory allows. The
    bandwidth is the faster of a large copy's (memory's) and a warm read of as many bytes as a step
    reads (`resident_bytes_per_s`): where a step's weights stay in the cache between steps, the cache's
    speed bounds it, not memory's."""

    copy_bytes: int  # size of the tensor copied
    bandwidth_bytes_per_s: float  # best of 5 copies, read + written bytes over seconds
    target_bytes: int  # read by one target forward of one row
    mtp_step_bytes: list[int]  # read by one draft step of one row, per MTP layer
    steps_per_s: dict[str, float]  # by "K/B": the faster bandwidth / (target + K draft steps + routed)
    resident_bytes_per_s: float = 0.0  # best of 5 reads of target + one draft step's bytes, just read
    routed_bytes: dict[str, int] = field(default_factory=dict)  # by "K/B": routed experts beyond one row's
    expert_count: int = 0  # routed experts of a MoE layer (0: a dense model)
    verify_experts: dict[str, float] = field(default_factory=dict)  # by "K/B": read a target MoE layer
    flops_per_s: float = 0.0  # the best of 5 large torch.mm products, float operations over seconds
    target_flops: int = 0  # of one target forward's weights, per row
    mtp_step_flops: list[int] = field(default_factory=list)  # of one draft step's, per row and MTP layer
    extend_row_flops: int = 0  # of MTP layer 0's parts a draft extend runs on every row of its block, per row
    roofline_steps_per_s: dict[str, float] = field(default_factory=dict)  # by "K/B": bytes or arithmetic
    # Rows from which the ops' products of bfloat16 weights run faster than float32's (on AMX's tiles,
    # or from 1 row on the bfloat16 dot products, --bfloat16-mlps); 0: none do.
    tile_rows: int = 0
    tile_flops_per_s: float = 0.0  # their rate: the best of 5 such products of 16 rows, on weights in cache


@dataclass
class Goal:
    """A ratio the project's goals are about; `goal` None for ratios reported for context only."""

    id: str
    name: str
    value: float | None
    goal: float | None
    met: bool | None
    detail: str


@dataclass
class BenchResult:
    meta: Meta
    acceptance: list[Acceptance]
    engine: list[EngineRun]
    hf: list[HFRun]
    bound: Bound
    peers: list[PeerRun]
    goals: list[Goal]


# ------------------------------------------------------------------------------------------ prompts


@dataclass
class Prompts:
    token_ids: list[list[int]]
    source: str  # "held-out" or "random"
    detail: str


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> Prompts:
    """Seeded random token ids, for checkpoints without a tokenizer."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (count, length), generator=gen).tolist()
    return Prompts(
        ids,
        "random",
        f"{count} random prompts of {length} token ids (seed {seed}): the checkpoint has no tokenizer",
    )


def held_out_prompts(model_dir: Path, count: int, length: int) -> Prompts:
    """`count` prompts of `length` tokens from the shipped model's held-out files (compiled_mtp/corpus.py),
    each a window one third into a file, as its training script's acceptance measurement takes them."""
    _, held = corpus.split(corpus.stdlib_files())
    ids = corpus.acceptance_prompts(Tokenizer(model_dir / "tokenizer.json").encode, held, count, length)
    if len(ids) < count:
        raise ValueError(
            f"prompt-len: only {len(ids)} of {len(held)} held-out files have {3 * length} "
            f"tokens, {count} prompts are needed; use a shorter --prompt-len"
        )
    detail = (
        f"{count} prompts of {length} tokens from {len(held)} held-out stdlib files "
        f"(compiled_mtp/corpus.py split, Python {platform.python_version()})"
    )
    return Prompts(ids, "held-out", detail)


def bench_prompts(model_dir: Path, vocab_size: int, count: int, length: int) -> Prompts:
    """Held-out text when the checkpoint has a tokenizer, else seeded random ids."""
    if (model_dir / "tokenizer.json").exists():
        return held_out_prompts(model_dir, count, length)
    return random_prompts(vocab_size, count, length)


# ------------------------------------------------------------------------------------------ engine


def _sync(device: str) -> None:
    """Wait for queued device work, so wall clocks measure it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


# ------------------------------------------------------------------------------------------ HF


def best_of(runs: int, device: str, fn: Callable[[], object]) -> float:
    """Seconds of the fastest of `runs` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def bench_hf(path: Path, prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[HFRun], str]:
    """HF `generate` at every B and, where HF runs the family's MTP layers, `generate(use_mtp=True)` at
    B = 1, in HF's default attention.
    Returns the runs and the attention implementation used."""
    model = hf_baseline.load_hf(path, dtype=DTYPES[args.dtype], device=args.device, attn_implementation=None)
    n = args.new_tokens
    rows = []
    for b in args.batch_sizes:
        seconds = best_of(args.runs, args.device, partial(hf_baseline.hf_generate, model, prompts[:b], n))
        rows.append(HFRun("generate", 0, b, b * n / seconds, seconds))
        print(f"  HF generate B={b}: {rows[-1].tokens_per_s:.1f} tok/s", flush=True)
    k = model.config.num_nextn_predict_layers
    family, _ = read_config(path / "config.json")
    if k and max(args.depths) > 0 and not family.hf_mtp:
        print(f"  no HF generate(use_mtp=True) row: HF transformers does not run {family.name}'s MTP layer")
    elif k and max(args.depths) > 0:
        outputs = []
        seconds = best_of(
            args.runs, args.device, lambda: outputs.append(hf_baseline.hf_mtp_generate(model, prompts[0], n))
        )
        accepted = outputs[-1][1]  # greedy: every run accepts the same drafts
        # As for the engine: the n - 1 tokens after the prefill's, per verification step.
        rows.append(
            HFRun(
                "generate(use_mtp=True)",
                k,
                1,
                n / seconds,
                seconds,
                (n - 1) / len(accepted),
                sum(accepted) / (k * len(accepted)),
            )
        )
        print(f"  HF generate(use_mtp=True) B=1: {rows[-1].tokens_per_s:.1f} tok/s", flush=True)
    return rows, model.config._attn_implementation


# ------------------------------------------------------------------------------------------ bound


def _layer_size(layer: torch.nn.Module, num_experts_per_tok: int, size: Callable[[torch.Tensor], int]) -> int:
    """`size` summed over the weights one token reads from a decoder layer: all of them except the
    routed experts, of which it reads only the `num_experts_per_tok` it is routed to."""
    total = 0
    for module in layer.modules():
        amount = sum(size(p) for p in module.parameters(recurse=False))
        stacked = is_stacked_experts(module)
        total += amount * num_experts_per_tok // next(module.parameters()).shape[0] if stacked else amount
    return total


def step_sizes(model: CausalLM, size: Callable[[torch.Tensor], int], row: int) -> tuple[int, list[int]]:
    """`size` summed over what one target forward reads, and one draft step per MTP layer: `row` for its
    embedding row, its layers, the final norm and the LM head (a draft step: the draft head of a
    restricted draft vocabulary)."""
    cfg, layers = model.cfg, model.model.layers
    mtp_layers = [model.mtp_layer(i) for i in range(model.num_mtp_layers)]
    head = size(model.lm_head.weight)
    k = cfg.num_experts_per_tok or 0
    target = row + sum(_layer_size(layer, k, size) for layer in layers[: cfg.num_hidden_layers])
    target += size(model.model.norm.weight) + head
    draft_head = head if model.draft_head is None else size(model.draft_head.weight)
    return target, [row + _layer_size(layer, k, size) + draft_head for layer in mtp_layers]


def routed_bytes(
    routing: Routing, depths: list[int], batch_sizes: list[int], extend_every_row: bool = False
) -> dict[str, int]:
    """By "K/B": the bytes of routed experts a K-step at B reads beyond one row's (as the engine's
    kernels read them): every target MoE layer's union over the verify's B (K + 1) rows, and B rows'
    at each draft step, the draft extend's too, unless its MTP layer runs its experts on every row of
    the extend's block (`extend_every_row`): then B (K + 1) rows' (expert_reads.py)."""

    def beyond_one_row(reader: Reader | None, batch: int, rows: int) -> float:
        if reader is None:
            return 0.0
        each = sum(_read_bytes(p) for p in reader.experts.parameters(recurse=False)) / reader.expert_count()
        return each * (experts_read(reader.chosen, batch, rows) - experts_read(reader.chosen, 1, 1))

    out = {}
    for k in depths:
        for b in batch_sizes:
            extra = sum(beyond_one_row(r, b, k + 1) for r in routing.target)
            if k:
                extra += beyond_one_row(routing.drafts[0], b, k + 1 if extend_every_row else 1)
                extra += sum(beyond_one_row(routing.drafts[j], b, 1) for j in range(1, k))
            out[f"{k}/{b}"] = round(extra)
    return out


def verify_experts(routing: Routing, depths: list[int], batch_sizes: list[int]) -> dict[str, float]:
    """By "K/B": the routed experts a K-step's verify at B reads per target MoE layer, on the mean."""
    if not routing.target:
        return {}
    return {
        f"{k}/{b}": statistics.mean(experts_read(r.chosen, b, k + 1) for r in routing.target)
        for k in depths
        for b in batch_sizes
    }


def weight_bytes(model: CausalLM) -> tuple[int, list[int]]:
    """(bytes one target forward reads, bytes one draft step reads per MTP layer), as the engine's
    kernels read them (after the runs, which made the ops' panels and the graphs' bfloat16 copies):
    a weight's bfloat16 copy's (weight_copies.py), else `library.read_bytes`."""
    return step_sizes(model, _read_bytes, model.model.embed_tokens.weight[0].nbytes)


def _read_bytes(weight: torch.Tensor) -> int:
    return weight_copies.copy_bytes(weight) or library.read_bytes(weight)


def _matrix_flops(weight: torch.Tensor) -> int:
    return 2 * weight.numel() if weight.dim() >= 2 else 0  # a vector (a norm's) only scales


def weight_flops(model: CausalLM) -> tuple[int, list[int], int]:
    """(float operations of one target forward's weights, of one draft step's per MTP layer (its head
    included), of MTP layer 0's parts that a draft extend runs on every row of its block), per row: a
    multiply and an add per matrix element. The embedding row is read, not multiplied."""
    k = model.cfg.num_experts_per_tok or 0
    extend_row = sum(_layer_size(m, k, _matrix_flops) for m in _extend_every_row(model))
    return *step_sizes(model, _matrix_flops, 0), extend_row


def extend_experts_every_row(model: CausalLM) -> bool:
    """Whether a draft extend runs MTP layer 0's routed experts on every row of its block."""
    return any(is_stacked_experts(m) for part in _extend_every_row(model) for m in part.modules())


def _extend_every_row(model: CausalLM) -> list[torch.nn.Module]:
    """MTP layer 0's modules that a draft extend runs on every row of its block (none without MTP)."""
    return model.mtp_every_row_modules(0) if model.num_mtp_layers else []


def copy_bandwidth(device: str, megabytes: int, runs: int = 5) -> float:
    """Bytes per second of the fastest of `runs` copies of a `megabytes` tensor, counting each byte read
    and written (as STREAM's Copy does): what streaming the weights can hope for at best."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def gemm_rate(device: str, dtype: torch.dtype, n: int = 1024, runs: int = 5) -> float:
    """Float operations per second of the fastest of `runs` [n, n] x [n, n] products: what the cores
    reach on arithmetic that reuses every weight n times."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / best_of(runs, device, partial(torch.mm, a, b))


def first_depth_bytes(target: int, mtp: list[int]) -> int:
    """The weight bytes a K=1 step reads: the target's and one draft step's (the warm read's size)."""
    return target + (mtp[0] if mtp else 0)


def resident_bandwidth(device: str, nbytes: int, runs: int = 5) -> float:
    """Bytes per second of the fastest of `runs` reads (a sum) of an `nbytes` tensor read just before:
    what a step that reads `nbytes` of weights at every step can hope for where they fit the cache and
    stay there between steps. Where they do not fit, memory's speed."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return data.nbytes / best_of(runs, device, data.sum)


def bandwidth_bound(
    target: int,
    mtp: list[int],
    bandwidth: float,
    copy_bytes: int,
    resident: float,
    depths: list[int],
    batch_sizes: list[int],
    routed: dict[str, int] | None = None,
) -> Bound:
    """Depth j drafts with MTP layer j % (number of layers), as the engine does; a K-step at B also reads
    `routed["K/B"]` bytes of routed experts beyond one row's (none where absent). The faster of the
    copy's `bandwidth` and the warm read's (`resident`) bounds every step."""
    routed = routed or {}
    fastest = max(bandwidth, resident)
    steps = {}
    for k in depths:
        read = target + sum(mtp[j % len(mtp)] for j in range(k))
        for b in batch_sizes:
            steps[f"{k}/{b}"] = fastest / (read + routed.get(f"{k}/{b}", 0))
    return Bound(
        copy_bytes, bandwidth, target, mtp, steps, resident_bytes_per_s=resident, routed_bytes=routed
    )


def tile_rate(device: str, dtype: torch.dtype, runs: int = 5) -> tuple[int, float]:
    """(rows from which the C++ ops multiply faster than torch.mm in float32, the float operations per
    second of the fastest of `runs` such products of 16 rows by weights of bfloat16 values, which stay
    in cache): with bfloat16_products on, 1 row and a dense MLP of [512, 1024] weights on the bfloat16
    dot products; else AMX's first row count (panel_amx) and a [512, 1024] weight on the tiles; (0, 0.0)
    where neither runs (no AMX, another device or dtype)."""
    if device != "cpu" or dtype != torch.float32 or not library.load():
        return 0, 0.0
    x, weight = torch.randn(16, 1024), torch.randn(512, 1024).bfloat16().float()
    if library.bfloat16_products():  # as they are: a bench times the engine as it runs
        down = torch.randn(1024, 512).bfloat16().float()
        mlp = partial(torch.ops.compiled_mtp.dense_mlp, x, weight, weight, down)
        return 1, 2 * x.shape[0] * 3 * weight.numel() / best_of(runs, device, mlp)
    rows = torch.ops.compiled_mtp.panel_amx()
    if not rows:
        return 0, 0.0
    product = partial(torch.ops.compiled_mtp.panel_linear, x, weight)
    return rows, 2 * x.shape[0] * weight.numel() / best_of(runs, device, product)


def add_roofline(
    bound: Bound,
    flops: tuple[int, list[int], int],
    rate: float,
    tiles: tuple[int, float],
) -> None:
    """The roofline's steps per second at every (K, B) of the bound: a step reads its bytes (`steps_per_s`) and does
    its weights' multiply-adds at `rate`, or at the tiles' rate for products of `tiles[0]` rows or more,
    so it takes at least the longer of the two. A K-step runs B (K + 1) rows through the target's verify
    and the parts of MTP layer 0 that the draft extend runs on every row (`flops[2]` a row), one row of
    each request through the rest of the extend's layer and its head, then B rows through each of its
    K - 1 draft steps."""
    target, mtp, extend_row = flops
    bound.flops_per_s, bound.target_flops, bound.mtp_step_flops = rate, target, mtp
    bound.extend_row_flops = extend_row
    bound.tile_rows, bound.tile_flops_per_s = tiles

    def seconds(rows: int, operations: int) -> float:
        return operations / (bound.tile_flops_per_s if bound.tile_rows and rows >= bound.tile_rows else rate)

    for key, steps in bound.steps_per_s.items():
        k, b = map(int, key.split("/"))
        rows = b * (k + 1)
        arithmetic = seconds(rows, rows * (target + (extend_row if k else 0)))
        if k:
            arithmetic += seconds(b, b * (mtp[0] - extend_row + sum(mtp[j % len(mtp)] for j in range(1, k))))
        bound.roofline_steps_per_s[key] = min(steps, 1 / arithmetic) if arithmetic else steps


def add_bounds(engine: list[EngineRun], bound: Bound) -> None:
    """Each row's bandwidth bound and roofline, and its speedup over K=0 at its B beside theirs. Auto's
    are the best fixed depth's at its B."""
    for e in engine:
        if isinstance(e.k, int):  # not "auto"
            e.bound_tokens_per_s = e.batch * e.acceptance_length * bound.steps_per_s[f"{e.k}/{e.batch}"]
            e.roofline_tokens_per_s = (
                e.batch * e.acceptance_length * bound.roofline_steps_per_s.get(f"{e.k}/{e.batch}", 0.0)
            )
    for e in engine:
        fixed = [r for r in engine if r.batch == e.batch and r.k != "auto"]
        if e.k == "auto":
            e.bound_tokens_per_s = max(r.bound_tokens_per_s for r in fixed)
            e.roofline_tokens_per_s = max(r.roofline_tokens_per_s for r in fixed)
        base = _engine_row(engine, 0, e.batch)
        if base is not None:
            e.speedup = e.decode_tokens_per_s / base.decode_tokens_per_s
            e.bound_speedup = e.bound_tokens_per_s / base.bound_tokens_per_s
            e.bound_fraction = e.speedup / e.bound_speedup
            if base.roofline_tokens_per_s:
                e.roofline_speedup = e.roofline_tokens_per_s / base.roofline_tokens_per_s


# ------------------------------------------------------------------------------------------ report


def _engine_row(runs: list[EngineRun], k: int | str, b: int) -> EngineRun | None:
    return next((r for r in runs if r.k == k and r.batch == b), None)


def paired_ratio(a: EngineRun, b: EngineRun) -> str:
    """a's decode tok/s over b's round by round: the two ran one after the other in each round, so a
    change in memory speed between rounds, which moves the best runs of each apart, cancels."""
    return round_ratios(a.decode_runs, b.decode_runs)  # --runs >= 1


def round_ratios(a: Sequence[float], b: Sequence[float], digits: int = 2) -> str:
    """Rates a over rates b taken in the same rounds, each round's ratio on its own: median and range."""
    ratios = sorted(x / y for x, y in zip(a, b))
    median, low, high = statistics.median(ratios), ratios[0], ratios[-1]
    return f"per round {median:.{digits}f}x, {low:.{digits}f}-{high:.{digits}f}x over {len(ratios)}"


def _speedup_goal(runs: list[EngineRun], b: int, goal: float) -> list[Goal]:
    """Best configuration (auto included) over K=0 at B, and the fraction of its bound's speedup that
    the fastest configuration that speculates reaches (where K=0 is the fastest, its own 100% would
    say nothing of speculation)."""
    name = f"best K vs K=0 at B={b}"
    base = _engine_row(runs, 0, b)
    rows = [r for r in runs if r.batch == b]
    drafting = [r for r in rows if r.k != 0]
    if base is None or not drafting:
        return [Goal(f"speedup_b{b}", name, None, goal, None, f"not measured (needs K=0, K > 0 and B={b})")]
    best = max(rows, key=lambda r: r.decode_tokens_per_s)
    spec = max(drafting, key=lambda r: r.decode_tokens_per_s)
    # What the machine allows at all: a goal above every depth's roofline is met, if at all, through
    # the K=0 step's fixed costs, which a deeper step spreads over more tokens.
    roof = max((r for r in rows if r.k != "auto"), key=lambda r: r.roofline_speedup)
    detail = (
        f"K={best.k}: {best.decode_tokens_per_s:.1f} vs {base.decode_tokens_per_s:.1f} decode tok/s"
        f" ({best.tokens_per_s / base.tokens_per_s:.2f}x with the prefill; {paired_ratio(best, base)});"
        f" the roofline allows at most {roof.roofline_speedup:.2f}x (K={roof.k})"
    )
    fraction = (
        f"K={spec.k}: {spec.speedup:.2f}x of a bound of {spec.bound_speedup:.2f}x"
        f" (the roofline, arithmetic counted too, {spec.roofline_speedup:.2f}x)"
    )
    return [
        Goal(f"speedup_b{b}", name, best.speedup, goal, best.speedup >= goal, detail),
        Goal(
            f"bound_fraction_b{b}",
            f"{name}, share of its bound",
            spec.bound_fraction,
            0.8,
            spec.bound_fraction >= 0.8,
            fraction,
        ),
    ]


def _auto_goals(runs: list[EngineRun]) -> list[Goal]:
    """Auto against the best fixed depth at every B (>= 0.97x), and against K=0 where no K > 0 beats
    it (>= 0.98x)."""
    out = []
    for auto in (r for r in runs if r.k == "auto"):
        fixed = [r for r in runs if r.batch == auto.batch and r.k != "auto"]
        best = max(fixed, key=lambda r: r.decode_tokens_per_s)
        goal = 0.98 if best.k == 0 else 0.97
        value = auto.decode_tokens_per_s / best.decode_tokens_per_s
        detail = (
            f"{auto.decode_tokens_per_s:.1f} vs K={best.k} {best.decode_tokens_per_s:.1f} decode tok/s"
            f" ({paired_ratio(auto, best)}); steps per depth {auto.depth_histogram}"
        )
        out.append(
            Goal(
                f"auto_b{auto.batch}",
                f"auto vs best fixed K at B={auto.batch}",
                value,
                goal,
                value >= goal,
                detail,
            )
        )
    return out


def _peer_goals(result: BenchResult) -> list[Goal]:
    """K=0 (>= 1.0x) and the best configuration (>= 1.5x) against llama.cpp's plain decoding at B = 1,
    then, for context, the best configuration against llama.cpp's fastest where its MTP drafting won."""
    peer = next((p for p in result.peers if p.system == "llama.cpp"), None)
    base = _engine_row(result.engine, 0, 1)
    best = max((r for r in result.engine if r.batch == 1), key=lambda r: r.tokens_per_s, default=None)
    out = []
    for gid, name, row, goal in (
        ("vs_llama_cpp_k0", "K=0 vs llama.cpp at B=1", base, 1.0),
        ("vs_llama_cpp_best", "best K vs llama.cpp at B=1", best, 1.5),
    ):
        if peer is None or row is None:
            out.append(
                Goal(gid, name, None, goal, None, "not measured (needs B=1, K=0 and llama-cpp-python)")
            )
            continue
        value = row.tokens_per_s / peer.tokens_per_s
        out.append(
            Goal(
                gid,
                name,
                value,
                goal,
                value >= goal,
                f"K={row.k}: {row.tokens_per_s:.1f} vs {peer.tokens_per_s:.1f} tok/s",
            )
        )
    fastest = max(result.peers, key=lambda p: p.tokens_per_s, default=None)
    if fastest is not None and best is not None and fastest.system != "llama.cpp":
        value = best.tokens_per_s / fastest.tokens_per_s
        detail = f"K={best.k}: {best.tokens_per_s:.1f} vs {fastest.system} {fastest.tokens_per_s:.1f} tok/s"
        out.append(
            Goal("vs_llama_cpp_fastest", "best K vs llama.cpp's fastest at B=1", value, None, None, detail)
        )
    return out


def goals(result: BenchResult) -> list[Goal]:
    """The ratios the issue's goals are about, then best K against HF generate at each B for context."""
    out = (
        _speedup_goal(result.engine, 1, 1.8)
        + _speedup_goal(result.engine, 4, 1.3)
        + _auto_goals(result.engine)
    )
    hf_mtp = next((h for h in result.hf if h.k > 0), None)
    best1 = max((r for r in result.engine if r.batch == 1), key=lambda r: r.tokens_per_s, default=None)
    name = "best K at B=1 vs HF generate(use_mtp=True)"
    if hf_mtp and best1:
        value = best1.tokens_per_s / hf_mtp.tokens_per_s
        out.append(
            Goal(
                "vs_hf_mtp_b1",
                name,
                value,
                5.0,
                value >= 5.0,
                f"K={best1.k}: {best1.tokens_per_s:.1f} vs {hf_mtp.tokens_per_s:.1f} tok/s",
            )
        )
    else:
        out.append(Goal("vs_hf_mtp_b1", name, None, 5.0, None, "not measured (needs B=1 and a depth > 0)"))
    out += _peer_goals(result)
    k1 = next((a for a in result.acceptance if a.k == 1), None)
    if k1:
        out.append(
            Goal(
                "k1_acceptance",
                "K=1 acceptance",
                k1.acceptance_rate,
                0.7,
                k1.acceptance_rate >= 0.7,
                f"{k1.accepted_tokens} of {k1.draft_tokens} drafts",
            )
        )
    else:
        out.append(Goal("k1_acceptance", "K=1 acceptance", None, 0.7, None, "not measured (needs K=1)"))
    for h in result.hf:
        best = max(
            (r for r in result.engine if r.batch == h.batch), key=lambda r: r.tokens_per_s, default=None
        )
        if h.k == 0 and best:
            value = best.tokens_per_s / h.tokens_per_s
            out.append(
                Goal(
                    f"vs_hf_generate_b{h.batch}",
                    f"best K vs HF generate at B={h.batch}",
                    value,
                    None,
                    None,
                    f"K={best.k}: {best.tokens_per_s:.1f} vs {h.tokens_per_s:.1f} tok/s",
                )
            )
    return out


def precision(m: Meta) -> str:
    """The run's dtype, and the dense MLPs' products where they were bfloat16, for people."""
    return f"{m.dtype} (dense MLPs multiply in bfloat16)" if m.bfloat16_mlps else m.dtype


def print_report(r: BenchResult) -> None:
    """The tables and the goals, for people."""
    _print_header(r.meta)
    _print_acceptance(r.meta, r.acceptance)
    _print_systems(r)
    _print_bound(r.meta, r.bound)
    print(f"compiles {r.meta.compiles}, recompiles {r.meta.recompiles}")
    _print_goals(r.goals)


def _print_header(m: Meta) -> None:
    print(f"\ncompiled_mtp bench: {m.model}")
    drafts = f"; drafts among the {m.draft_vocab} most frequent tokens" if m.draft_vocab else ""
    print(
        f"device: {m.device} ({m.device_name}); {precision(m)}; backend {m.backend}"
        f"; {m.new_tokens} new tokens, greedy; best of {m.runs}{drafts}"
    )
    print(f"prompts: {m.prompts}")


def _print_acceptance(m: Meta, acceptance: list[Acceptance]) -> None:
    print(f"\nacceptance on {m.accept_prompts} prompts")
    print(f"{'K':>3}{'acc len':>9}{'rate':>7}  per position")
    for a in acceptance:
        print(
            f"{a.k:>3}{a.acceptance_length:>9.2f}{a.acceptance_rate:>7.2f}  "
            + " ".join(f"{p:.2f}" for p in a.per_position)
        )


def _print_systems(r: BenchResult) -> None:
    """The engine's rows, then HF's and the peers'."""
    print(
        f"\n{'system':<30}{'B':>3}{'tok/s':>10}{'decode':>9}{'bound':>8}{'ms/iter':>9}{'host ms':>9}{'host %':>8}"
        f"{'acc len':>9}"
        f"{'vs K=0':>8}{'bound':>7}{'of it':>7}{'roof':>7}"
    )
    for e in r.engine:
        print(
            f"{'compiled_mtp K=' + str(e.k):<30}{e.batch:>3}{e.tokens_per_s:>10.1f}{e.decode_tokens_per_s:>9.1f}"
            f"{e.bound_tokens_per_s:>8.0f}{e.iteration_ms:>9.2f}"
            f"{e.host_ms:>9.3f}{100 * e.host_share:>8.1f}{e.acceptance_length:>9.2f}"
            f"{e.speedup:>7.2f}x{e.bound_speedup:>6.2f}x{100 * e.bound_fraction:>6.0f}%{e.roofline_speedup:>6.2f}x"
        )
    for h in r.hf:
        acc = f"{'':>36}{h.acceptance_length:>9.2f}" if h.acceptance_length is not None else ""
        print(f"{'HF ' + h.system:<30}{h.batch:>3}{h.tokens_per_s:>10.1f}{acc}")
    for p in r.peers:
        same = (
            "greedy tokens equal the engine's"
            if p.same_tokens
            else f"greedy tokens DIFFER from the engine's at token {p.first_difference}"
        )
        drafts = f"; accepted {p.accepted} of {p.drafted} drafts" if p.drafted is not None else ""
        print(f"{p.system:<30}{p.batch:>3}{p.tokens_per_s:>10.1f}  {same}{drafts}")


def _print_bound(m: Meta, bound: Bound) -> None:
    """The bandwidth bound's inputs, the experts a verify reads, and the roofline's."""
    per_draft_step = ", ".join(f"{x / 1e6:.2f}" for x in bound.mtp_step_bytes) or "-"
    read = first_depth_bytes(bound.target_bytes, bound.mtp_step_bytes)
    used = (
        "the read's: a step's weights stay in the cache"
        if bound.resident_bytes_per_s > bound.bandwidth_bytes_per_s
        else "the copy's"
    )
    print(
        f"\nbound: copy bandwidth {bound.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({bound.copy_bytes >> 20} MB), "
        f"a step's {read / 1e6:.2f} MB read warm {bound.resident_bytes_per_s / 1e9:.1f} GB/s; the bound takes "
        f"{used}; weights read per target forward "
        f"{bound.target_bytes / 1e6:.2f} MB, per draft step {per_draft_step} MB (a row's); "
        + ", ".join(f"K/B={kb}: {s:.0f} steps/s" for kb, s in bound.steps_per_s.items())
    )
    if bound.verify_experts:
        print(
            f"routed experts a verify reads per MoE layer, of {bound.expert_count} (measured on the prompts), "
            "and the MB of routed experts a step reads beyond one row's: "
            + ", ".join(
                f"K/B={kb}: {n:.2f}, {bound.routed_bytes[kb] / 1e6:.2f} MB"
                for kb, n in bound.verify_experts.items()
            )
        )
    if bound.flops_per_s:
        per_draft_row = ", ".join(f"{x / 1e6:.2f}" for x in bound.mtp_step_flops) or "-"
        unit = "the bfloat16 dot products, every product counted" if m.bfloat16_mlps else "AMX's tiles"
        tiles = (
            f" (products of {bound.tile_rows}+ rows on {unit}: {bound.tile_flops_per_s / 1e9:.0f} GFLOP/s)"
            if bound.tile_rows
            else ""
        )
        print(
            f"roofline: torch.mm {bound.flops_per_s / 1e9:.0f} GFLOP/s{tiles}; weights' multiply-adds per row "
            f"{bound.target_flops / 1e6:.2f} MFLOP per target forward, {per_draft_row} per draft step "
            f"({bound.extend_row_flops / 1e6:.2f} of them on every row of a draft extend); "
            + ", ".join(f"K/B={kb}: {s:.0f} steps/s" for kb, s in bound.roofline_steps_per_s.items())
        )


def _print_goals(goals: list[Goal]) -> None:
    print("\ngoals:")
    for g in goals:
        percent = g.id == "k1_acceptance" or g.id.startswith("bound_fraction")
        value = "n/a" if g.value is None else f"{100 * g.value:.0f}%" if percent else f"{g.value:.2f}x"
        target = (
            "" if g.goal is None else f"goal >= {100 * g.goal:.0f}%" if percent else f"goal >= {g.goal:g}x"
        )
        verdict = "" if g.met is None else "met" if g.met else "NOT met"
        print(f"  {g.name:<48}{value:>8}  {target:<15}{verdict:<8}{g.detail}")


def plot(r: BenchResult, path: Path) -> None:
    """tokens/s against K, one colour per batch size: the engine (solid), its bandwidth bound (dotted),
    its roofline where lower (dotted, crosses), HF generate (dashed, flat in K) and HF
    generate(use_mtp=True) (a star at its draft count)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, b in enumerate(r.meta.batch_sizes):
        rows = [e for e in r.engine if e.batch == b and e.k != "auto"]
        ks = [e.k for e in rows]
        color = f"C{i}"
        ax.plot(ks, [e.tokens_per_s for e in rows], "o-", color=color, label=f"compiled_mtp B={b}")
        ax.plot(ks, [e.bound_tokens_per_s for e in rows], ":", color=color, label=f"bandwidth bound B={b}")
        if any(e.roofline_tokens_per_s < e.bound_tokens_per_s for e in rows):  # else the same line
            ax.plot(ks, [e.roofline_tokens_per_s for e in rows], "x:", color=color, label=f"roofline B={b}")
        auto = _engine_row(r.engine, "auto", b)
        if auto is not None:
            ax.axhline(auto.tokens_per_s, ls="-.", color=color, label=f"compiled_mtp auto B={b}")
        for h in r.hf:
            if h.batch == b and h.k == 0:
                ax.axhline(h.tokens_per_s, ls="--", color=color, label=f"HF generate B={b}")
            elif h.batch == b:
                ax.plot(
                    [h.k],
                    [h.tokens_per_s],
                    "*",
                    color=color,
                    markersize=12,
                    label=f"HF generate(use_mtp=True) B={b}",
                )
    ax.set_yscale("log")
    ax.set_xticks(r.meta.depths)
    ax.set_xlabel("MTP depth K (draft tokens per step)")
    ax.set_ylabel("tokens/s (greedy)")
    ax.set_title(
        f"{Path(r.meta.model).name}: {r.meta.device_name}, {precision(r.meta)}, {r.meta.new_tokens} new tokens",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ command


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    return f"CPU {cpu}, {torch.get_num_threads()} threads"


def _check(args: argparse.Namespace) -> None:
    """One-line errors for options that would fail only after minutes of measuring."""
    if not args.depths or min(args.depths) < 0:
        raise ValueError(f"depths: must be integers >= 0, got {args.depths}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"batch-sizes: must be integers >= 1, got {args.batch_sizes}")
    if args.runs < 1:
        raise ValueError(f"runs: must be >= 1, got {args.runs}")
    if args.new_tokens < max(args.depths) + 3:
        # K + 3 tokens make every request decode at least two steps, whatever it accepts: the first step
        # also prefills, so the per-iteration figures need a second.
        raise ValueError(
            f"new-tokens: must be >= max depth + 3 = {max(args.depths) + 3}, got {args.new_tokens}"
        )
    if min(args.prompt_len, args.accept_prompts, args.timed_prompts, args.copy_mb) < 1:
        raise ValueError("prompt-len, accept-prompts, timed-prompts and copy-mb: must be >= 1")
    if args.prompt_len < max(args.depths) + 2:
        # Where a draft extend routes every row of its block (DeepSeek-V4), the bound measures its routing
        # on windows of K + 1 positions of each prompt's MTP rows, which start at its second token.
        raise ValueError(
            f"prompt-len: must be >= max depth + 2 = {max(args.depths) + 2}, got {args.prompt_len}"
        )
    if not (args.model / "config.json").exists():
        raise ValueError(f"model: {args.model} has no config.json")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise ValueError(f"draft-vocab: must be >= 1, got {args.draft_vocab}")
    check_device(args.device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `compiled-mtp bench`."""
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="checkpoint directory (default: the shipped default model)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=user_cache(), help="capture cache directory (default: %(default)s)"
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="build every graph in this process, store none (default: use the cache)",
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=BACKENDS,
        help="eager runs the step functions uncompiled (default: inductor)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=tuple(DTYPES), help="engine and HF dtype (default: float32)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--new-tokens", type=int, default=128, help="tokens generated per request (default: 128)"
    )
    parser.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3, 4],
        help='MTP depths K; a row at mtp_depth="auto" over them is added (default: 0 1 2 3 4)',
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="batch sizes B (default: 1 4 16)"
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="draft among the model's N most frequent tokens (default: every token)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed runs per row after a warm-up; the best counts (default: 3)"
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument(
        "--accept-prompts", type=int, default=24, help="prompts for the acceptance measurement (default: 24)"
    )
    parser.add_argument(
        "--timed-prompts",
        type=int,
        default=8,
        help="prompts every system generates per timed run, B at a time (default: 8, rounded up to a multiple of B)",
    )
    parser.add_argument(
        "--copy-mb",
        type=int,
        default=256,
        help="tensor size for the copy-bandwidth measurement (default: 256)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks"),
        help="directory for bench-<device>.json and .png (default: benchmarks)",
    )
    parser.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="skip the llama.cpp rows (default: run them on CPU when llama-cpp-python is installed)",
    )
    add_pass_switch(parser)
    library.add_bfloat16_option(parser)


def _llama_cpp(args: argparse.Namespace, model_type: str, folder: Path) -> Peers:
    """llama.cpp on a GGUF export of the model into `folder`, when it is installed and the device is
    the CPU: its plain decoding, and its MTP speculative decoding at each depth above 0 the bench
    runs where its llama.cpp has the MTP graph."""
    skipped = (
        "--no-llama-cpp"
        if args.no_llama_cpp
        else "CPU only"
        if torch.device(args.device).type != "cpu"
        else None
    )
    if skipped is None and model_type not in LAYOUTS:
        skipped = f"llama.cpp's GGUF has no architecture for {model_type} in this gguf package"
    if skipped is None and not llama_cpp_peer.available():
        skipped = llama_cpp_peer.MISSING
    if skipped:
        print(f"  no llama.cpp row: {skipped}", flush=True)
        return {}
    context, threads = args.prompt_len + args.new_tokens, torch.get_num_threads()
    path = export_gguf(args.model, folder / "model.gguf", GGUF_DTYPES[args.dtype])
    peers: Peers = {"llama.cpp": LlamaCpp(path, context=context, threads=threads)}
    depths = [k for k in args.depths if k > 0]
    if not depths:
        return peers
    if not llama_cpp_peer.mtp_available():
        print(f"  no llama.cpp MTP rows: {llama_cpp_peer.NO_MTP}", flush=True)
        return peers
    path = export_gguf(args.model, folder / "mtp.gguf", GGUF_DTYPES[args.dtype], with_mtp=True)
    try:
        for k in depths:
            peers[f"llama.cpp MTP K={k}"] = LlamaCppMTP(path, context, threads, k)
    except ValueError as e:  # a llama.cpp that loads no NextN block, or makes no MTP context
        print(f"  no llama.cpp MTP rows: {e}", flush=True)
        return {"llama.cpp": peers["llama.cpp"]}
    return peers


def run(args: argparse.Namespace) -> None:
    """Run the whole benchmark, print the report and write the JSON and the plot."""
    _check(args)
    try:
        hf_version = hf_baseline.transformers_version()
        import matplotlib  # noqa: F401  (checked now, not after the measurements)
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: {MATPLOTLIB_MISSING if e.name == 'matplotlib' else e}") from None
    args.depths, args.batch_sizes = sorted(set(args.depths)), sorted(set(args.batch_sizes))
    model = load_model(
        args.model, dtype=DTYPES[args.dtype], device=args.device, with_mtp=max(args.depths) > 0
    )
    if args.draft_vocab is not None:
        model.restrict_drafts(
            torch.tensor(read_ranking(args.model, model.cfg.vocab_size)[: args.draft_vocab])
        )
    timed = max(timed_prompts(args.timed_prompts, b) for b in args.batch_sizes)
    prompts = bench_prompts(
        args.model, model.cfg.vocab_size, max(args.accept_prompts, timed), args.prompt_len
    )
    meta = _meta(args, prompts, hf_version)
    print(f"benchmarking {args.model} on {meta.device_name}; prompts: {prompts.detail}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        systems = _llama_cpp(args, model.model_type, Path(folder))
        acceptance, engine, peers, meta.compiles, meta.recompiles = bench_engine(
            model, prompts, args, systems
        )
        del systems
    reads = _model_reads(model, prompts, args)
    del model  # HF loads its own copy next
    hf, meta.hf_attention = bench_hf(args.model, prompts.token_ids, args)
    bound = _bound(reads, args)
    add_bounds(engine, bound)
    result = BenchResult(meta, acceptance, engine, hf, bound, peers, [])
    result.goals = goals(result)
    print_report(result)
    _write(result, args)


def _meta(args: argparse.Namespace, prompts: Prompts, hf_version: str) -> Meta:
    return Meta(
        model=str(args.model),
        device=args.device,
        device_name=device_name(args.device),
        dtype=args.dtype,
        backend=args.backend,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=hf_version,
        python=platform.python_version(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        runs=args.runs,
        depths=args.depths,
        batch_sizes=args.batch_sizes,
        prompt_source=prompts.source,
        prompts=prompts.detail,
        accept_prompts=args.accept_prompts,
        draft_vocab=args.draft_vocab,
        bfloat16_mlps=args.device == "cpu" and args.dtype == "float32" and library.bfloat16_products(),
    )


@dataclass
class _Reads:
    """What the bound needs from the model, taken before it is freed: weight bytes and multiply-adds,
    and the routed experts' bytes and counts on the prompts."""

    target_bytes: int
    mtp_bytes: list[int]
    flops: tuple[int, list[int], int]
    routing: Routing
    routed: dict[str, int]


def _model_reads(model: CausalLM, prompts: Prompts, args: argparse.Namespace) -> _Reads:
    target_bytes, mtp_bytes = weight_bytes(model)
    routing = record(model, prompts.token_ids, max(args.depths))
    routed = routed_bytes(routing, args.depths, args.batch_sizes, extend_experts_every_row(model))
    return _Reads(target_bytes, mtp_bytes, weight_flops(model), routing, routed)


def _bound(reads: _Reads, args: argparse.Namespace) -> Bound:
    """The bandwidth bound and the roofline, from this machine's measured rates."""
    bandwidth = copy_bandwidth(args.device, args.copy_mb)
    resident = resident_bandwidth(args.device, first_depth_bytes(reads.target_bytes, reads.mtp_bytes))
    bound = bandwidth_bound(
        reads.target_bytes,
        reads.mtp_bytes,
        bandwidth,
        args.copy_mb * 2**20,
        resident,
        args.depths,
        args.batch_sizes,
        reads.routed,
    )
    bound.expert_count = reads.routing.target[0].expert_count() if reads.routing.target else 0
    bound.verify_experts = verify_experts(reads.routing, args.depths, args.batch_sizes)
    dtype = DTYPES[args.dtype]
    add_roofline(bound, reads.flops, gemm_rate(args.device, dtype), tile_rate(args.device, dtype))
    return bound


def _write(result: BenchResult, args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench-{torch.device(args.device).type}"
    stem.with_suffix(".json").write_text(json.dumps(asdict(result), indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
