"""Capture profiles: which graphs to pre-build for a model, read from `profiles/*.toml`.

A profile fixes everything the graphs' shapes depend on besides the model config (dtype, device,
max_seq_len, prefill_chunk, batch buckets, MTP depths), so a runtime built with the same settings
finds every graph it needs in the capture cache.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .aot import CPU_ONLY

# `model = "default"` names the checkpoint shipped inside the package.
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "default_model"
# The shipped profiles (beside the package in a source checkout, which `make demo` installs in place).
PROFILES = Path(__file__).resolve().parents[2] / "profiles"
REQUIRED = ("dtype", "device", "max_seq_len", "batch_sizes", "mtp_depths")
OPTIONAL = ("model", "prefill_chunk", "draft_vocab", "description")


class ProfileError(ValueError):
    """A profile that cannot be used: the one-line message names the file and the field."""


@dataclass(frozen=True)
class Profile:
    """Runtime settings to capture graphs for; `model` is None when the command line must name it."""

    path: Path
    dtype: str
    device: str
    max_seq_len: int
    batch_sizes: tuple[int, ...]
    mtp_depths: tuple[int, ...]
    prefill_chunk: int = 64
    draft_vocab: int | None = None  # draft among the checkpoint's N most frequent tokens
    model: Path | None = None
    description: str = ""

    def runtime_options(self) -> dict[str, Any]:
        """Keyword arguments for `Runtime.from_pretrained` that give exactly this profile's graphs."""
        return {
            "mtp_depth": max(self.mtp_depths),
            "mtp_depths": self.mtp_depths,
            "batch_sizes": self.batch_sizes,
            "max_seq_len": self.max_seq_len,
            "dtype": self.dtype,
            "device": self.device,
            "prefill_chunk": self.prefill_chunk,
            "draft_vocab": self.draft_vocab,
        }


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile; any problem raises ProfileError naming the field."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(f"{path}: not a valid TOML file ({e})") from None
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ProfileError(f"{path}: unknown field {unknown[0]!r} (fields: {', '.join(REQUIRED + OPTIONAL)})")
    missing = [name for name in REQUIRED if name not in raw]
    if missing:
        raise ProfileError(f"{path}: missing field {missing[0]!r}")

    def fail(name: str, what: str) -> ProfileError:
        return ProfileError(f"{path}: field {name!r} {what}, got {raw[name]!r}")

    max_seq_len = _int(raw, "max_seq_len", 1, fail)
    profile = Profile(
        path=path,
        dtype=_dtype(raw, fail),
        device=_device(raw, fail),
        max_seq_len=max_seq_len,
        batch_sizes=_int_list(raw, "batch_sizes", 1, fail),
        mtp_depths=_int_list(raw, "mtp_depths", 0, fail),
        prefill_chunk=_int(raw, "prefill_chunk", 1, fail) if "prefill_chunk" in raw else min(64, max_seq_len),
        draft_vocab=_int(raw, "draft_vocab", 1, fail) if "draft_vocab" in raw else None,
        model=_model(raw, path, fail),
        description=str(raw.get("description", "")),
    )
    if profile.prefill_chunk > max_seq_len:
        raise fail("prefill_chunk", f"must be at most max_seq_len ({max_seq_len})")
    return profile


# Makes the one-line error for a bad field: fail(field, what is wrong with it).
_Fail = Callable[[str, str], ProfileError]


def _int(raw: dict, name: str, low: int, fail: _Fail) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise fail(name, f"must be an integer >= {low}")
    return value


def _int_list(raw: dict, name: str, low: int, fail: _Fail) -> tuple[int, ...]:
    values = raw[name]
    ok = (
        isinstance(values, list)
        and values
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values)
    )
    if not ok:
        raise fail(name, f"must be a non-empty list of integers >= {low}")
    return tuple(sorted(set(values)))


def _dtype(raw: dict, fail: _Fail) -> str:
    name = raw["dtype"]
    if (
        not isinstance(name, str)
        or not isinstance(getattr(torch, name, None), torch.dtype)
        or not getattr(torch, name).is_floating_point
    ):
        raise fail("dtype", "must name a floating-point torch dtype such as 'float32' or 'bfloat16'")
    return name


def _device(raw: dict, fail: _Fail) -> str:
    if raw["device"] != "cpu":
        raise fail("device", f"must be 'cpu': {CPU_ONLY}")
    return "cpu"


def _model(raw: dict, path: Path, fail: _Fail) -> Path | None:
    """`default` is the packaged checkpoint; other paths are relative to the profile's directory."""
    if "model" not in raw:
        return None
    value = raw["model"]
    if not isinstance(value, str) or not value:
        raise fail("model", 'must be a checkpoint directory or "default"')
    return DEFAULT_MODEL if value == "default" else (path.parent / value).resolve()
