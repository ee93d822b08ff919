"""Serving under load: open-loop Poisson arrivals against `compiled-mtp serve` on this machine.

    python benchmarks/bench_serve.py                              # the shipped model, K = 0, 3 and auto
    python benchmarks/bench_serve.py --rates 0.5,1,2 --requests 200 --max-tokens 64
    python benchmarks/bench_serve.py --model DIR --profile P --depths 0,2,auto

For each depth a server starts in its own process (graphs from the capture cache), answers a few
warm-up requests, then for each rate receives `--requests` requests whose send times are a Poisson
process (seeded exponential gaps), whatever the server's pace: an overloaded server builds a queue,
as a real one would. Each request streams a greedy completion of a held-out prompt (compiled_mtp/
bench.py's prompts) through the official `openai` client. Per depth and rate it reports:

- throughput: completion tokens and requests per second, from the first send to the last answer;
- TTFT: send to first streamed text; ITL: the gaps between a request's streamed chunks (one chunk
  per engine step, carrying every token that step committed); TPOT: a request's time per output
  token after the first;
- acceptance: tokens per drafting request-step, 1 + accepted / drafts, from the server's
  speculative decoding counters over the rate's requests.

Timings belong on a quiet machine; record them in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp import DEFAULT_MODEL  # noqa: E402
from compiled_mtp.bench import bench_prompts  # noqa: E402
from compiled_mtp.models.registry import read_config  # noqa: E402
from compiled_mtp.server.launch import scrape, serve_command, start  # noqa: E402


@dataclass
class Answer:
    """One streamed request's timings (seconds since its send) and token count."""

    chunks: list[float]
    tokens: int


@dataclass
class Row:
    depth: str
    rate: float
    requests: int
    tokens_per_s: float
    requests_per_s: float
    ttft: dict[str, float]
    itl: dict[str, float]
    tpot: dict[str, float]
    acceptance_length: float


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        values = values * 2 or [0.0, 0.0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


async def request(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> Answer:
    sent, chunks, tokens = time.perf_counter(), [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            chunks.append(time.perf_counter() - sent)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return Answer(chunks, tokens)


async def load(url: str, model: str, prompts: list[list[int]], rate: float, args: argparse.Namespace):
    """Send the prompts at Poisson times of `rate` per second; returns the answers and the seconds
    from the first send to the last answer."""
    rng = random.Random(args.seed)
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600
    ) as client:
        start_time, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(request(client, model, prompt, args.max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        answers = await asyncio.gather(*tasks)
    return answers, time.perf_counter() - start_time


def summarize(
    depth: str, rate: float, answers: list[Answer], seconds: float, before: dict, after: dict
) -> Row:
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = grew("spec_decode_num_drafts_total")
    tokens = sum(a.tokens for a in answers)
    timed = [a for a in answers if a.chunks]
    return Row(
        depth=depth,
        rate=rate,
        requests=len(answers),
        tokens_per_s=tokens / seconds,
        requests_per_s=len(answers) / seconds,
        ttft=percentiles([a.chunks[0] for a in timed]),
        itl=percentiles([b - a for x in timed for a, b in zip(x.chunks, x.chunks[1:])]),
        tpot=percentiles([(a.chunks[-1] - a.chunks[0]) / (a.tokens - 1) for a in timed if a.tokens > 1]),
        acceptance_length=1 + grew("spec_decode_num_accepted_tokens_total") / drafts if drafts else 1.0,
    )


def bench_depth(depth: str, prompts: list[list[int]], args: argparse.Namespace) -> list[Row]:
    flags = ["--model", str(args.model), "--mtp-depth", depth, "--backend", args.backend]
    flags += ["--profile", str(args.profile)] if args.profile else []
    flags += ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    proc, url = start(serve_command(*flags))
    model = args.model.resolve().name
    rows = []
    try:
        asyncio.run(load(url, model, prompts[:4], 100.0, args))  # warm-up: every batch size up to 4
        for rate in args.rates:
            before = scrape(url)
            answers, seconds = asyncio.run(load(url, model, prompts, rate, args))
            rows.append(summarize(depth, rate, answers, seconds, before, scrape(url)))
            print_row(rows[-1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return rows


def print_row(r: Row) -> None:
    def ms(p: dict[str, float]) -> str:
        return "/".join(f"{1000 * p[k]:.0f}" for k in ("p50", "p90", "p99"))

    print(
        f"K={r.depth:<4} rate {r.rate:>5.2f}/s: {r.tokens_per_s:7.1f} tok/s {r.requests_per_s:5.2f} req/s  "
        f"TTFT {ms(r.ttft)} ms  ITL {ms(r.itl)} ms  TPOT {ms(r.tpot)} ms (p50/p90/p99)  "
        f"acceptance length {r.acceptance_length:.2f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (default: the shipped model)"
    )
    p.add_argument("--profile", type=Path, help="serve's --profile (default: serve's own choice)")
    p.add_argument("--cache-dir", type=Path, help="serve's --cache-dir (default: serve's)")
    p.add_argument(
        "--backend", default="inductor", choices=("inductor", "eager"), help="(default: %(default)s)"
    )
    p.add_argument(
        "--depths", default="0,3,auto", help="serve's --mtp-depth, each in turn (default: %(default)s)"
    )
    p.add_argument(
        "--rates",
        type=lambda s: [float(r) for r in s.split(",")],
        default=[0.5, 1.0, 2.0],
        help="requests per second (default: 0.5,1,2)",
    )
    p.add_argument("--requests", type=int, default=50, help="requests per rate (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the rows as JSON (default: none)")
    args = p.parse_args()
    vocab = read_config(args.model / "config.json")[1].vocab_size
    prompts = bench_prompts(args.model, vocab, args.requests, args.prompt_len).token_ids
    rows = [row for depth in args.depths.split(",") for row in bench_depth(depth, prompts, args)]
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
