"""compiled_mtp against HF transformers on one checkpoint, in one process.

Prints tokens/s and host time per iteration (the runtime's Python outside graph calls) for
K = 0..3 at B = 1 and 8, beside HF `generate` and `generate(use_mtp=True)` (which runs B = 1 only),
and the ratios. Greedy decoding; every system generates the same tokens.

    python benchmarks/bench_engine.py                 # synthetic checkpoint, Inductor graphs
    python benchmarks/bench_engine.py --model DIR     # any DeepSeek-V3 checkpoint with MTP

Without --model it writes a synthetic "deep echo" checkpoint (tests/factory.py): 8 target layers,
of which layers 1..7 have zero output projections (full cost, no effect), and an MTP layer that is a
noisy copy of layer 0. Its acceptance is constructed, not learned: it stands in for a trained model
so the cost structure (MTP = 1/8 of the target) and acceptance (~0.6-0.9 per position) are realistic.
Needs the test extra (transformers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.models.checkpoint import load_model
from tests.factory import hf_mtp_generate, load_hf, write_echo_checkpoint

SYNTHETIC = dict(
    num_layers=8, vocab_size=2048, hidden=256, mtp_noise=0.4, seed=1, num_attention_heads=4, q_lora_rank=128,
    kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=256,
    intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
)


def _prompts(vocab: int, batch: int, length: int = 16) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(2, vocab, (batch, length), generator=gen).tolist()


def _best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_engine(path: Path, depths, batches, new_tokens: int, backend: str, runs: int) -> dict:
    model = load_model(path)
    rt = Runtime(model, mtp_depth=0, mtp_depths=depths, batch_sizes=batches, max_seq_len=new_tokens + 64, compile_backend=backend)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows = {}
    for k in depths:
        rt.mtp_depth = k
        for b in batches:
            prompts = _prompts(model.cfg.vocab_size, b)
            start = time.perf_counter()
            rt.generate(prompts, params)  # compiles this key's graphs
            ready = time.perf_counter() - start
            before = rt.stats()
            seconds = _best_of(runs, lambda: rt.generate(prompts, params))
            after = rt.stats()
            steps = after["decode_steps"] - before["decode_steps"]
            host = after["host_seconds"] - before["host_seconds"]
            per_step = seconds * runs / steps  # wall per iteration, averaged over the timed runs
            rows[(k, b)] = {
                "tok_s": b * new_tokens / seconds,
                "ms_per_iter": 1e3 * per_step,
                "host_ms": 1e3 * host / steps,
                "host_pct": 100 * host / steps / per_step,
                "accept_len": (new_tokens - 1) * runs / steps,  # decode tokens per request and step
                "first_run_s": ready,
            }
    assert rt.stats()["recompiles"] == 0
    return rows


def bench_hf(path: Path, batches, new_tokens: int, runs: int) -> dict:
    model = load_hf(path)
    vocab = model.config.vocab_size
    rows = {}
    for b in batches:
        ids = torch.tensor(_prompts(vocab, b))
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **kwargs)
            rows[("generate", b)] = b * new_tokens / _best_of(runs, lambda: model.generate(ids, **kwargs))
    prompt = _prompts(vocab, 1)[0]
    hf_mtp_generate(model, prompt, new_tokens)
    rows[("generate(use_mtp=True)", 1)] = new_tokens / _best_of(runs, lambda: hf_mtp_generate(model, prompt, new_tokens))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: synthetic deep echo)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--runs", type=int, default=3, help="timed runs per row (best is kept)")
    args = parser.parse_args()
    depths, batches = (0, 1, 2, 3), (1, 8)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_echo_checkpoint(tmp, **SYNTHETIC)
        engine = bench_engine(path, depths, batches, args.new_tokens, args.backend, args.runs)
        hf = bench_hf(path, batches, args.new_tokens, args.runs)

    print(f"checkpoint: {args.model or 'synthetic deep echo (constructed acceptance)'}; {args.new_tokens} new tokens, greedy, "
          f"backend {args.backend}, {torch.get_num_threads()} threads, best of {args.runs}")
    print(f"{'system':<34}{'B':>3}{'tok/s':>10}{'ms/iter':>9}{'host ms':>9}{'host %':>8}{'acc len':>9}")
    for (k, b), r in engine.items():
        print(f"{'compiled_mtp K=' + str(k):<34}{b:>3}{r['tok_s']:>10.1f}{r['ms_per_iter']:>9.2f}{r['host_ms']:>9.3f}{r['host_pct']:>8.1f}{r['accept_len']:>9.2f}")
    for (name, b), tok_s in hf.items():
        print(f"{'HF ' + name:<34}{b:>3}{tok_s:>10.1f}")
    best1 = max(engine[(k, 1)]["tok_s"] for k in depths)
    best8 = max(engine[(k, 8)]["tok_s"] for k in depths)
    print("ratios:")
    print(f"  best K vs K=0, B=1: {best1 / engine[(0, 1)]['tok_s']:.2f}x   B=8: {best8 / engine[(0, 8)]['tok_s']:.2f}x")
    print(f"  best K vs HF generate(use_mtp=True), B=1: {best1 / hf[('generate(use_mtp=True)', 1)]:.1f}x")
    print(f"  K=0 vs HF generate, B=1: {engine[(0, 1)]['tok_s'] / hf[('generate', 1)]:.1f}x   B=8: {engine[(0, 8)]['tok_s'] / hf[('generate', 8)]:.1f}x")
    print(f"  first run of each key (compile) {statistics.mean(r['first_run_s'] for r in engine.values()):.1f} s on average")


if __name__ == "__main__":
    main()
