"""`compiled_mtp::linear`: y = x W^T (+ b) through oneDNN's packed-weight GEMM on CPU.

Plain `F.linear` (MKL's GEMM on a row-major weight) turns compute-bound from about 4 rows on this class
of CPU; with the weight reordered into oneDNN's blocked layout, 4-16 rows cost little more than one.
oneDNN rather than MKL's own packed GEMM (`torch.ops.mkl._mkl_linear`, what Inductor's freezing uses
for float32), which grows with the rows as F.linear does on an AMD EPYC (docs/passes.md,
packed_linear).

`pack_linears` repacks every `Linear` of a model once; the packed copies are found by the weight's
address, so every graph that calls the op (compiled in process or loaded from the capture cache)
shares them. A packed copy remembers the weight's version counter: after an in-place update of the
weight (load_state_dict into a live model) it is repacked on its next use, never used stale. A
weight without a packed copy (oneDNN absent, another dtype or device, never packed) runs `F.linear`.

The packed copy is an opaque oneDNN tensor, which neither a graph input nor an AOTInductor constant
can be; as a custom op that looks it up, the call compiles, caches and runs under AOTInductor.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.deepseek_v3 import Linear

# Rows the packed layout is tuned for: packed for 64, 1-8 rows cost the same (docs/passes.md).
PACK_ROWS = 64


@dataclass
class _Packed:
    weight: weakref.ref  # the parameter; while it lives, no other tensor can take its address
    version: int  # its version counter when packed
    packed: Tensor


# weight address -> its packed copy; an entry goes when its weight is freed.
_PACKED: dict[int, _Packed] = {}


def available() -> bool:
    return torch.backends.mkldnn.is_available()


def packable(weight: Tensor) -> bool:
    return available() and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def pack_linears(model: nn.Module, min_size: int = 0) -> int:
    """Pack the weight of every compiled_mtp Linear in `model` with at least `min_size` elements
    (once; repeated calls are free). Returns how many weights have a packed copy."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and packable(module.weight) and module.weight.numel() >= min_size:
            if module.weight.data_ptr() not in _PACKED:
                _PACKED[module.weight.data_ptr()] = _pack(module.weight)
                weakref.finalize(module.weight, _PACKED.pop, module.weight.data_ptr(), None)
            count += 1
    return count


def _pack(weight: Tensor) -> _Packed:
    with torch.no_grad():
        return _Packed(
            weakref.ref(weight),
            weight._version,
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS),
        )


def _lookup(weight: Tensor) -> Tensor | None:
    entry = _PACKED.get(weight.data_ptr())
    owner = entry.weight() if entry is not None else None
    if entry is None or owner is None or not weight.is_contiguous() or weight.shape != owner.shape:
        return None
    if owner._version != entry.version:  # written in place since it was packed
        entry = _PACKED[weight.data_ptr()] = _pack(owner)
    return entry.packed


@torch.library.custom_op("compiled_mtp::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, in] -> [M, out]."""
    packed = _lookup(weight) if x.dtype == torch.float32 else None
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
