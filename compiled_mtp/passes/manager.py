"""The pass manager: the custom FX passes Inductor runs on every graph the engine compiles.

Inductor calls it as its post-grad custom pass. Its uuid combines the uuids of the enabled passes,
so Inductor's FX graph cache (and the capture cache) never serve code built with another pass set.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..ops import library
from .bfloat16_reads import BFloat16Reads
from .fold_key_constants import FoldKeyConstants
from .fuse_dense_mlp import FuseDenseMLP
from .fuse_draft_sampling import FuseDraftSampling
from .fuse_verify_sampling import FuseVerifySampling
from .group_experts import GroupExperts
from .live_attention import LiveAttention
from .narrow_linear import NarrowLinear
from .packed_linear import PackedLinear
from .panel_linear import PanelLinear
from .small_topk import SmallTopk
from .weights import BFLOAT16_VALUES, bfloat16_values

# name -> pass instance, in the order they run; each pass lives in its own module of this package.
# The passes that replace traced regions go first: they look for the graph as traced. narrow_linear
# takes the linears on up to 4 rows and panel_linear those on 5-16 before packed_linear takes the
# other large ones. Folding goes last, so it also folds what the other passes leave key-only.
REGISTRY: dict[str, CustomGraphPass] = {
    "fuse_verify_sampling": FuseVerifySampling(),
    "fuse_draft_sampling": FuseDraftSampling(),
    "live_attention": LiveAttention(),
    "group_experts": GroupExperts(),
    "fuse_dense_mlp": FuseDenseMLP(),
    "small_topk": SmallTopk(),
    "narrow_linear": NarrowLinear(),
    "panel_linear": PanelLinear(),
    "packed_linear": PackedLinear(),
    "bfloat16_reads": BFloat16Reads(),
    "fold_key_constants": FoldKeyConstants(),
}


def available() -> tuple[str, ...]:
    return tuple(sorted(REGISTRY))


class PassManager(CustomGraphPass):
    """Runs the enabled passes in registry order on a post-grad FX graph."""

    def __init__(self, enabled: tuple[str, ...]) -> None:
        unknown = sorted(set(enabled) - set(REGISTRY))
        if unknown:
            raise ValueError(
                f"passes: unknown pass {unknown[0]!r} (available: {', '.join(available()) or 'none'})"
            )
        self.enabled = tuple(name for name in REGISTRY if name in enabled)
        self.bfloat16_values = False  # the model's weights, once learn() has seen them (weights.py)
        self.on_cpu = True  # likewise: only graphs on CPU call the C++ ops

    def __call__(self, graph: torch.fx.Graph) -> None:
        token = BFLOAT16_VALUES.set(self.bfloat16_values)
        try:
            for name in self.enabled:
                REGISTRY[name](graph)
        finally:
            BFLOAT16_VALUES.reset(token)

    def learn(self, model: torch.nn.Module) -> None:
        """Take what the passes know of `model`'s weights (weights.py), leaving the model as it is."""
        self.bfloat16_values = bool(self.enabled) and library.serves(model) and bfloat16_values(model)
        self.on_cpu = next(model.parameters()).device.type == "cpu"

    def prepare(self, model: torch.nn.Module) -> None:
        """What the enabled passes do once per model, before any graph is built or loaded (learn its
        weights, pack them, build the C++ ops), so that no step served waits for it."""
        self.learn(model)
        library.settle(model, move=bool(self.enabled) and library.serves(model) and library.load())
        for name in self.enabled:
            prepare = getattr(REGISTRY[name], "prepare", None)
            if prepare is not None:
                prepare(model)

    def uuid(self) -> str:
        parts = [f"{name}:{REGISTRY[name].uuid()}" for name in self.enabled] + [
            f"bf16:{self.bfloat16_values}",
            # Which ops the passes call: the C++ ones where they built. A CUDA model's graphs call none,
            # so they do not wait for the library to build.
            f"ops:{self.on_cpu and bool(self.enabled) and library.load()}",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


# Elements a thread must have of a generated CPU loop nest before Inductor splits it across the
# threads (its default is 512). Each split loop opens a parallel region and ends at a barrier, and a
# step graph of a small model is dozens of loops of a few thousand elements (norms, rotary
# embeddings, products on a row or two): on 2 cores, a decode step at B=1 took 1.00-1.22x as long with
# the default as with these loops on one thread, as the machine's state moved (benchmarks/README.md,
# "Small loops on one thread"). The C++ ops choose their own threads.
MIN_CHUNK_SIZE = 1 << 18


def inductor_options(enabled: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Inductor config entries every step graph compiles with: the passes (all registered ones when
    `enabled` is None) and the smallest loop it splits across threads."""
    return {
        "post_grad_custom_post_pass": PassManager(available() if enabled is None else enabled),
        "cpp.min_chunk_size": MIN_CHUNK_SIZE,
    }


def without(disabled: list[str]) -> tuple[str, ...]:
    """Every registered pass except `disabled` (what --disable-pass leaves on)."""
    return tuple(name for name in available() if name not in disabled)


def add_pass_switch(parser: argparse.ArgumentParser) -> None:
    """The command-line switch that turns passes off, for benchmarks and bisecting."""
    parser.add_argument(
        "--disable-pass",
        action="append",
        default=[],
        choices=available(),
        metavar="NAME",
        help=f"compile without this custom FX pass (repeatable; passes: {', '.join(available())}) (default: all run)",
    )
