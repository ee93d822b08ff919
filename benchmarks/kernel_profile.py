"""Microseconds a decode step spends in each kernel and op of the packaged graphs, at one depth and batch.

The graphs are built as AOTInductor packages with Inductor's per-kernel profiling compiled in (each
generated C++ kernel records itself to the PyTorch profiler), into a capture cache of their own
(`--cache-dir`, by default a folder under the system's temporary one: the profiling changes the
code, not the cache key), without the Python stacks of their nodes: with the profiling, Inductor
wraps every kernel call in a guard that copies and parses those stacks, tens of microseconds a call
for a large fused kernel, which would stand between the events. The runtime generates twice to
warm up, then the decode steps of `--batch` prompts, generated together, run under the profiler.
Printed: each event's own time per decode step and its calls per step, the largest first. The
profiler's own cost per event (about a microsecond) is in every figure, so the figures compare
kernels and depths with each other, not with graph_times.py's wall times.

    python benchmarks/kernel_profile.py [--depth 3] [--batch 1] [--steps 200] [--top 40] [--cache-dir DIR]
                                        [--bfloat16-mlps]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FLAG = "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=3, help="the runtime's mtp_depth (default: 3)")
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together (default: 1)")
    parser.add_argument(
        "--steps", type=int, default=200, help="new tokens of the profiled prompt (default: 200)"
    )
    parser.add_argument("--top", type=int, default=40, help="events printed (default: 40)")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "compiled_mtp_kernel_profile"
    )
    from compiled_mtp.ops import library

    library.add_bfloat16_option(parser)
    args = parser.parse_args()
    if (
        os.environ.get(FLAG) != "1"
    ):  # Inductor reads the flag when it is imported, so set it for a fresh process
        sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, FLAG: "1"}))
    library.apply_bfloat16_option(args)
    profile(args.depth, args.batch, args.steps, args.top, args.cache_dir)


def profile(depth: int, batch: int, steps: int, top: int, cache_dir: Path) -> None:
    from torch._inductor import ir
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler
    from torch.utils._ordered_set import OrderedSet

    from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
    from compiled_mtp.bench import bench_prompts

    ir.IRNode.get_stack_traces = lambda self: OrderedSet()  # type: ignore[method-assign]

    prompts = bench_prompts(Path(DEFAULT_MODEL), 0, batch, 64).token_ids[:batch]
    rt = Runtime.from_pretrained(
        mtp_depth=depth,
        batch_sizes=(batch,),
        mtp_depths=[depth],
        max_seq_len=max(map(len, prompts)) + steps + 8,
        cache_dir=cache_dir,
        draft_vocab=1024,
    )
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    for _ in range(2):
        rt.generate(prompts, params)
    for prompt in prompts:
        rt.add_request(prompt, params)
    rt.step()  # the prefills, outside the profile
    rt.reset_stats()
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        while rt.has_unfinished():
            rt.step()
    decoded = rt.stats()["decode_steps"]
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / decoded
    print(
        f"depth {depth}, B={batch}: {decoded} decode steps profiled, {total:.1f} us a step of events' own time"
    )
    for e in events[:top]:
        print(f"  {e.self_cpu_time_total / decoded:8.1f} us  {e.count / decoded:5.1f} calls  {e.key[:110]}")


if __name__ == "__main__":
    main()
