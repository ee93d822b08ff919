"""Does one checkpoint decode faster than another of the same shapes? Both in one process, in turns.

Two runtimes load checkpoints A and B from one capture cache (a key holds the weights' layout, not
their values, so the same graphs serve both) and decode the same held-out prompts (A's tokenizer), 64
new tokens each, `--batch` at a time at depth --depth. A and B take turns at every batch, the order
flipped from round to round, so both meet the machine's speed at the same moments. Printed per round:
ms per decoded token, tokens per decode step and ms per step of each, and B's ms per token over A's;
then that ratio's median and range. A retrained MTP layer moves the tokens a step at the same step
cost; a change of shapes or dtypes is another build, for graph_ab.py.

    python benchmarks/bench_checkpoints.py OLD_DIR compiled_mtp/default_model [--depth 3] [--batch 1] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.bench import bench_prompts

PARAMS = SamplingParams(max_new_tokens=64, ignore_eos=True)


def decode(rt: Runtime, prompts: list[list[int]]) -> tuple[float, int, int]:
    """Seconds, tokens and decode steps of one batch's generation after its prefill step."""
    for prompt in prompts:
        rt.add_request(prompt, PARAMS)
    rt.step()  # the prefills
    steps, tokens, start = 0, 0, time.perf_counter()
    while rt.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in rt.step())
        steps += 1
    return time.perf_counter() - start, tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="checkpoint directory; ratios are against it")
    parser.add_argument("b", type=Path, help="checkpoint directory of the same shapes")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--draft-vocab", type=int, default=1024, help="0: every token")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/compiled_mtp_checkpoints"))
    args = parser.parse_args()

    runtimes = {
        name: Runtime.from_pretrained(
            path,
            mtp_depth=args.depth,
            batch_sizes=(args.batch,),
            max_seq_len=256,
            cache_dir=args.cache_dir,
            draft_vocab=args.draft_vocab or None,
        )
        for name, path in (("A", args.a), ("B", args.b))
    }
    prompts = bench_prompts(args.a, 0, args.prompts, 64).token_ids
    for rt in runtimes.values():
        rt.generate(prompts[: args.batch], PARAMS)  # untimed: the graphs' first calls
    ratios = []
    for r in range(args.rounds):
        totals = {name: [0.0, 0, 0] for name in runtimes}
        order = list(runtimes) if r % 2 == 0 else list(reversed(runtimes))
        for first in range(0, len(prompts), args.batch):
            for name in order:
                run = decode(runtimes[name], prompts[first : first + args.batch])
                totals[name] = [t + x for t, x in zip(totals[name], run)]
        per_token = {name: 1e3 * s / tokens for name, (s, tokens, _) in totals.items()}
        ratios.append(per_token["B"] / per_token["A"])
        line = "  ".join(
            f"{name} {per_token[name]:.3f} ms/token ({tokens / steps:.2f} tokens/step, {1e3 * s / steps:.2f} ms/step)"
            for name, (s, tokens, steps) in totals.items()
        )
        print(f"round {r + 1}: {line}  B/A {ratios[-1]:.3f}", flush=True)
    print(
        f"\nB/A ms per decoded token at K={args.depth}, B={args.batch}: median {statistics.median(ratios):.3f}"
        f" ({min(ratios):.3f}-{max(ratios):.3f} over {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
