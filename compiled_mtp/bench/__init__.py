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

Results go to OUT/bench-<device type>.json (results.py's dataclasses, as dicts; `bound.steps_per_s`,
`bound.roofline_steps_per_s`, `bound.routed_bytes` and `bound.verify_experts` are keyed by "K/B")
and a plot to OUT/bench-<device type>.png.
"""

from __future__ import annotations

from .bound import (
    add_roofline,
    bandwidth_bound,
    extend_experts_every_row,
    gemm_rate,
    resident_bandwidth,
    routed_bytes,
    step_sizes,
    tile_rate,
    weight_bytes,
    weight_flops,
)
from .command import add_arguments, run
from .engine import (
    Timing,
    bench_engine,
    peer_run,
    summed,
    timed_batches,
    timed_generate,
    timed_prompts,
    turns,
)
from .goals import paired_ratio, round_ratios
from .prompts import Prompts, bench_prompts
from .results import EngineRun
from .timing import best_of

# What benchmarks/ and tests/ use; the rest is imported from its module.
__all__ = [
    "EngineRun",
    "Prompts",
    "Timing",
    "add_arguments",
    "add_roofline",
    "bandwidth_bound",
    "bench_engine",
    "bench_prompts",
    "best_of",
    "extend_experts_every_row",
    "gemm_rate",
    "paired_ratio",
    "peer_run",
    "resident_bandwidth",
    "round_ratios",
    "routed_bytes",
    "run",
    "step_sizes",
    "summed",
    "tile_rate",
    "timed_batches",
    "timed_generate",
    "timed_prompts",
    "turns",
    "weight_bytes",
    "weight_flops",
]
