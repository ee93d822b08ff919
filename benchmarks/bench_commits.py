"""Is a commit slower than another? The same decode, on each commit's own code, timed in turns.

Each REV is checked out in a git worktree of its own (under --work), and one process per REV and
round imports the engine from there (PYTHONPATH), loads its graphs from a capture cache of its own
(built by a first, untimed round), and times the decode steps of `--prompts` held-out prompts of 64
tokens, 64 new tokens each, `--batch` at a time (default 1) at depth --depth (or "auto", on commits
that have it) on the shipped model of that commit. The REVs take turns within every round, so a
change in the machine's memory speed meets them all; a REV's figure is its best round's fastest
generation, in ms per decode step or, with --per-token, per token decoded (what "auto" changes: its
steps commit different numbers of tokens), beside its median round, and the Python a decode step runs
outside its graphs (stats()["host_seconds_per_step"], where the commit has it) in its median round.
`--bfloat16-mlps` turns on the bfloat16 MLP products in every process (on commits that have them).

    python benchmarks/bench_commits.py HEAD~1 HEAD [--depth 3] [--batch 1] [--rounds 3] [--draft-vocab 1024]
    python benchmarks/bench_commits.py HEAD~1 HEAD --depth auto --per-token --batch 4 --rounds 10
    python benchmarks/bench_commits.py HEAD~1 HEAD --depth 1 --batch 4 --bfloat16-mlps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from compiled_mtp.depth_policy import depth_arg

# Run inside the child process, against the commit's own package: only API every commit since the
# capture cache and held-out prompts (November 2026) has. The decode loop is this checkout's
# (bench_checkpoints.py, on the path after the commit's package), the same for every commit.
CHILD = """
import json, sys
from compiled_mtp import DEFAULT_MODEL, Runtime
from compiled_mtp.bench import bench_prompts
depth, cache, prompts, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) or None
batch, per_token = int(sys.argv[5]), sys.argv[6] == "1"
sys.path.append(sys.argv[7])
if sys.argv[8] == "1":
    from compiled_mtp.ops.library import bfloat16_products
    bfloat16_products(True)
from bench_checkpoints import PARAMS, decode
depth = depth if depth == "auto" else int(depth)
rt = Runtime.from_pretrained(
    DEFAULT_MODEL, mtp_depth=depth, batch_sizes=(batch,), max_seq_len=256, cache_dir=cache, draft_vocab=vocab
)
prompts = bench_prompts(DEFAULT_MODEL, 0, prompts, 64).token_ids
rt.generate(prompts[:batch], PARAMS)
getattr(rt, "reset_stats", lambda: None)()
step_ms = []
for first in range(0, len(prompts), batch):
    seconds, tokens, steps = decode(rt, prompts[first : first + batch])
    step_ms.append(1e3 * seconds / (tokens if per_token else steps))
print(json.dumps([step_ms, 1e6 * rt.stats().get("host_seconds_per_step", float("nan"))]))
"""


def checkout(rev: str, work: Path) -> Path:
    """A detached worktree of `rev` under `work` (made once)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True)
    tree = work / sha.stdout.strip()
    if not tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
        )
    return tree


def run_child(tree: Path, child: str, argv: list[str]) -> Any:
    """The last line `child` prints, parsed as JSON, from a process that imports `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", child, *argv], env=env, capture_output=True, text=True, cwd=tree, check=False
    )
    if out.returncode:
        raise SystemExit(f"error: {tree.name}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(tree: Path, args: argparse.Namespace) -> tuple[list[float], float]:
    """Milliseconds per decode step (or decoded token) of each batch's generation, on `tree`'s code,
    and the microseconds of Python per decode step outside its graphs (nan on commits without
    stats()["host_seconds_per_step"])."""
    argv = [
        str(args.depth),
        str(tree / ".capture"),
        str(args.prompts),
        str(args.draft_vocab),
        str(args.batch),
        str(int(args.per_token)),
        str(Path(__file__).resolve().parent),
        str(int(args.bfloat16_mlps)),
    ]
    return run_child(tree, CHILD, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="commits to compare; ratios are against the first")
    parser.add_argument("--depth", type=depth_arg, default=3, help='an MTP depth or "auto" (default: 3)')
    parser.add_argument(
        "--per-token", action="store_true", help="ms per decoded token, not per decode step (for auto)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded at once (default: 1)")
    parser.add_argument("--draft-vocab", type=int, default=1024, help="0: every token")
    parser.add_argument("--work", type=Path, default=Path("/tmp/compiled_mtp_commits"))
    parser.add_argument("--bfloat16-mlps", action="store_true", help="the MLPs' products in bfloat16")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {rev: checkout(rev, args.work) for rev in args.revs}
    for rev, tree in trees.items():
        start = time.perf_counter()
        run(tree, args)  # builds the graphs into the tree's own cache
        print(f"{rev} ({tree.name}): ready in {time.perf_counter() - start:.0f} s", flush=True)
    best: dict[str, list[float]] = {rev: [] for rev in trees}
    host: dict[str, list[float]] = {rev: [] for rev in trees}
    for r in range(args.rounds):
        for rev, tree in trees.items():
            step_ms, host_us = run(tree, args)
            best[rev].append(min(step_ms))
            host[rev].append(host_us)
        print(f"round {r + 1}: " + "  ".join(f"{rev} {best[rev][-1]:.3f}" for rev in trees), flush=True)
    base = min(best[args.revs[0]])
    unit = "decoded token" if args.per_token else "decode step"
    print(
        f"\nms per {unit} at K={args.depth}, B={args.batch} (best of {args.rounds} rounds; median round),"
        " and us of Python per decode step outside its graphs (median round)"
    )
    for rev in trees:
        print(
            f"  {rev:<12} {min(best[rev]):7.3f}  ({statistics.median(best[rev]):.3f})"
            f"  {min(best[rev]) / base:5.2f}x the first   host {statistics.median(host[rev]):6.1f} us"
        )


if __name__ == "__main__":
    main()
