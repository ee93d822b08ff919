"""The same graphs with AMX's tile products on and off, in turns in one process: ms per call of each.

A runtime of the shipped model (graphs from the capture cache, `--cache-dir`) generates `--batch`
held-out prompts at each depth, once with the C++ ops' products of 8-16 rows on AMX's tiles and once
on the vector path (`compiled_mtp::panel_amx`), the order of the two swapped every round, so that
both meet the machine at about the same moments. Printed per graph of the batch's bucket: the best
round's median call of each, and the tiles' median over the vector path's per round (median and range).
On a CPU without AMX both runs take the vector path, and it says so.

    python benchmarks/tile_ab.py [--batch 4] [--depths 0 1 2 3] [--rounds 8] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from graph_times import timed_runtime, timed_work, timing_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="prompts generated at once (default: 4)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3], help="default: 0 1 2 3")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (default: 8)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="capture cache (default: the user's)")
    args = parser.parse_args()
    rt = timed_runtime(0, args.batch, None, args.cache_dir)
    prompts, params = timed_work(rt, args.batch, 64)
    rows = torch.ops.compiled_mtp.panel_amx(True)
    if not rows:
        print("no AMX here: both runs take the vector path")
    calls = timing_calls()
    medians: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for round_ in range(args.rounds + 1):  # the first warms both up
        for depth in args.depths:
            rt.mtp_depth = depth
            for tiles in (True, False) if round_ % 2 else (False, True):
                torch.ops.compiled_mtp.panel_amx(tiles)
                calls.clear()
                rt.generate(prompts, params)
                for name, seconds in calls.items():
                    if round_ and f"/B{args.batch}/" in name:
                        medians[name, tiles].append(1e3 * statistics.median(seconds))
    torch.ops.compiled_mtp.panel_amx(True)
    print(
        f"B={args.batch}, tiles from {rows} rows; ms per call, best round's median; tiles over vector per round"
    )
    for name in sorted({name for name, _ in medians}):
        on, off = medians[name, True], medians[name, False]
        ratios = [a / b for a, b in zip(on, off)]
        print(
            f"  {name:<24} tiles {min(on):7.3f}  vector {min(off):7.3f}  "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
