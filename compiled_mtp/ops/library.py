"""Builds the C++ ops in csrc/ into one library and loads it, which registers them with their schemas
(`torch.ops.compiled_mtp.*`, CPU kernels and Meta shape functions).

The build uses torch's extension tooling with the vector ISA and flags Inductor picks for its own
generated kernels, in Inductor's cache directory: the library compiles once per machine and source
version, and later processes only load it. Where it does not build (no compiler, say), the passes
that would call its ops leave their regions as traced, after one warning: the engine stays correct,
only slower.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import os
import sys
import warnings
import weakref
from pathlib import Path

import torch

from compiled_mtp.file_lock import exclusive

CSRC = Path(__file__).parent / "csrc"
_SETTLED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose graphs may exist


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def version() -> str:
    """A hash of every source and header: part of the passes' uuid, and of the library's name, so a
    changed kernel never meets a library or a captured graph built from the old one."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _flags() -> list[str]:
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    macros = [f"-D{m}" for m in isa.build_macro()] if isa else []
    arch = isa.build_arch_flags().split() if isa else []
    # A build for tests only: AMX's tile path on a model of the tile instructions (csrc/amx_tiles.h),
    # on machines without AMX, in a build folder of its own (the flags name it).
    model = ["-DCOMPILED_MTP_AMX_MODEL"] if os.environ.get("COMPILED_MTP_AMX_MODEL") == "1" else []
    return ["-O3", "-fopenmp", "-ffp-contract=off", *macros, *arch, *model]


def build_dir() -> Path:
    """Where this source version builds with this compiler and these flags, under Inductor's cache
    directory. A process run with another compiler (torch's tooling reads `CXX`) or vector ISA builds
    into a folder of its own: in the same folder its build would replace the library that every
    other process loads."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.utils.cpp_extension import get_cxx_compiler

    toolchain = hashlib.sha256(" ".join([get_cxx_compiler(), *_flags()]).encode()).hexdigest()[:8]
    return Path(cache_dir()) / "compiled_mtp_ops" / f"compiled_mtp_ops_{version()}_{toolchain}"


@functools.cache
def load() -> bool:
    """Build (the first time on this machine) and load the ops; False, after a warning, where they do
    not build."""
    from torch.utils import cpp_extension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    build = build_dir()
    try:
        # torch's own build lock is a plain file, which a process killed mid-build leaves behind for
        # every later load to wait on forever; builders take turns under a lock the system drops with
        # its holder, so whoever holds it knows no build is running and removes torch's.
        with exclusive(build / "build.flock"):
            (build / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=build.name,
                sources=[str(p) for p in sources()],
                extra_cflags=_flags(),
                build_directory=str(build),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        warnings.warn(
            f"compiled_mtp: the C++ ops did not build ({lines[0]}); their regions stay as traced",
            stacklevel=2,
        )
        return False
    return True


def serves(model: torch.nn.Module) -> bool:
    """Whether `model` runs on CPU in float32, the only calls the C++ kernels take: the library is
    built before the first step only then."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def read_bytes(weight: torch.Tensor) -> int:
    """Bytes a step reads for `weight`: those of its panels where a C++ op has read it from panels
    (half its own for a weight of bfloat16 values, see csrc/panels.h), else its own."""
    on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    panels = torch.ops.compiled_mtp.panel_bytes(weight) if on_cpu and load() else 0
    return panels or weight.nbytes


def huge_page_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a weight that every step reads whole: on 2 MiB pages, beside other
    such weights, where the library loads (csrc/huge_pages.h), else a plain one."""
    if not load():
        return torch.empty(shape, dtype=dtype)
    nbytes = shape.numel() * dtype.itemsize
    return torch.ops.compiled_mtp.huge_page_bytes(nbytes).view(dtype).view(shape)


def settle(model: torch.nn.Module, move: bool) -> None:
    """Called before a model's first graphs are built or loaded, which hold its tensors' addresses from
    then on (capture/aot.py): where `move`, its weights and buffers move onto 2 MiB pages first
    (csrc/huge_pages.h), in place; never later."""
    if model in _SETTLED:
        return
    _SETTLED.add(model)
    if move:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            torch.ops.compiled_mtp.move_to_huge_pages(tensor)


def add_bfloat16_option(parser: argparse.ArgumentParser) -> None:
    """The command-line switch for bfloat16_products (main applies it)."""
    parser.add_argument(
        "--bfloat16-mlps",
        action="store_true",
        help="let the dense MLPs multiply activations rounded to bfloat16 where the CPU has "
        "AVX512-BF16, adding in float32 (default: float32 products)",
    )


def apply_bfloat16_option(args: argparse.Namespace) -> None:
    """--bfloat16-mlps, where the command takes and was given it."""
    if getattr(args, "bfloat16_mlps", False) and not bfloat16_products(True):
        print(
            "compiled_mtp: --bfloat16-mlps: this CPU or build has no AVX512-BF16; the MLPs stay float32",
            file=sys.stderr,
        )


def bfloat16_products(enabled: bool | None = None) -> bool:
    """Whether the dense MLPs multiply in bfloat16, for the whole process: their rows and activation
    rounded to bfloat16, the products added in float32 (csrc/panels.h). Given `enabled`, turns that on
    (only where the library loads and the CPU has AVX512-BF16) or off first. The ops read it at each
    call, so the same graphs serve both."""
    return load() and torch.ops.compiled_mtp.bfloat16_products(enabled)
