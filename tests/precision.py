"""The dense MLPs' bfloat16 products (compiled_mtp.ops.library.bfloat16_products) inside a block, and
whether this machine has them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from compiled_mtp.ops import library


@contextlib.contextmanager
def bfloat16_mlps() -> Iterator[None]:
    """The bfloat16 products on inside; after, as they were."""
    before = library.bfloat16_products()
    library.bfloat16_products(True)
    try:
        yield
    finally:
        library.bfloat16_products(before)


with bfloat16_mlps():
    BFLOAT16_DOT = library.bfloat16_products()
needs_bfloat16_dot = pytest.mark.skipif(not BFLOAT16_DOT, reason="no AVX512-BF16 dot products here")
