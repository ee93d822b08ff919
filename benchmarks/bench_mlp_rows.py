"""Why a verify of 4 rows costs more than a decode step of 1 on this CPU: a dense MLP's time at 1 to
16 rows, against its weight bytes and its arithmetic.

`compiled_mtp::dense_mlp` (the op fuse_dense_mlp puts in a verify graph) runs the default model's
MLP shape (hidden 256, intermediate 1792) over `--layers` distinct weight sets in turn, so the
weights are read from memory and the last-level cache as in a model's forward ("cold"), and over one
set ("hot": the weights stay in cache). Beside each time: what streaming the weights at the
measured copy bandwidth would take, and what the multiply-adds would take at the fp32 rate a large
`torch.mm` reaches on the same threads. At 1 row the bytes set the pace; at 4 the multiply-adds
come close to them, which a bound counting bytes alone does not see; from 8 (a batch of 4 verifying
drafts) they set it.

    python benchmarks/bench_mlp_rows.py [--hidden 256] [--inter 1792] [--layers 11] [--rounds 5]
                                        [--rows 1 4 8 16] [--values bfloat16] [--bfloat16-mlps]
                                        [--against REV]

The weights hold bfloat16 values by default, as a bfloat16 checkpoint's (the shipped model's) do once
upcast: the op reads them from bfloat16 panels, half the bytes (ops/csrc/panels.h); `--values
float32` times float32 panels. `--bfloat16-mlps` rounds the rows to bfloat16 and multiplies them on the
bfloat16 dot products (`library.bfloat16_products`), in both kernels where `--against` builds a second.

With `--against REV` the ops of git revision REV are built beside this checkout's (in a namespace of
their own) and both dense_mlp kernels run in turns, round after round, cold and then hot, so a drift
in memory speed meets both.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from compiled_mtp.ops import library


def best_us(fn, reps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def copy_gbs(rounds: int) -> float:
    src = torch.ones(64 * 2**18)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_us(lambda: dst.copy_(src), 1, rounds) / 1e3


def mm_gflops(rounds: int) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / best_us(lambda: torch.mm(a, b), 3, rounds) / 1e3


def mlp_us(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], rounds: int) -> tuple[float, float]:
    """Microseconds of one dense_mlp call on x: each weight set in turn (cold), and the first alone (hot)."""
    mlp = torch.ops.compiled_mtp.dense_mlp

    def cold() -> None:
        for g, u, d in weights:
            mlp(x, g, u, d)

    return best_us(cold, 50, rounds) / len(weights), best_us(lambda: mlp(x, *weights[0]), 200, rounds)


def op_at(rev: str):
    """dense_mlp as revision `rev` wrote it: all of its C++ ops, built in a namespace of their own
    (torch.ops.compiled_mtp_at_rev), so that nothing clashes with this checkout's library."""
    folder = Path(tempfile.mkdtemp(prefix="mlp_rev_"))
    csrc = "compiled_mtp/ops/csrc"
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{csrc}"], capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{rev}:{csrc}/{name}"], capture_output=True, text=True, check=True
        )
        # The library's and the namespace's name; schema names looked up at run time ("compiled_mtp::x") stay.
        (folder / name).write_text(re.sub(r"\bcompiled_mtp\b(?!::)", "compiled_mtp_at_rev", text.stdout))
    cpp_extension.load(
        name=f"mlp_at_{rev.replace('~', '_').replace('^', '_')}",
        sources=[str(folder / name) for name in names if name.endswith(".cpp")],
        extra_cflags=library._flags(),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(folder)],
        build_directory=str(folder),
        is_python_module=False,
    )
    torch.ops.compiled_mtp_at_rev.bfloat16_products(library.bfloat16_products())
    return torch.ops.compiled_mtp_at_rev.dense_mlp


def in_turns(ops: dict, x: torch.Tensor, weights: list, rounds: int) -> dict[str, float]:
    """Median over rounds of each op's microseconds per MLP over `weights` in turn, the ops taking turns
    every round."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            start = time.perf_counter()
            for g, u, d in weights:
                op(x, g, u, d)
            times[name].append((time.perf_counter() - start) / len(weights) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=1792)
    parser.add_argument("--layers", type=int, default=11, help="distinct weight sets read in turn (cold)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="row counts timed")
    parser.add_argument("--against", metavar="REV", help="also time revision REV's kernel, in turns")
    parser.add_argument(
        "--values",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the weights' values: bfloat16 ones, upcast, or any float32 (default: bfloat16)",
    )
    library.add_bfloat16_option(parser)
    args = parser.parse_args()
    if not library.load():
        raise SystemExit("error: the C++ ops did not build on this machine")
    library.apply_bfloat16_option(args)
    h, inter = args.hidden, args.inter
    values = torch.bfloat16 if args.values == "bfloat16" else torch.float32
    weights = [
        tuple(torch.randn(shape).to(values).float() for shape in ((inter, h), (inter, h), (h, inter)))
        for _ in range(args.layers)
    ]
    nbytes = 3 * h * inter * values.itemsize
    bandwidth, flops = copy_gbs(args.rounds), mm_gflops(args.rounds)
    print(
        f"{torch.get_num_threads()} threads; copy bandwidth {bandwidth:.1f} GB/s, torch.mm {flops:.0f} GFLOP/s; "
        f"one MLP: {nbytes / 1e6:.2f} MB, {nbytes / bandwidth / 1e3:.1f} us at copy bandwidth"
    )
    times = {}
    for rows in args.rows:
        times[rows] = mlp_us(torch.randn(rows, h), weights, args.rounds)
        arithmetic = 2 * rows * 3 * h * inter / flops / 1e3
        print(
            f"{rows} row(s): {times[rows][0]:6.1f} us cold, {times[rows][1]:6.1f} us hot; "
            f"multiply-adds at the torch.mm rate {arithmetic:5.1f} us"
        )
    first = args.rows[0]
    for rows in args.rows[1:]:
        print(
            f"{rows} rows over {first}: {times[rows][0] / times[first][0]:.2f}x cold, "
            f"{times[rows][1] / times[first][1]:.2f}x hot"
        )
    if args.against:
        ops = {"this": torch.ops.compiled_mtp.dense_mlp, args.against: op_at(args.against)}
        for name, sets in (("cold", weights), ("hot", weights[:1] * len(weights))):
            print(f"{name}, in turns, median of {args.rounds * 3} rounds (us per MLP):")
            for rows in args.rows:
                t = in_turns(ops, torch.randn(rows, h), sets, args.rounds * 3)
                print(
                    f"  {rows:2d} row(s): this {t['this']:6.1f}, {args.against} {t[args.against]:6.1f}: "
                    f"{t['this'] / t[args.against]:.3f}x"
                )


if __name__ == "__main__":
    main()
