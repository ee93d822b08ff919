"""Soak `compiled-mtp serve`: many requests over a fixed time, then check that nothing was lost or leaked.

    python scripts/soak_serve.py                                  # 10000 requests over 30 minutes
    python scripts/soak_serve.py --requests 200 --seconds 60 --backend eager

A server starts in its own process. Requests are sent at an even pace over `--seconds`, at most
`--concurrency` at once, in a fixed seeded mix: streamed and not, greedy and seeded samples, stop
strings, chat and completions, refused requests (a field out of range: must be a clean 400) and
clients that hang up mid-stream (the server must abort them). At the end it reports, and exits 1
unless all hold:

- lost requests: 0. Each request must get its whole answer (a finish_reason, a usage block, and
  for a stream `data: [DONE]`) or a clean error (OpenAI error JSON with a 4xx status);
- resident memory of the server: at most 5% more at the end than after the warm-up (the first 5%
  of the requests);
- leaked slots: 0. Once every client is done, /metrics shows no request running or waiting and no
  cache slot in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp import DEFAULT_MODEL  # noqa: E402
from compiled_mtp.server.launch import resident_bytes, scrape, serve_command, start  # noqa: E402

PROMPTS = ["def read_config(path):\n", "class Queue:\n    def __init__(self", "import os\nimport sys\n", "# "]
MAX_GROWTH = 0.05


def request_body(i: int, rng: random.Random, model: str) -> tuple[str, str, dict]:
    """The i-th request: (kind, path, body). Kinds: ok, bad (must be refused), hangup (client leaves)."""
    body: dict = {"model": model, "max_tokens": rng.randint(1, 48), "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body |= {"temperature": 0.8, "seed": rng.randrange(2**31), "top_k": rng.choice([0, 20])}
    else:
        body |= {"temperature": 0}
    if rng.random() < 0.2:
        body["stop"] = ["\n\n", ":"]
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.3:
        path, body = "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", body | {"prompt": prompt}
    roll = rng.random()
    if roll < 0.05:
        return "bad", path, body | {"top_p": 2.0}
    if roll < 0.10 and body["stream"]:
        return "hangup", path, body
    return "ok", path, body


def complete(body: dict, status: int, payload: dict | None, events: list[str]) -> bool:
    """Whether an answer is whole: 200 with a finish_reason, usage where asked, and [DONE] when streamed."""
    if status != 200:
        return False
    if not body["stream"]:
        return (
            payload is not None and payload["choices"][0]["finish_reason"] is not None and "usage" in payload
        )
    if not events or events[-1] != "[DONE]":
        return False
    chunks = [json.loads(e) for e in events[:-1]]
    finished = any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    wants_usage = body.get("stream_options", {}).get("include_usage", False)
    return finished and (not wants_usage or chunks[-1].get("usage") is not None)


async def send(client: httpx2.AsyncClient, kind: str, path: str, body: dict) -> str:
    """The outcome of one request: ok, refused (a clean 4xx), hung-up, or lost."""
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                error = json.loads(await response.aread()).get("error", {})
                clean = response.status_code < 500 and {"message", "type", "param", "code"} <= set(error)
                return (
                    "refused"
                    if clean and kind == "bad"
                    else ("busy" if response.status_code == 429 else "lost")
                )
            if kind == "hangup":
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return "hung-up"  # leaving the block closes the connection mid-stream
            if not body["stream"]:
                return (
                    "ok"
                    if complete(body, response.status_code, json.loads(await response.aread()), [])
                    else "lost"
                )
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
            return "ok" if complete(body, response.status_code, None, events) else "lost"
    except (httpx2.HTTPError, json.JSONDecodeError, KeyError, IndexError):
        return "lost"


async def soak(url: str, pid: int, model: str, args: argparse.Namespace) -> tuple[Counter, int, int]:
    """Run the requests; returns the outcomes and the resident memory after warm-up and at the end."""
    rng = random.Random(args.seed)
    requests = [request_body(i, rng, model) for i in range(args.requests)]
    gap, warm_up = args.seconds / args.requests, max(1, args.requests // 20)
    limit = asyncio.Semaphore(args.concurrency)
    outcomes: Counter[str] = Counter()
    warm_rss = 0

    async def one(client: httpx2.AsyncClient, request: tuple[str, str, dict]) -> None:
        async with limit:
            outcomes[await send(client, *request)] += 1

    async with httpx2.AsyncClient(base_url=url, timeout=600) as client:
        tasks = []
        for i, request in enumerate(requests):
            if i == warm_up:
                await asyncio.gather(*tasks)  # the warm-up's requests are done: measure from here
                warm_rss = resident_bytes(pid)
            tasks.append(asyncio.create_task(one(client, request)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
    return outcomes, warm_rss, resident_bytes(pid)


def leaked_slots(url: str) -> float:
    """Requests still running or waiting and slots in use, once the server had a moment to settle."""
    for _ in range(100):  # an abort takes effect between steps
        m = scrape(url)
        busy = m["num_requests_running"] + m["num_requests_waiting"] + m["cache_slots_in_use"]
        if busy == 0:
            return 0
        time.sleep(0.1)
    return busy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (default: the shipped model)"
    )
    p.add_argument("--requests", type=int, default=10000, help="requests in all (default: %(default)s)")
    p.add_argument(
        "--seconds", type=float, default=1800, help="time to send them over (default: %(default)s)"
    )
    p.add_argument("--concurrency", type=int, default=32, help="clients at once (default: %(default)s)")
    p.add_argument(
        "--backend", default="inductor", choices=("inductor", "eager"), help="(default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: %(default)s)")
    args = p.parse_args()
    proc, url = start(serve_command("--model", str(args.model), "--backend", args.backend))
    try:
        outcomes, warm, end = asyncio.run(soak(url, proc.pid, args.model.resolve().name, args))
        leaked = leaked_slots(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    growth = end / warm - 1
    print(f"outcomes: {dict(sorted(outcomes.items()))} (busy: 429 while the queue was full)")
    print(
        f"resident memory: {warm / 2**20:.1f} MiB after warm-up, {end / 2**20:.1f} MiB at the end ({growth:+.1%})"
    )
    print(
        f"lost requests: {outcomes['lost']}; leaked slots: {leaked:.0f}; server exit code {proc.returncode}"
    )
    ok = outcomes["lost"] == 0 and growth <= MAX_GROWTH and leaked == 0 and proc.returncode == 0
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
