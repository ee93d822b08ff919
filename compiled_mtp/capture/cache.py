"""The on-disk capture cache: one compiled package per graph key, with JSON metadata beside it.

Files are `<kind>-B<b>-K<k>-<digest>.pt2` and `.json`. The digest hashes the key without the torch and
compiled_mtp versions and source digest, so a package built by another version sits at the path the
current one wants: it is found, reported stale and rebuilt in place instead of piling up beside the
new one.

The metadata (the full key, size, sha256 of the package, creation time) lets a package be checked
without loading it. Writers hold `locks/<stem>.lock` (fcntl.flock) while they check, build and store
a key, and write through a temp file renamed into place (os.replace): two processes capturing into
one directory build each key once between them, and nobody ever reads a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from compiled_mtp.file_lock import exclusive
from compiled_mtp.folders import not_a_folder

FORMAT = 1
VERSIONED = ("torch", "compiled_mtp", "source")  # fields left out of the file name (see the module docstring)
MISSING = "missing"


def user_cache() -> Path:
    """The per-user capture cache every command and `Runtime.from_pretrained` use by default:
    $XDG_CACHE_HOME/compiled_mtp/graphs (~/.cache/compiled_mtp/graphs)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "compiled_mtp" / "graphs"


@dataclass(frozen=True)
class Artifact:
    """One cached graph, as `compiled-mtp inspect` lists it."""

    name: str  # e.g. "target_verify/B1/K3"
    model: str  # e.g. "61L H7168 bfloat16 cuda"
    settings: (
        str  # what tells apart keys of one model and name, e.g. "seq 512, 4 slots, K<=3, passes 1a2b3c4d"
    )
    file: str
    size: int
    created: str
    torch: str
    status: str  # "valid", or "stale (...)" / "corrupt (...)"


class GraphCache:
    """A capture cache directory (created on first use)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def unwritable(self) -> str | None:
        """Create the directory; None when this process can store graphs in it, else why not. A path
        that is a file, or lies under one, raises ValueError: that is a mistake, not a read-only cache."""
        locks = self.root / "locks"
        why = not_a_folder(self.root, "cache_dir") or not_a_folder(locks, "cache_dir")
        if why is not None:
            raise ValueError(why)
        try:
            locks.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create {locks} ({e.strerror})"
        if not all(os.access(d, os.W_OK | os.X_OK) for d in (self.root, locks)):
            return f"{self.root} is not writable"
        return None

    def stem(self, key: dict[str, Any]) -> str:
        identity = {k: v for k, v in key.items() if k not in VERSIONED}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        return f"{key['kind']}-B{key['batch']}-K{key['depth']}-{digest}"

    def package(self, key: dict[str, Any]) -> Path:
        return self.root / f"{self.stem(key)}.pt2"

    def _meta(self, key: dict[str, Any]) -> Path:
        return self.root / f"{self.stem(key)}.json"

    def locked(self, key: dict[str, Any]) -> AbstractContextManager[None]:
        """Hold the key's lock: check, build and store under it."""
        return exclusive(self.root / "locks" / f"{self.stem(key)}.lock")

    def problem(self, key: dict[str, Any]) -> str | None:
        """None when the key's package is present, intact and built for exactly `key`; else why not
        (MISSING, "stale (...)" or "corrupt (...)")."""
        meta_path, package = self._meta(key), self.package(key)
        if not meta_path.exists() and not package.exists():
            return MISSING
        meta, why = _read_meta(meta_path)
        if meta is None:
            return f"corrupt ({why})"
        changed = [
            name for name in sorted(set(key) | set(meta["key"])) if key.get(name) != meta["key"].get(name)
        ]
        if changed:
            return f"stale ({_describe(changed, meta['key'], key)})"
        return _integrity(package, meta)

    def store(self, key: dict[str, Any], build: Callable[[Path], None], name: str) -> None:
        """Build the key's package with `build(path)` and put it and its metadata in place atomically.
        Call under `locked(key)`."""
        self.root.mkdir(parents=True, exist_ok=True)
        stem = self.stem(key)
        tmp_package, tmp_meta = self.root / f".{stem}.tmp.pt2", self.root / f".{stem}.tmp.json"
        try:
            build(tmp_package)
            meta = {
                "format": FORMAT,
                "name": name,
                "key": key,
                "created": datetime.now().astimezone().isoformat(timespec="seconds"),
                "size": tmp_package.stat().st_size,
                "sha256": _sha256(tmp_package),
            }
            tmp_meta.write_text(json.dumps(meta, indent=1))
            # Package first: a crash between the two renames leaves a checksum mismatch, read as corrupt.
            os.replace(tmp_package, self.package(key))
            os.replace(tmp_meta, self._meta(key))
        finally:
            tmp_package.unlink(missing_ok=True)
            tmp_meta.unlink(missing_ok=True)

    def artifacts(self, environment: Callable[[str], dict[str, str]]) -> list[Artifact]:
        """Every package in the cache, checked without loading. `environment(device_type)` gives the
        values of the key's environment fields here; artifacts built for others are stale."""
        found = []
        for package in sorted(self.root.glob("[!.]*.pt2")):
            meta, why = _read_meta(package.with_suffix(".json"))
            if meta is None:
                found.append(
                    Artifact(
                        package.stem,
                        "?",
                        "?",
                        package.name,
                        package.stat().st_size,
                        "?",
                        "?",
                        f"corrupt ({why})",
                    )
                )
                continue
            key, here = meta["key"], environment(meta["key"].get("device", "cpu"))
            changed = [name for name in here if key.get(name) != here[name]]
            status = _integrity(package, meta) or "valid"
            if changed and status == "valid":
                status = f"stale ({_describe(changed, key, here)})"
            found.append(
                Artifact(
                    meta["name"],
                    _model(key),
                    _settings(key),
                    package.name,
                    package.stat().st_size,
                    meta["created"],
                    key.get("torch", "?"),
                    status,
                )
            )
        return found


