"""compiled_mtp::live_attention on two or more commits' kernels: microseconds a call, timed in turns.

Each REV's kernel is the op library built from that commit's sources (a worktree under --work, as
bench_commits.py makes); one process per REV and round times the op on the shipped model's latent
attention shapes (4 heads, rank 64, rope 16, 32 key and 32 value columns a head in kv_b_proj, read
from a bfloat16 copy as the bfloat16_reads pass hands it, a 512-entry cache) for `--batch` requests
(default 1) of 1 row (K=0), 2 rows (a K=1 verify: 8 query rows) and 4 rows (K=3: 16 query rows)
each, at several live lengths. The REVs take turns within every round, so a change in the machine's
speed meets them all. Printed per shape: each REV's best round, and its time over the first REV's
per round, median (range).

    python benchmarks/bench_attention.py HEAD~1 HEAD [--rounds 5] [--threads 2] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench_commits import checkout, run_child

# Run inside the child process, against the commit's own ops: their schema is the same on every commit
# since the op took the absorbed products (q_nope and kv_b_proj's weight).
CHILD = """
import json, sys, time, statistics, torch
from compiled_mtp.ops import library
library.load()
torch.set_num_threads(int(sys.argv[1]))
batch = int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
heads, rank, rope, dn, dv, capacity = 4, 64, 16, 32, 32, 512
cache = torch.randn(batch + 1, capacity, rank + rope, generator=gen)
kv_b = torch.randn(heads * (dn + dv), rank, generator=gen).bfloat16()
op, out = torch.ops.compiled_mtp.live_attention, {}
for steps in (1, 2, 4):
    for live in (64, 128, 256, 512):
        qn = torch.randn(batch, steps, heads, dn, generator=gen)
        qp = torch.randn(batch, steps, heads, rope, generator=gen)
        visible = torch.zeros(batch, steps, capacity, dtype=torch.bool)
        visible[..., :live] = True
        args = (qn, qp, kv_b, cache, torch.arange(1, batch + 1), visible, 0.1)
        for _ in range(100):
            op(*args)
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for _ in range(200):
                op(*args)
            times.append((time.perf_counter() - start) / 200 * 1e6)
        out[f"{steps} rows, {live} live"] = statistics.median(times)
print(json.dumps(out))
"""


def run(tree: Path, threads: int, batch: int) -> dict[str, float]:
    """Microseconds a call per shape, on `tree`'s kernel."""
    return run_child(tree, CHILD, [str(threads), str(batch)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="commits to compare; ratios are against the first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="requests in the call, each with its own slot")
    parser.add_argument("--work", type=Path, default=Path("/tmp/compiled_mtp_commits"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {rev: checkout(rev, args.work) for rev in args.revs}
    rounds: dict[str, list[dict[str, float]]] = {rev: [] for rev in trees}
    for _ in range(args.rounds + 1):  # the first builds each commit's library, untimed
        for rev, tree in trees.items():
            rounds[rev].append(run(tree, args.threads, args.batch))
    first = args.revs[0]
    print(
        f"live_attention, us a call ({args.batch} request(s), {args.threads} threads;"
        f" best of {args.rounds} rounds; over {first} per round)"
    )
    for shape in rounds[first][0]:
        cells = []
        for rev in trees:
            times = [r[shape] for r in rounds[rev][1:]]
            ratios = [t / r[shape] for t, r in zip(times, rounds[first][1:])]
            spread = f"({min(ratios):.2f}-{max(ratios):.2f})"
            cells.append(f"{rev} {min(times):6.2f} {statistics.median(ratios):.2f}x {spread}")
        print(f"  {shape:<18}" + "   ".join(cells))


if __name__ == "__main__":
    main()
