"""torch's CPU float32 precision (torch.backends.mkldnn.matmul.fp32_precision) inside a block, and
whether "bf16" gets the C++ ops' bfloat16 dot products on this machine (csrc/panels.h)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from compiled_mtp.ops import library


@contextlib.contextmanager
def fp32_precision(name: str) -> Iterator[None]:
    """torch.backends.mkldnn.matmul.fp32_precision = name inside; after, as it was."""
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = name
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


with fp32_precision("bf16"):
    BFLOAT16_DOT = library.bfloat16_products()
needs_bfloat16_dot = pytest.mark.skipif(not BFLOAT16_DOT, reason="no AVX512-BF16 dot products here")
