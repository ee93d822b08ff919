"""Decode steps at two depths, round by round, beside the cores' rate on a small product.

Why a bench run's ratio of depths moves between runs: the machine's state changes every few seconds,
and a deeper step, whose verify is arithmetic on several rows, feels it where a K=0 step barely
does. Each round times one B=1 generation at each depth (its decode steps alone, as the bench times
them) and then a 16-row product on a weight that fits a core's cache, and a read of 64 MB. Rounds
are then grouped by the product's rate.

    python benchmarks/machine_modes.py [--depths 0 3] [--rounds 400] [--split 95] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
from compiled_mtp.bench import bench_prompts, best_of, resident_bandwidth, timed_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs=2, default=[0, 3], help="the two depths (default: 0 3)")
    parser.add_argument("--rounds", type=int, default=400, help="rounds (default: 400)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per generation (default: 64)")
    parser.add_argument("--split", type=float, default=95.0, help="GFLOP/s between the groups (default: 95)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="capture cache (default: the user's)")
    args = parser.parse_args()
    runtimes = {
        k: Runtime.from_pretrained(
            mtp_depth=k, batch_sizes=(1,), max_seq_len=128, cache_dir=args.cache_dir, draft_vocab=1024
        )
        for k in args.depths
    }
    vocab = runtimes[args.depths[0]].model.cfg.vocab_size
    prompts = bench_prompts(Path(DEFAULT_MODEL), vocab, 8, 64).token_ids
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    x, weight = torch.randn(16, 512), torch.randn(512, 512)
    rows = []
    for r in range(args.rounds + 1):  # the first round warms up
        steps = []
        for k in args.depths:
            timing = timed_generate(runtimes[k], [prompts[r % len(prompts)]], params)
            steps.append(1e3 * timing.decode_seconds / timing.decode_steps)
        product = (
            2 * 50 * x.shape[0] * weight.numel() / best_of(5, "cpu", lambda: [x @ weight for _ in range(50)])
        )
        read = resident_bandwidth("cpu", 64 << 20, runs=3)
        if r:
            rows.append((*steps, product / 1e9, read / 1e9))
    low, high = args.depths
    for name, group in (
        ("fast", [s for s in rows if s[2] >= args.split]),
        ("slow", [s for s in rows if s[2] < args.split]),
    ):
        if group:
            med = [statistics.median(s[i] for s in group) for i in range(4)]
            ratio = statistics.median(s[1] / s[0] for s in group)
            print(
                f"{name} products ({len(group)} of {len(rows)} rounds): K={low} {med[0]:.3f} ms,"
                f" K={high} {med[1]:.3f} ms ({ratio:.2f}x), 16-row product {med[2]:.0f} GFLOP/s,"
                f" 64 MB read {med[3]:.1f} GB/s"
            )
    print("rounds in order (F: fast products):", "".join("F" if s[2] >= args.split else "s" for s in rows))


if __name__ == "__main__":
    main()
