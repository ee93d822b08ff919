"""The bfloat16 copies of a model's weights that its packaged graphs read (passes/bfloat16_reads.py).

A package is built without constants and reads the live model's tensors in place (aot.py). The copies
are made the same way, on load, from the live weights: once per model, shared by all its graphs. An
in-place update of a weight (a new checkpoint loaded into the same tensors) reaches the copies at the
next `refresh`, which the runtime calls whenever requests are added: the copy is rewritten in its
own memory, whose address the loaded graphs hold.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ops import library
from ..passes.bfloat16_reads import weight_of
from ..passes.weights import holds_bfloat16_values


@dataclass
class _Copy:
    weight: Tensor
    copy: Tensor
    version: int  # the weight's version counter when copied


# Each model's copies, by constant name.
_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[str, _Copy]] = weakref.WeakKeyDictionary()


class NotBFloat16(ValueError):
    """A weight read as bfloat16 holds values that bfloat16 does not."""


def copies_of(model: nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The bfloat16 copies of `weights` (constant name -> live weight), made where not made yet."""
    made = _COPIES.setdefault(model, {})
    for name, weight in weights.items():
        if name not in made:
            made[name] = _Copy(weight, _bfloat16(name, weight), weight._version)
    return {name: made[name].copy for name in weights}


def copy_bytes(weight: Tensor) -> int:
    """The bytes of `weight`'s bfloat16 copy, where a loaded graph reads one, else 0."""
    for made in _COPIES.values():
        for entry in made.values():
            if entry.weight.data_ptr() == weight.data_ptr() and entry.weight.shape == weight.shape:
                return entry.copy.nbytes
    return 0


def refresh(model: nn.Module) -> None:
    """Rewrite the copies of weights updated in place since they were made."""
    for name, entry in _COPIES.get(model, {}).items():
        if entry.weight._version != entry.version:
            entry.copy.copy_(_bfloat16(name, entry.weight))
            entry.version = entry.weight._version


def _bfloat16(name: str, weight: Tensor) -> Tensor:
    """The bfloat16 copy of `weight`, the value of constant `name`."""
    if not holds_bfloat16_values(weight):
        raise NotBFloat16(
            f"{weight_of(name)}: the graphs read this weight as bfloat16, but it holds other values; "
            "load such weights into a new Runtime"
        )
    if weight.device.type != "cpu":
        return weight.detach().to(torch.bfloat16)
    return library.huge_page_empty(weight.shape, torch.bfloat16).copy_(weight.detach())
