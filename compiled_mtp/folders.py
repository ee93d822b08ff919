"""Folders a command writes into, checked before its work: a path it cannot write fails in one line
naming its option, before minutes of building or measuring rather than after them."""

from __future__ import annotations

import tempfile
from pathlib import Path


def not_a_folder(path: Path, field: str) -> str | None:
    """Why `path` cannot be a folder, the error naming `field`: a file at it or above it. None
    where nothing is in the way."""
    file = next((d for d in (path, *path.parents) if d.exists() and not d.is_dir()), None)
    if file is None:
        return None
    return (
        f"{field}: {path} is not a directory"
        if file == path
        else f"{field}: {path}: {file} is not a directory"
    )


def writable_folder(path: str | Path, field: str) -> Path:
    """`path`, made with its parents where missing, once a file can be written in it; else a
    ValueError naming `field`."""
    path = Path(path).expanduser()
    why = not_a_folder(path, field)
    if why is not None:
        raise ValueError(why)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"{field}: cannot write into {path} ({e.strerror or e})") from None
    return path
