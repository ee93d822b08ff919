"""Turns a graph key (kind, B, K) into a compiled callable, once, and replays it.

Dynamo caches compiled code per code object and stops recompiling after 8 entries, so graphs built
from one Python function would evict each other. Each key therefore compiles its own copy of the step
function's code object. After a key's first call, calls run under the "fail_on_recompile" stance:
a guard failure in steady state is an error, never a silent recompile.
"""

from __future__ import annotations

import time
import types
from collections import Counter
from typing import Callable

import torch

from ..graphs import steps
from ..graphs.state import StaticState
from ..models.deepseek_v3 import DeepseekV3

# "eager" runs the step functions uncompiled; "aot_eager" traces them like "inductor" (same graphs,
# guards and recompile rules) but skips code generation, for fast tests of the compiled path.
BACKENDS = ("inductor", "aot_eager", "eager")
GraphKey = tuple[str, int, int]


def _compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


def key_name(key: GraphKey) -> str:
    kind, b, k = key
    return f"{kind}/B{b}/K{k}"


def _own_code(fn: Callable, name: str) -> Callable:
    """A function with `fn`'s behaviour and a code object of its own."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class CompiledGraphs:
    """The graphs of one runtime."""

    def __init__(self, model: DeepseekV3, state: StaticState, backend: str = "inductor") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"compile_backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.model = model
        self.state = state
        self.backend = backend
        self._graphs: dict[GraphKey, Callable] = {}
        self.replays: Counter[GraphKey] = Counter()
        self.compiles = 0
        self.recompiles = 0
        self.seconds = 0.0  # inside graph calls, first (compiling) calls included

    def __call__(self, key: GraphKey, *inputs: torch.Tensor):
        graph = self._graphs.get(key)
        start = time.perf_counter()
        if graph is None:
            graph = self._graphs[key] = self._build(key)
            out = graph(self.model, self.state, *inputs)
            if self.backend != "eager":
                self.compiles += 1
        else:
            frames = _compiled_frames()
            with torch.compiler.set_stance("fail_on_recompile"):
                out = graph(self.model, self.state, *inputs)
            self.recompiles += _compiled_frames() - frames
        self.seconds += time.perf_counter() - start
        self.replays[key] += 1
        return out

    def _build(self, key: GraphKey) -> Callable:
        step = getattr(steps, key[0])
        if self.backend == "eager":
            return step
        name = key_name(key).replace("/", "_")
        mode = "reduce-overhead" if self.state.target_cache.is_cuda else None
        return torch.compile(_own_code(step, name), backend=self.backend, fullgraph=True, dynamic=False, mode=mode)

    @property
    def keys(self) -> list[GraphKey]:
        return list(self._graphs)
