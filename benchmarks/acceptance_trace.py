"""The drafts a K=D step accepts from every position of the bench's held-out generations.

    python benchmarks/acceptance_trace.py [--depth 6] [--prompts 24] [--new-tokens 64]
        [--out benchmarks/acceptance-trace.json]

The shipped model, drafting among its 1024 most frequent tokens as the bench does, generates
`--new-tokens` tokens greedily from each of the bench's first `--prompts` held-out prompts. Then, for
every g = 1 .. new_tokens - 1, a request whose prompt is the prompt and the first g - 1 generated tokens
is prefilled (which emits token g) and runs one decode step at K=D (`--depth`); the drafts it accepted
are a[g]. Greedy drafts depend only on the text before them, and a prefill leaves the MTP layer where
decoding does (tests/test_engine.py, test_a_step_accepts_what_its_text_accepts_at_any_depth), so a step
at depth K <= D taken with g tokens generated accepts min(K, a[g]) drafts whatever ran before it: any
depth schedule can be replayed from the trace (`benchmarks/auto_simulate.py --trace`), with the real
acceptance of each request position by position. The graphs run eagerly (no compile), on a runtime long
enough for every step's drafts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
from compiled_mtp.bench import bench_prompts

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8  # requests prefilled and stepped together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (default: 24)")
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)"
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: 64)")
    parser.add_argument(
        "--depth", type=int, default=6, help="the depth of the traced steps, >= 1 (default: 6)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "acceptance-trace.json")
    args = parser.parse_args()
    if args.depth < 1:
        parser.error(f"--depth must be at least 1 (got {args.depth})")
    prompts = bench_prompts(Path(DEFAULT_MODEL), 4096, args.prompts, args.prompt_len).token_ids
    rt = Runtime.from_pretrained(
        mtp_depth=args.depth,
        batch_sizes=(BATCH,),
        max_seq_len=args.prompt_len + args.new_tokens + args.depth + 1,
        cache_dir=None,
        draft_vocab=1024,
        compile_backend="eager",
    )
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    texts = [out.token_ids for out in rt.generate(prompts, greedy)]
    one_step = SamplingParams(max_new_tokens=2, ignore_eos=True)
    starts = [(i, g) for i in range(len(prompts)) for g in range(1, args.new_tokens)]
    accepted = [[0] * args.new_tokens for _ in prompts]  # a[0] unused: every request starts with its prefill
    for n in range(0, len(starts), BATCH):
        batch = starts[n : n + BATCH]
        outs = rt.generate([prompts[i] + texts[i][: g - 1] for i, g in batch], one_step)
        for (i, g), out in zip(batch, outs):
            assert out.token_ids[0] == texts[i][g - 1], "a prefill emitted another token than decoding"
            accepted[i][g] = out.accepted_per_step[0]
        print(f"\r{min(n + BATCH, len(starts))} of {len(starts)} positions", end="", flush=True)
    decoded = [out.accepted_per_step for out in rt.generate(prompts, greedy)]  # at K=D from the start
    same = sum(replay(row, args.depth, args.new_tokens) == steps for row, steps in zip(accepted, decoded))
    print(f"\nK={args.depth} decoding accepted what the trace replays on {same} of {len(prompts)} prompts")
    depths = range(1, args.depth + 1)
    per_depth = [sum(min(k, a) for row in accepted for a in row[1:]) / len(starts) for k in depths]
    print(
        f"drafts accepted per step from every position, K=1..{args.depth}: {[round(x, 3) for x in per_depth]}"
    )
    args.out.write_text(
        json.dumps(
            {
                "prompts": len(prompts),
                "new_tokens": args.new_tokens,
                "depth": args.depth,
                "accepted": accepted,
            }
        )
    )
    print(f"wrote {args.out}")


def replay(row: list[int], depth: int, new_tokens: int) -> list[int]:
    """The drafts each step at `depth` accepts, decoding one request whose trace is `row`."""
    steps, g = [], 1
    while g < new_tokens:
        steps.append(min(depth, row[g]))
        g += steps[-1] + 1
    return steps


if __name__ == "__main__":
    main()
