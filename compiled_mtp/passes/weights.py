"""What the passes know of the model's weights while they run: whether every weight matrix holds
bfloat16 values, as a bfloat16 checkpoint's do once upcast to float32.

The C++ ops read such weights from bfloat16 panels (ops/csrc/panels.h), half the bytes and the same
products bit for bit, so even a one-row product gains from leaving Inductor's code for an op call;
with float32 values it does not (measured in docs/passes.md). The pass manager finds this out once
per model and sets it while its passes run.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

BFLOAT16_VALUES: ContextVar[bool] = ContextVar("bfloat16_values", default=False)
CHUNK = 1 << 22  # elements tested at once, so that a large LM head needs no copy of its own size


def rows_for_values(float32: float, bfloat16: float) -> float:
    """A bound on the rows a pass sends to a C++ op while it runs: `bfloat16` where the model's weights
    hold bfloat16 values (the op then reads half the bytes, which pays for its call on fewer rows), else
    `float32`."""
    return bfloat16 if BFLOAT16_VALUES.get() else float32


def bfloat16_values(model: torch.nn.Module) -> bool:
    """Whether every float32 parameter of two or more dimensions has only bfloat16 values (the low 16
    bits of every element zero)."""
    return all(
        holds_bfloat16_values(p)
        for p in model.parameters()
        if p.dtype == torch.float32 and p.dim() >= 2 and p.device.type == "cpu"
    )


def holds_bfloat16_values(weight: torch.Tensor) -> bool:
    """Whether every element of a float32 tensor is a bfloat16 value (its low 16 bits zero)."""
    bits = weight.detach().reshape(-1).view(torch.int32)
    return not any(bool((chunk & 0xFFFF).any()) for chunk in bits.split(CHUNK))
