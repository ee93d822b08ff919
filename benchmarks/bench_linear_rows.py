"""The linears of a verify of a few rows, each op that could run them, cold, in turns.

`compiled_mtp::panel_linear` (what panel_linear puts in a graph for 5-16 rows, and narrow_linear for
weights of 2^18+ elements on 2-4 rows), `F.linear` (MKL's GEMM, what Inductor calls for the small
weights) and the packed oneDNN `compiled_mtp::linear` (what packed_linear puts in for the large
ones).

The default model's attention projections (q_a, q_b, kv_a and o of its 12 layers: 48 weights) run
one after the other, and its 4096 x 256 LM head alone; before each pass a 40 MB write evicts them
from the last-level cache, so they are read cold as in a verify. The ops take turns, round after
round, so a drift in memory speed meets them all. Each call here also pays Python's dispatch,
which the captured graphs do not.

    python benchmarks/bench_linear_rows.py [--rows 8 12 16] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from compiled_mtp import DEFAULT_MODEL
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.ops import library, packed_linear

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forms(rows: int) -> dict[str, Linear]:
    return {
        "panel_linear": torch.ops.compiled_mtp.panel_linear,
        "F.linear (MKL)": F.linear,
        "oneDNN packed": lambda x, w: torch.ops.compiled_mtp.linear(x, w, None),
    }


def cold_us(weights: list[torch.Tensor], rows: int, rounds: int) -> dict[str, float]:
    """Median microseconds of one pass over `weights` for each form, each pass after an eviction."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    evict = torch.ones(10 * 2**20)
    times: dict[str, list[float]] = {name: [] for name in forms(rows)}
    for _ in range(rounds):
        for name, linear in forms(rows).items():
            evict.add_(1.0)
            start = time.perf_counter()
            for w in weights:
                linear(inputs[w.shape[1]], w)
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 12, 16], help="rows (default: 8 12 16)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of turns (default: 15)")
    args = parser.parse_args()
    library.load()
    model = load_model(DEFAULT_MODEL)
    packed_linear.pack_linears(model)
    layers = model.cfg.num_hidden_layers  # the target's; M's layer does not run in a verify
    names = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")  # kv_b_proj goes through bmm
    attention, head = [], []
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) < layers and parts[-2] in names:
            attention.append(param.detach())
        elif name == "lm_head.weight":
            head.append(param.detach())
    for rows in args.rows:
        for label, weights in ((f"{len(attention)} attention projections", attention), ("LM head", head)):
            for w in weights:  # first calls: the panel copies, the libraries' set-up
                x = torch.ones(rows, w.shape[1])
                for linear in forms(rows).values():
                    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-3)
            us = cold_us(weights, rows, args.rounds)
            base = us["F.linear (MKL)"]
            cells = ", ".join(f"{name} {t:.0f} us ({t / base:.2f}x)" for name, t in us.items())
            print(f"{rows:2d} rows, {label}, cold, median of {args.rounds}: {cells}")


if __name__ == "__main__":
    main()
