"""Turns a graph key (kind, B, K) into a compiled callable, once, and replays it. Which keys a runtime
calls, and with which step tensors, is the step plan's (graphs/plan.py).

Without a capture cache, each key is a torch.compile'd function. Dynamo caches compiled code per code
object and stops recompiling after 8 entries, so graphs built from one Python function would evict
each other. Each key therefore compiles its own copy of the step function's code object. After a key's
first call, calls run under the "fail_on_recompile" stance: a guard failure in steady state is an
error, never a silent recompile.

With a capture cache (inductor backend), each key is an AOTInductor package from the cache, built and
stored first when it is missing, corrupt or stale (see aot.py and cache.py).
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..graphs.plan import GraphKey
from ..graphs.state import StaticState
from ..models.family import CausalLM
from ..passes.manager import inductor_options
from . import aot, weight_copies
from .cache import MISSING, GraphCache

# "eager" runs the step functions uncompiled; "aot_eager" traces them like "inductor" (same graphs,
# guards and recompile rules) but skips code generation, for fast tests of the compiled path.
BACKENDS = ("inductor", "aot_eager", "eager")
log = logging.getLogger("compiled_mtp.capture")
# Graph builds take tens of seconds each: say which graph is being built, how long it took and how
# many are still to come, on stderr by default.
# Opt out: logging.getLogger("compiled_mtp.progress").setLevel(logging.WARNING).
progress = logging.getLogger("compiled_mtp.progress")
if not progress.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("compiled_mtp: %(message)s"))
    progress.addHandler(_handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False  # an application's root handler would print each line twice


def _compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


def own_code(fn: Callable, name: str) -> Callable:
    """A function with `fn`'s behaviour and a code object of its own, named `name`.

    Dynamo keeps its compiled graphs and its recompile count per code object, so graphs compiled
    from copies of one function (one per graph key, with other shapes) neither share nor exhaust one
    cache, and each shows under its own name in logs and profiles."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class CompiledGraphs:
    """The graphs of one runtime. `compiles` counts graphs built in this process (compiled in place,
    or built and stored into the cache), `loads` those taken from the cache. `keys` are the graphs the
    runtime may call, for the progress lines' count of those still to come; graphs readied together
    (`prepare_each`) count those instead."""

    def __init__(
        self,
        model: CausalLM,
        state: StaticState,
        backend: str = "inductor",
        passes: tuple[str, ...] | None = None,
        cache_dir: str | Path | None = None,
        keys: tuple[GraphKey, ...] = (),
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"compile_backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.on_cuda = state.target_cache.is_cuda
        self.cuda_graphs = backend == "inductor" and self.on_cuda  # Inductor replays them
        if cache_dir is not None and self.cuda_graphs:
            raise ValueError(
                f"cache_dir: {aot.CPU_ONLY}; leave it unset on CUDA, "
                "where graphs compile in the process and replay as CUDA graphs"
            )
        self.model = model
        self.state = state
        self.backend = backend
        self.inductor_options = inductor_options(passes)  # validates the pass names
        if backend == "inductor":
            self.inductor_options["post_grad_custom_post_pass"].prepare(model)
        # Only Inductor produces code worth storing; the other backends build in-process.
        self.cache = GraphCache(cache_dir) if cache_dir is not None and backend == "inductor" else None
        why = self.cache and self.cache.unwritable()
        if why:
            log.warning("capture cache: %s; building the graphs in this process instead", why)
            self.cache = None
        self._graphs: dict[GraphKey, Callable] = {}
        self.keys = keys
        self._counted = keys  # what the progress lines count
        self.replays: Counter[GraphKey] = Counter()
        self.compiles = 0
        self.loads = 0
        self.recompiles = 0
        self.seconds = 0.0  # inside graph calls, first (compiling or loading) calls included

    def begin_step(self) -> None:
        """A runtime step begins (a prefill or a decode step). CUDA-graph replay reuses the memory
        of earlier replays' outputs from here on; a step reads only its own graphs' outputs."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def follow_weights(self) -> None:
        """The bfloat16 copies of weights that packages read take any in-place update of the weights
        made since (weight_copies.py). Raises weight_copies.NotBFloat16 where the update does not hold
        bfloat16 values."""
        weight_copies.refresh(self.model)

    def __call__(self, key: GraphKey, *inputs: torch.Tensor) -> Any:  # what the step returns
        start = time.perf_counter()
        if not self.replays[key]:
            out = self._first_call(key, inputs, start)
        elif self.cache is not None:  # a package: no Dynamo frame to guard or count (16 us a call)
            out = self._graphs[key](*inputs)
        else:
            frames = _compiled_frames()
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._graphs[key](*inputs)
            self.recompiles += _compiled_frames() - frames
        if self.on_cuda:
            torch.cuda.synchronize()  # graph calls return before the GPU is done: time the work
        self.seconds += time.perf_counter() - start
        self.replays[key] += 1
        return out

    def _first_call(self, key: GraphKey, inputs: tuple[torch.Tensor, ...], start: float) -> Any:
        """A key's first call, prepared or not: torch.compile builds on it, so it runs outside the
        stance that fails on a compile."""
        compiles = self.compiles
        builds = self.cache is None and self.backend != "eager"
        if builds:
            self._building(key)
        out = self.prepare(key, inputs)(*inputs)
        if builds or self.compiles > compiles:
            left = {*self.keys} - {key} - self._ready()
            progress.info(
                "built %s in %.1f s; %d of %d graphs left",
                key.name,
                time.perf_counter() - start,
                len(left),
                len(self.keys),
            )
        return out

    def prepare_each(
        self, keys: Sequence[GraphKey], inputs: Callable[[GraphKey], tuple[torch.Tensor, ...]]
    ) -> None:
        """`prepare` each of `keys`, in order, its step tensors shaped like `inputs(key)`. The progress
        lines count these keys: a command that readies some of the runtime's graphs says how many of
        those are ready, not of every graph it might call later."""
        self._counted = tuple(keys)
        try:
            for key in keys:
                self.prepare(key, inputs(key))
        finally:
            self._counted = self.keys

    def prepare(self, key: GraphKey, inputs: tuple[torch.Tensor, ...]) -> Callable:
        """The callable of `key`, taking step tensors shaped like `inputs`. With a cache it is loaded
        (or built and stored) now; a torch.compile'd one compiles on its first call."""
        if key not in self._graphs:
            self._graphs[key] = self._cached(key, inputs) if self.cache else self._build(key)
        return self._graphs[key]

    def _ready(self) -> set[GraphKey]:
        """Keys whose graphs are built: a package once loaded, a torch.compile'd graph once called."""
        return set(self._graphs) if self.cache is not None else {k for k, n in self.replays.items() if n}

    def _building(self, key: GraphKey) -> None:
        where = f"into {self.cache.root}" if self.cache else "in this process"
        ready = len(self._ready() & {*self._counted})
        progress.info("building %s %s (%d of %d graphs ready)", key.name, where, ready, len(self._counted))

    def _build(self, key: GraphKey) -> Callable:
        if self.backend == "eager":
            return functools.partial(key.kind.step, self.model, self.state)
        self.compiles += 1  # torch.compile compiles on the first call, which follows at once
        fn = own_code(key.kind.step, key.name.replace("/", "_"))
        # The model and the static state are built once and then only written in place (packed_linear
        # packs copies of the weights; a cached package holds no guards at all), so Dynamo's guards on
        # their modules only cost time: 0.3 ms of a 2.0-2.3 ms verify of the shipped model. The guards
        # on the step tensors stay, and a step tensor of another shape or dtype still fails loudly.
        options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if self.backend != "inductor":
            compiled = torch.compile(fn, backend=self.backend, fullgraph=True, dynamic=False, options=options)
        else:
            options |= {**self.inductor_options, "triton.cudagraphs": self.cuda_graphs}
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
        return functools.partial(compiled, self.model, self.state)

    def _cached(self, key: GraphKey, inputs: tuple[torch.Tensor, ...]) -> Callable:
        """Load the key's package; build and store it first when it is missing or unusable. A bad
        package costs a rebuild and one log line, never a crash or a wrong graph."""
        cache = self.cache
        assert cache is not None  # prepare() comes here only with a cache
        akey = aot.artifact_key(key, self.model, self.state, inputs, self.inductor_options)
        with cache.locked(akey):  # another process may be building this key: wait for it
            problem = cache.problem(akey)
            if problem is None:
                try:
                    graph = aot.load(cache.package(akey), self.model, self.state)
                except Exception as e:  # checksum intact but unloadable: treat like any corrupt file
                    problem = f"corrupt (cannot load: {_first_line(e)})"
                else:
                    self.loads += 1
                    return graph
            if problem != MISSING:
                log.warning(
                    "capture cache: %s at %s is %s; rebuilding it",
                    key.name,
                    cache.package(akey),
                    problem,
                )
            self._building(key)
            build = functools.partial(
                aot.build, key.kind, self.model, self.state, inputs, options=self.inductor_options
            )
            cache.store(akey, build, key.name)
            self.compiles += 1
            return aot.load(cache.package(akey), self.model, self.state)
