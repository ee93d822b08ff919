"""Where a plain decode step's time goes, in the engine and in llama.cpp, on the same model.

The engine's K=0 step (the target_verify graph at K=0, compiled in this process with Inductor's
per-kernel profiling on) runs under the PyTorch profiler; its kernels are summed by what they do.
llama.cpp (llama-cpp-python, the bench extra) decodes the same prompt from the GGUF export; its own
counters give the prompt's and each token's evaluation time. Both run on torch's thread count.

    python benchmarks/step_breakdown.py [--model DIR] [--steps 64] [--prompt-len 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams, llama_cpp_peer
from compiled_mtp.bench import bench_prompts
from compiled_mtp.llama_cpp_peer import LlamaCpp
from compiled_mtp.models.gguf_export import export_gguf

# Profiler event name -> what the time was spent on; the first pattern that matches counts.
KINDS = [
    ("linear (oneDNN, packed weights)", r"mkldnn::_linear_pointwise|compiled_mtp::linear"),
    ("linear (panels, C++)", r"compiled_mtp::panel_linear"),
    ("linear (aten mm / addmm / bmm)", r"^aten::(mm|addmm|bmm)$"),
    ("attention (live_attention)", r"compiled_mtp::live_attention"),
    ("routed experts", r"compiled_mtp::routed_experts"),
    ("sampling", r"compiled_mtp::(greedy|verify|draft)_sample"),
    ("Inductor-generated C++ (norms, rope, one-row linears, elementwise)", r"^graph_\d+_cpp_fused"),
]
OUTER = re.compile(
    r"^(## Call CompiledFxGraph|Torch-Compiled Region|TorchDynamo|AOTDispatcher|Pregraph|ProfilerStep)"
)


def engine_breakdown(model_dir: Path, prompt: list[int], steps: int) -> dict:
    """Per-kind milliseconds of one K=0 decode step, from `steps` profiled steps."""
    inductor_config.cpp.enable_kernel_profile = True
    rt = Runtime.from_pretrained(
        model_dir, mtp_depth=0, batch_sizes=(1,), max_seq_len=len(prompt) + steps + 1, cache_dir=None
    )
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    rt.generate([prompt], params)  # compiles
    rt.add_request(prompt, params)
    rt.step()  # the prefill and the first decode step, outside the profile
    rt.reset_stats()
    start, graph_before = time.perf_counter(), rt.graphs.seconds
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while rt.has_unfinished():
            rt.step()
    wall = time.perf_counter() - start
    decoded = rt.stats()["decode_steps"]
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if OUTER.search(event.key):
            continue
        kind = next((name for name, pattern in KINDS if re.search(pattern, event.key)), "other aten ops")
        kinds[kind] += event.self_cpu_time_total / 1e3 / decoded
    return {
        "steps": decoded,
        "profiled_ms_per_step": 1e3 * wall / decoded,
        "graph_ms_per_step": 1e3 * (rt.graphs.seconds - graph_before) / decoded,
        "kinds_ms": dict(kinds),
    }


def llama_cpp_timings(model_dir: Path, prompt: list[int], steps: int, runs: int = 3) -> dict:
    """llama.cpp's own counters over `runs` generations (the fastest kept): prompt and per-token eval."""
    import llama_cpp

    best = None
    with tempfile.TemporaryDirectory() as folder:
        peer = LlamaCpp(
            export_gguf(model_dir, Path(folder) / "model.gguf"),
            context=len(prompt) + steps + 1,
            threads=torch.get_num_threads(),
        )
        for _ in range(runs + 1):  # the first warms up
            llama_cpp.llama_perf_context_reset(peer.llm.ctx)
            start = time.perf_counter()
            peer.generate(prompt, steps)
            wall = time.perf_counter() - start
            data = llama_cpp.llama_perf_context(peer.llm.ctx)
            run = {
                "prompt_ms": data.t_p_eval_ms,
                "eval_ms_per_token": data.t_eval_ms / max(data.n_eval, 1),
                "wall_ms_per_token": 1e3 * wall / steps,
            }
            best = run if best is None or run["eval_ms_per_token"] < best["eval_ms_per_token"] else best
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    prompt = bench_prompts(args.model, 0, 1, args.prompt_len).token_ids[0]
    result = {"threads": torch.get_num_threads(), "engine": engine_breakdown(args.model, prompt, args.steps)}
    if llama_cpp_peer.available():
        result["llama_cpp"] = llama_cpp_timings(args.model, prompt, args.steps)
    engine = result["engine"]
    print(
        f"engine K=0 step, {engine['steps']} steps profiled: {engine['graph_ms_per_step']:.3f} ms in the graph, "
        f"{engine['profiled_ms_per_step']:.3f} ms a step under the profiler"
    )
    for kind, ms in sorted(engine["kinds_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms:7.3f} ms  {kind}")
    if "llama_cpp" in result:
        ll = result["llama_cpp"]
        print(
            f"llama.cpp: {ll['eval_ms_per_token']:.3f} ms a token in its eval counter, "
            f"{ll['wall_ms_per_token']:.3f} ms a token of wall time (prompt {ll['prompt_ms']:.1f} ms)"
        )
    else:
        print(f"llama.cpp: not run ({llama_cpp_peer.MISSING})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
