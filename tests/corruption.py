"""Ways to break a checkpoint on disk, for the loader's error tests. Work on a `copy_checkpoint` copy.

config.json is edited with `set_config_fields` (tests/checkpoints.py, which also writes with it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from tests.checkpoints import rewrite_tensors, shard_files


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A copy of checkpoint directory `src` at `dst` (to break without touching `src`)."""
    return Path(shutil.copytree(src, dst))


def file_of(path: str | Path, key: str) -> Path:
    """The safetensors file of checkpoint `path` that holds `key`."""
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            if key in f.keys():
                return file
    raise KeyError(key)


def delete_key(path: str | Path, key: str) -> None:
    """Remove tensor `key` from its file (and from the index)."""
    rewrite_tensors(path, lambda _, tensors: {k: v for k, v in tensors.items() if k != key})


def add_key(path: str | Path, key: str, value: Tensor | None = None) -> None:
    """Add tensor `key` (default: a float32 zeros [4]) to the last file (and the index)."""
    last = shard_files(path)[-1]
    extra = {key: torch.zeros(4) if value is None else value}
    rewrite_tensors(path, lambda file, tensors: tensors | extra if file == last else tensors)


def set_key(path: str | Path, key: str, value: Callable[[Tensor], Tensor]) -> None:
    """Replace tensor `key` by `value(the tensor)`, in its own file."""
    file = file_of(path, key)
    rewrite_tensors(path, lambda f, tensors: tensors | {key: value(tensors[key])} if f == file else tensors)


def reshape_key(path: str | Path, key: str, shape: tuple[int, ...]) -> None:
    """Replace tensor `key` by zeros of `shape` (same dtype)."""
    set_key(path, key, lambda t: torch.zeros(shape, dtype=t.dtype))


def truncate_file(file: str | Path, fraction: float = 0.5) -> None:
    """Cut a file to `fraction` of its size."""
    data = Path(file).read_bytes()
    Path(file).write_bytes(data[: int(len(data) * fraction)])


def write_garbage(file: str | Path, seed: int = 0) -> None:
    """Overwrite a file with seeded random bytes of the same length."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (Path(file).stat().st_size,), generator=gen, dtype=torch.uint8)
    Path(file).write_bytes(data.numpy().tobytes())
