"""Builds the hand-written C++ kernels with Inductor's own toolchain: the compiler and vector flags of
its generated kernels, and its disk cache, so a kernel compiles once per machine."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn


def load(name: str, argtypes: list[str], source: str, fallback: str) -> Callable[..., None] | None:
    """`source`'s `extern "C" void kernel(...)` taking `argtypes`, or None (with a warning naming the
    `fallback` the op runs instead) where it does not build: a missing or failing compiler leaves the
    engine correct, only slower."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    try:
        return CppPythonBindingsCodeCache.load_pybinding(argtypes, source, needs_vec_isa=True)
    except Exception as error:
        warnings.warn(f"{name}: the C++ kernel did not build ({str(error).splitlines()[0]}); using {fallback}", stacklevel=4)
        return None


def serves(model: nn.Module) -> bool:
    """Whether `model` runs on CPU in float32, the only calls the whole-model kernels (attention,
    sampling) take: such a kernel is built before the first step only then."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32
