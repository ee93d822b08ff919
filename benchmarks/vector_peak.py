"""The CPU's own ceiling on arithmetic: how many AVX-512 multiply-adds a core retires a cycle.

The bench's roofline takes its rate from products that torch and the C++ ops reach (`torch.mm`, a
16-row dense MLP on weights in cache), which the hardware may exceed. This script asks the hardware:
a loop of independent instructions on registers only (vector_peak.cpp, compiled here with g++), timed
on one thread and on `--threads` threads at once:
- the clock, from a chain of dependent integer adds (one a cycle);
- `vfmadd231ps` (float32, 16 lanes) and `vdpbf16ps` (bfloat16 pairs into float32, 16 lanes), 24
  sums each, so that no instruction waits on the one before;
- the 8-row step of the C++ products on bfloat16 panels (ops/csrc/panel_linear.cpp): 3 panel vectors
  loaded, 8 inputs broadcast from memory, 24 dot products, everything in the first-level cache, in
  cycles a step: what the loop costs where the weights never wait on memory.

    python benchmarks/vector_peak.py [--threads 2] [--seconds 0.5]

Needs g++ with AVX-512 bfloat16 support and a CPU that has it.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".cpp")


def build(folder: Path) -> ctypes.CDLL:
    library = folder / "vector_peak.so"
    flags = ["-O2", "-march=native", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
    subprocess.run(["g++", *flags, str(SOURCE), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    for name, args in (
        ("clock_hz", [ctypes.c_long]),
        ("per_thread", [ctypes.c_int, ctypes.c_long, ctypes.c_int]),
        ("block_steps", [ctypes.c_long]),
    ):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_double
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads at once (default: 2)")
    parser.add_argument(
        "--seconds", type=float, default=0.5, help="about how long each loop runs (default: 0.5)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        lib = build(Path(folder))
        hz = max(lib.clock_hz(int(args.seconds * 1e9 / 4)) for _ in range(3))
        iters = int(args.seconds * hz / 24)
        print(f"clock {hz / 1e9:.2f} GHz (dependent adds)")
        for kind, name, flops in ((0, "vfmadd231ps (float32)", 32), (1, "vdpbf16ps (bfloat16 pairs)", 64)):
            for threads in (1, args.threads):
                rate = max(lib.per_thread(kind, iters, threads) for _ in range(3))
                print(
                    f"{name:<28} {threads} thread(s): {rate / hz:.2f} a cycle a thread, "
                    f"{rate * threads * flops / 1e9:.0f} GFLOP/s in all"
                )
        steps = max(lib.block_steps(iters) for _ in range(3))
        print(
            f"8-row step of the bfloat16 panel products (24 dot products), operands in L1: {hz / steps:.1f} cycles"
        )


if __name__ == "__main__":
    main()
