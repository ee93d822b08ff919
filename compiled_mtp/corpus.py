"""The shipped model's text: the Python standard library's source, split into training and held-out files.

scripts/train_default.py trains on the training files and measures acceptance on prompts cut from
the held-out ones; `compiled-mtp bench` cuts its prompts the same way, so both measure on text the
model has not seen. The text differs a little between Python versions (the model was trained on 3.11).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
HOLDOUT_EVERY = 20

File = tuple[str, str]  # (path relative to the stdlib root, text)


def stdlib_files() -> list[File]:
    """(relative path, text) of every UTF-8 stdlib *.py outside site-packages and test suites, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
    return sorted(out)


def split(files: list[File]) -> tuple[list[File], list[File]]:
    """(training, held-out) files: every `HOLDOUT_EVERY`-th file (index 0, 20, 40, ...) is held out."""
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    return train, held


def acceptance_prompts(
    encode: Callable[[str], list[int]], held: list[File], n: int, length: int
) -> list[list[int]]:
    """A `length`-token window starting one third into each held-out file, for the first `n` files with
    at least 3 * `length` tokens (fewer than `n` when too few are that long)."""
    prompts = []
    for _, text in held:
        ids = encode(text)
        if len(ids) < 3 * length:
            continue
        a = len(ids) // 3
        prompts.append(ids[a : a + length])
        if len(prompts) == n:
            break
    return prompts
