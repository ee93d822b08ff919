"""The draft vocabulary's token ranking, stored beside a checkpoint as `draft_vocab.json`.

`draft_vocab=N` drafts among the N tokens that came up most often in calibration text (FR-Spec): the
ranking is computed once (`compiled-mtp calibrate`) and read at load time.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .config import CheckpointError

FILE = "draft_vocab.json"


def token_ranking(token_streams: Iterable[Iterable[int]], vocab_size: int) -> list[int]:
    """Every token id, most frequent in the streams first; ties (unseen tokens too) by id."""
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(stream)
    return sorted(range(vocab_size), key=lambda t: (-counts[t], t))


def write_ranking(checkpoint: str | Path, ranking: list[int], source: str) -> Path:
    """Store `ranking` beside the checkpoint (replacing the file whole, never half-written)."""
    path = Path(checkpoint) / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"source": source, "token_ids": ranking}) + "\n")
    tmp.replace(path)
    return path


def read_ranking(checkpoint: str | Path, vocab_size: int) -> list[int]:
    """The stored ranking; a one-line CheckpointError when it is missing or not a ranking of the vocabulary."""
    path = Path(checkpoint) / FILE
    if not path.exists():
        raise CheckpointError(
            f"draft_vocab: {path} does not exist; "
            f"write it with: compiled-mtp calibrate --model {checkpoint} --text FILE..."
        )
    try:
        ranking = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path}: unreadable ({e}); write it again with compiled-mtp calibrate"
        ) from None
    if sorted(ranking) != list(range(vocab_size)):
        raise CheckpointError(
            f"{path}: token_ids must rank every id in [0, {vocab_size}) once; "
            "write it again with compiled-mtp calibrate"
        )
    return ranking
