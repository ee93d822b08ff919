"""HF transformers' generate, the baseline the engine is measured against."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from .. import hf_baseline
from ..models.registry import read_config
from ..runtime import DTYPES
from .results import HFRun
from .timing import best_of


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
