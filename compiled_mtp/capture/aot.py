"""AOTInductor artifacts of the step graphs: code only, run against the caller's tensors.

A key's step function is exported inside a module whose submodules are the model and the StaticState,
so weights and state buffers are the graph's constants. The package is built without them
(`package_constants_in_so=False`: a few MB of code instead of the weights) and loaded with
`load_constants(..., user_managed=True)`, which stores the caller's tensor pointers. Hence:
- one package serves every checkpoint of a config, and weights sit in memory once for all graphs;
- state buffers are mutated in place by the graphs (KV-cache rows, drafts, draft probabilities), and
  because every graph holds pointers to the same StaticState, what prefill writes, verify reads.
The only constants a package carries are the ones the fold_key_constants pass made (values fixed by
the key: aranges, masks), stored inside the .pt2 and checked against their digest names on load.
The bfloat16 copies of weights that the bfloat16_reads pass has the code read are made on load from
the live weights, once per model, and shared by all its graphs.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import operator
import platform
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._inductor import cpp_builder
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import parallel_num_threads
from torch.export.pt2_archive._package import AOTICompiledModel

from ..graphs.plan import GraphKey, GraphKind
from ..graphs.state import StaticState
from ..models.family import CausalLM
from ..passes.bfloat16_reads import weight_of
from ..passes.fold_key_constants import PREFIX as FOLDED_PREFIX
from ..passes.fold_key_constants import folded_name, folded_value
from . import elf, weight_copies

# Inductor settings every artifact needs. Without `always_keep_tensor_constants`, Inductor copies
# 1-D constants of <= 8 elements into the code (the router's correction bias of a small model, the
# per-slot temperature), which would freeze them at their capture-time values.
AOT_OPTIONS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}


# Packages whose code ends up in the graphs (with this module, which sets how they are built).
SOURCES = ("graphs", "models", "passes")
FOLDED_ENTRY = "compiled_mtp_folded_constants.pt"  # in the package's extra/ folder
# CUDA packages load and run where the compiler links libstdc++ dynamically (see _check_cpp_runtime),
# but the cache must also replay them as CUDA graphs, and that is not yet done (docs/capture.md).
CPU_ONLY = "the capture cache holds CPU graphs only (CUDA packages are not yet replayed as CUDA graphs)"


CPP_RUNTIMES = ("libstdc++.so", "libc++.so")  # a package's code must link one of them dynamically


class ArtifactError(RuntimeError):
    """A package that cannot serve this model and state."""


class StepModule(nn.Module):
    """One step function as a module: the model and the state become its parameters and buffers."""

    def __init__(self, kind: GraphKind, model: CausalLM, state: StaticState) -> None:
        super().__init__()
        self.kind = kind
        self.model = model
        self.state = state

    def forward(self, *inputs: Tensor) -> Any:
        return self.kind.step(self.model, self.state, *inputs)


def constants(model: CausalLM, state: StaticState) -> dict[str, Tensor]:
    """Every tensor a step graph may hold as a constant, by its name inside StepModule (any kind's)."""
    module = StepModule(GraphKind.prefill, model, state)
    named = list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )
    return {name: tensor.detach() for name, tensor in named}


def artifact_key(
    key: GraphKey, model: CausalLM, state: StaticState, inputs: tuple[Tensor, ...], options: dict[str, Any]
) -> dict[str, Any]:
    """Everything that changes a graph's code, as JSON. Not in it: the checkpoint's path and weight
    values. `prefill_chunk` enters through the inputs' shapes."""
    # Through JSON, as the cache stores it: a tuple field (DeepSeek-V4's layer types) reads back a list.
    config = json.loads(json.dumps(asdict(model.cfg)))
    del config["eos_token_ids"]  # stop rules run on the host
    return {
        "kind": key.kind.name,
        "batch": key.batch,
        "depth": key.depth,
        "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in inputs],
        "model_type": model.model_type,
        "model_config": config,
        "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
        "device": state.target_cache.device.type,
        "state": {
            "num_slots": state.num_slots,
            "max_seq_len": state.max_seq_len,
            "max_depth": state.draft_probs.shape[1],
        },
        "constants": _layout_digest(constants(model, state)),
        # Inductor writes the CPU thread count into the code (its loops are split for that many), so
        # a package built by a one-thread process runs on one core in a two-thread one.
        "threads": parallel_num_threads(),
        "inductor": {
            name: value.uuid() if isinstance(value, CustomGraphPass) else repr(value)
            for name, value in sorted(options.items())
        },
        **environment(state.target_cache.device),
    }