def _model(key: dict[str, Any]) -> str:
    config = key.get("model_config") or {}
    layers, hidden = config.get("num_hidden_layers", "?"), config.get("hidden_size", "?")
    return f"{layers}L H{hidden} {key.get('dtype', '?')} {key.get('device', '?')}"


def _settings(key: dict[str, Any]) -> str:
    state = key.get("state") or {}
    passes = (key.get("inductor") or {}).get("post_grad_custom_post_pass", "?")
    seq, slots, depth = (state.get(name, "?") for name in ("max_seq_len", "num_slots", "max_depth"))
    return f"seq {seq}, {slots} slots, K<={depth}, passes {passes[:8]}"


def _read_meta(path: Path) -> tuple[dict[str, Any] | None, str]:
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "metadata missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None, "metadata unreadable"
    fields = ("format", "name", "key", "created", "size", "sha256")
    if not isinstance(meta, dict) or any(f not in meta for f in fields) or not isinstance(meta["key"], dict):
        return None, "metadata incomplete"
    if meta["format"] != FORMAT:
        return None, f"metadata format {meta['format']!r}, expected {FORMAT}"
    return meta, ""


def _integrity(package: Path, meta: dict[str, Any]) -> str | None:
    if not package.exists():
        return "corrupt (package missing)"
    size = package.stat().st_size
    if size != meta["size"]:
        return f"corrupt (size {size} bytes, expected {meta['size']})"
    if _sha256(package) != meta["sha256"]:
        return "corrupt (checksum mismatch)"
    return None


def _describe(changed: list[str], built: dict[str, Any], wanted: dict[str, Any]) -> str:
    """'built for torch 2.12.0, not 2.13.0' for short values, the field names for long ones (three at most)."""
    parts = []
    for name in changed[:3]:
        old, new = built.get(name), wanted.get(name)
        short = all(isinstance(v, (str, int, type(None))) and len(str(v)) <= 40 for v in (old, new))
        parts.append(f"built for {name} {old}, not {new}" if short else f"{name} differs")
    return "; ".join(parts) + ("; ..." if len(changed) > 3 else "")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
