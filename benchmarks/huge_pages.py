"""Decode tok/s with the weights on 2 MiB pages and without (`COMPILED_MTP_HUGE_PAGES=0`), in turns.

The advice is taken once per process, so each side runs in processes of its own, one after the other,
`--pairs` times. Each process loads the shipped model (drafting among its 1024 most frequent tokens)
at each of `--depths` from a capture cache, warms every runtime up with a round, then times `--rounds`
rounds in which the depths take turns, each round the first 8 held-out prompts, `--batch` at a time,
64 new tokens each; a depth's figure is its best round's decode tok/s. Printed: every process's
figures, then per depth the ratio of each pair (on pages over without), median and range.

    python benchmarks/huge_pages.py [--batch 1] [--depths 0 2 3] [--pairs 5] [--rounds 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
from compiled_mtp.bench import bench_prompts, timed_generate, turns
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.draft_vocab import read_ranking

PROMPTS, NEW_TOKENS = 8, 64


def one_process(args: argparse.Namespace) -> dict[int, float]:
    """Best decode tok/s of each depth in this process."""
    model = load_model(DEFAULT_MODEL)
    model.restrict_drafts(torch.tensor(read_ranking(DEFAULT_MODEL, model.cfg.vocab_size)[:1024]))
    runtimes = {
        k: Runtime(model, mtp_depth=k, batch_sizes=(args.batch,), max_seq_len=128, cache_dir=args.cache_dir)
        for k in args.depths
    }
    prompts = bench_prompts(DEFAULT_MODEL, model.cfg.vocab_size, PROMPTS, 64).token_ids
    groups = [prompts[i : i + args.batch] for i in range(0, PROMPTS, args.batch)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for _, group, k in turns(args.depths, groups, 1):
        timed_generate(runtimes[k], group, params)
    seconds = {k: [0.0] * args.rounds for k in args.depths}
    for r, group, k in turns(args.depths, groups, args.rounds):
        seconds[k][r] += timed_generate(runtimes[k], group, params).decode_seconds
    return {k: PROMPTS * (NEW_TOKENS - 1) / min(s) for k, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=None, help="capture cache (default: the user's)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_process(args)))
        return
    child = [sys.executable, __file__, "--one", *sys.argv[1:]]
    figures: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
    for pair in range(args.pairs):
        for pages in ("0", "1"):
            env = {**os.environ, "COMPILED_MTP_HUGE_PAGES": pages}
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            figures[pages].append(json.loads(out.splitlines()[-1]))
            shown = " ".join(f"K={k} {v:.1f}" for k, v in figures[pages][-1].items())
            print(f"pair {pair + 1}, {'on 2 MiB pages' if pages == '1' else 'without'}: {shown}", flush=True)
    for k in map(str, args.depths):
        ratios = sorted(on[k] / off[k] for on, off in zip(figures["1"], figures["0"]))
        print(
            f"K={k}: on pages over without, per pair {statistics.median(ratios):.3f}x "
            f"({ratios[0]:.3f}-{ratios[-1]:.3f}x)"
        )


if __name__ == "__main__":
    main()