def environment(device: torch.device | str) -> dict[str, str]:
    """The key fields that describe this machine and installation rather than the graph."""
    import compiled_mtp  # here, not at module level: the package imports this module while it initializes

    return {
        "target": target_arch(torch.device(device)),
        "torch": torch.__version__,
        "compiled_mtp": compiled_mtp.__version__,
        "source": source_digest(),
    }


@functools.cache
def source_digest() -> str:
    """A digest of the code that is traced into the graphs. The version number alone would let a
    package built before an edit of a step function or the model run after it."""
    package = Path(__file__).resolve().parents[1]
    files = sorted(p for d in SOURCES for p in (package / d).rglob("*.py")) + [Path(__file__).resolve()]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]


def target_arch(device: torch.device) -> str:
    """The instruction set the generated code is built for. On CPU Inductor compiles with
    -march=native, so the exact feature flags matter, not just the capability level."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "cuda (no GPU here)"
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}"
    return f"cpu {torch.backends.cpu.get_cpu_capability()} {_cpu_flags_digest()}"


@functools.cache
def _cpu_flags_digest() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def _layout_digest(tensors: dict[str, Tensor]) -> str:
    """Names, shapes, strides and dtypes of the constants: the code assumes all of them."""
    layout = "|".join(f"{n}:{tuple(t.shape)}:{t.stride()}:{t.dtype}" for n, t in sorted(tensors.items()))
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def build(
    kind: GraphKind,
    model: CausalLM,
    state: StaticState,
    inputs: tuple[Tensor, ...],
    package: Path,
    options: dict[str, Any],
) -> None:
    """Export the step with `inputs` as example step tensors and compile it into `package` (.pt2).

    The live tensors are only traced with fake copies, so building leaves the model and state as they were."""
    ep = export_step(kind, model, state, inputs)
    compile_package(ep, package, options)
    _check_cpp_runtime(package)  # before anything opens it; a package stored has passed
    constant_names = _open(package).get_constant_fqns()
    if any(name.startswith(FOLDED_PREFIX) and folded_value(name) is None for name in constant_names):
        # Inductor's FX graph cache served the code, so the folding pass did not run here, and the
        # values it kept are gone: compile once more without that cache.
        compile_package(ep, package, {**options, "fx_graph_cache": False})
    _store_folded(package, constant_names)
    baked = _used_constants(ep) - set(constant_names) - {weight_of(name) for name in constant_names}
    if baked:
        raise ArtifactError(
            f"{kind.name}: the compiled code holds a copy of {sorted(baked)[0]!r} instead of reading it, so it would "
            "not follow other checkpoints' weights or the runtime's state (a pass folding constants?)"
        )


def export_step(
    kind: GraphKind, model: CausalLM, state: StaticState, inputs: tuple[Tensor, ...]
) -> torch.export.ExportedProgram:
    # strict: Dynamo's trace keeps each node's full source stack, which the fusion pass reads
    return torch.export.export(StepModule(kind, model, state), tuple(inputs), strict=True)


def compile_package(ep: torch.export.ExportedProgram, package: Path, options: dict[str, Any]) -> None:
    """AOTInductor-compile `ep` into `package` with `options` and the settings every artifact needs."""
    with warnings.catch_warnings():  # torch 2.13's packager trips its own pytree deprecation warning
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(package), inductor_configs={**options, **AOT_OPTIONS}
        )


def _store_folded(package: Path, constant_names: list[str]) -> None:
    """Put the folded constants the code reads into the package (it is built without constants)."""
    folded = {name: folded_value(name) for name in constant_names if name.startswith(FOLDED_PREFIX)}
    if not folded:
        return
    buffer = io.BytesIO()
    torch.save(folded, buffer)
    with zipfile.ZipFile(package, "a") as archive:
        archive.writestr(f"{_archive_root(archive)}/extra/{FOLDED_ENTRY}", buffer.getvalue())


def _load_folded(package: Path) -> dict[str, Tensor]:
    with zipfile.ZipFile(package) as archive:
        entry = f"{_archive_root(archive)}/extra/{FOLDED_ENTRY}"
        if entry not in archive.namelist():
            return {}
        folded = torch.load(io.BytesIO(archive.read(entry)), weights_only=True)
    wrong = [name for name, value in folded.items() if folded_name(value) != name]
    if wrong:
        raise ArtifactError(f"folded constant {wrong[0]!r} does not hold the value it was built with")
    return folded


def _archive_root(archive: zipfile.ZipFile) -> str:
    return archive.namelist()[0].split("/", 1)[0]


def _used_constants(ep: torch.export.ExportedProgram) -> set[str]:
    """Names of the parameters and persistent buffers the exported graph reads or writes. A
    non-persistent buffer (the rotary tables) is computed from the config, which is part of the
    graph's key, so code that folded it in (DeepSeek-V4's compressed entries sit at fixed positions)
    stays right."""
    sig = ep.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    computed = set(sig.non_persistent_buffers)
    return {
        names[node.name]
        for node in ep.graph.find_nodes(op="placeholder")
        if node.name in names and node.users and names[node.name] not in computed
    }


def load(package: Path, model: CausalLM, state: StaticState) -> Callable[..., Any]:
    """The packaged graph, reading and writing the live model's and state's tensors (no copies, but
    the bfloat16 ones of weight_copies.py)."""
    runner = _open(package)
    wanted = runner.get_constant_fqns()
    live = {**constants(model, state), **_load_folded(package)}
    copied = {name: weight_of(name) for name in wanted}
    sources = {name: live[source] for name, source in copied.items() if source is not None and source in live}
    try:
        live |= weight_copies.copies_of(model, sources)
    except weight_copies.NotBFloat16 as e:
        raise ArtifactError(str(e)) from None
    unknown = [name for name in wanted if name not in live]
    if unknown:
        raise ArtifactError(f"it needs constant {unknown[0]!r}, which this model and state do not have")
    runner.load_constants({name: live[name] for name in wanted}, check_full_update=True, user_managed=True)
    return _Replay(runner)


class _Replay:
    """A loaded package's call. AOTICompiledModel parses its call spec and flattens the inputs on
    every call, about 15 us of a 100 us draft graph; a step's inputs are already a flat tuple of
    tensors, so only the outputs' structure is kept, parsed once. The step graphs return one output or
    a tuple of tensors, which need no walk of that structure: the Python between a step's graphs runs
    on caches the graph has just emptied, where every call it makes costs microseconds."""

    def __init__(self, runner: AOTICompiledModel) -> None:
        self._run = runner.loader.boxed_run
        spec = pytree.treespec_loads(runner.loader.get_call_spec()[1])
        self._rebuild: Callable[[list[Tensor]], Any] = functools.partial(pytree.tree_unflatten, treespec=spec)
        if spec.is_leaf():  # one output (a step returning None has one too)
            self._rebuild = operator.itemgetter(0)
        elif spec.type is tuple and all(child.is_leaf() for child in spec.children()):
            self._rebuild = tuple

    def __call__(self, *inputs: Tensor) -> Any:
        return self._rebuild(self._run(list(inputs)))


def _open(package: Path) -> AOTICompiledModel:
    """What torch._inductor.aoti_load_package does, minus its device check: that one compiles and runs
    test programs to find the CPU's vector ISA (about 1 s on a process's first load) only to log a
    warning, and the key's "target" field already pins the ISA."""
    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1))


def _check_cpp_runtime(package: Path) -> None:
    """Refuse a package whose code carries a C++ runtime of its own.

    A compiler that links libstdc++ statically (`-static-libstdc++`, or a GCC built to do so) puts a
    second copy of the C++ runtime beside the one torch runs on. The loader's first act in the package
    is to parse the device name with std::regex, whose locale facets the two copies then mix up:
    std::bad_cast, or a segmentation fault that kills the process (docs/capture.md)."""
    with zipfile.ZipFile(package) as archive:
        objects = [archive.read(n) for n in archive.namelist() if n.endswith(".so")]
    for data in objects:
        if elf.is_elf64(data) and not any(lib.startswith(CPP_RUNTIMES) for lib in elf.needed(data)):
            raise ArtifactError(
                f"cache_dir: the C++ compiler Inductor uses ({cpp_builder.get_cpp_compiler()}) links libstdc++ "
                "into each package, and loading such a package beside torch's own libstdc++ fails or "
                "crashes the process; set CXX to a compiler that links it dynamically, such as the "
                "system's g++, or leave cache_dir unset"
            )
