"""The bench's prompts: held-out text where the checkpoint has a tokenizer, else seeded random ids."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import corpus
from ..tokenizer import Tokenizer


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
