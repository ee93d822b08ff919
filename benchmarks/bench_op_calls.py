"""What calling a C++ op costs inside an AOTInductor package: the op as registered now (a C++ kernel
behind a TORCH_LIBRARY schema, called by the package's proxy executor without Python) against the
form the ops had before (a Python function registered as the op's kernel, which then called the C++
code), on the same kernel and the same work, timed in turns.

A graph of `--calls` few-row linears on small weights (so the kernel's own work is small) is compiled
twice with AOTInductor: once calling `compiled_mtp::panel_linear`, once a Python-registered op
that calls it. Each graph's time per call, less a graph without the calls, is the per-call cost.
One thread, so that OpenMP's barriers do not enter the figure.

    python benchmarks/bench_op_calls.py [--calls 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from compiled_mtp.ops import library

torch.library.define("bench_op_calls::panel_linear_from_python", "(Tensor x, Tensor weight) -> Tensor")


@torch.library.impl("bench_op_calls::panel_linear_from_python", "CompositeExplicitAutograd")
def _from_python(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.compiled_mtp.panel_linear.default(x, weight)


@torch.library.register_fake("bench_op_calls::panel_linear_from_python")
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Chain(torch.nn.Module):
    """x through `calls` linears of 16 x 16 weights, by `op` (None: the graph without the calls)."""

    def __init__(self, calls: int, op) -> None:
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(calls, 16, 16) / 4, requires_grad=False)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        for w in self.weights:
            x = torch.tanh(self.op(x, w) if self.op is not None else x + w[0])
        return x


def package(model: torch.nn.Module, x: Tensor, folder: Path, name: str):
    ep = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(folder / f"{name}.pt2"))
    return torch._inductor.aoti_load_package(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    if not library.load():
        raise SystemExit("error: the C++ ops did not build")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    forms = {
        "C++ op (TORCH_LIBRARY)": torch.ops.compiled_mtp.panel_linear.default,
        "Python kernel calling C++": torch.ops.bench_op_calls.panel_linear_from_python.default,
        "no call": None,
    }
    with tempfile.TemporaryDirectory() as folder:
        runners = {
            name: package(Chain(args.calls, op), x, Path(folder), f"form{i}")
            for i, (name, op) in enumerate(forms.items())
        }
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, run in runners.items():
                run(x)
                start = time.perf_counter()
                for _ in range(args.iterations):
                    run(x)
                times[name].append((time.perf_counter() - start) / args.iterations)
    base = statistics.median(times["no call"])
    print(
        f"AOTInductor package, {args.calls} calls of a 4 x 16 by 16 "
        f"x 16 linear, 1 thread, median of {args.rounds} rounds:"
    )
    for name, t in times.items():
        if name != "no call":
            per_call = [1e6 * (s - base) / args.calls for s in t]
            print(
                f"  {name:28s} {statistics.median(per_call):6.2f} us a "
                f"call (rounds {min(per_call):.2f}-{max(per_call):.2f})"
            )


if __name__ == "__main__":
    main()
