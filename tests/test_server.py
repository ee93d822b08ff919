"""`compiled-mtp serve` through the official `openai` client and raw HTTP: outputs equal to
`Runtime.generate`'s (alone, streamed or not, or among 32 concurrent clients), aborts on disconnect,
the 4xx of every refused request, the API key, the bounded queue and SIGTERM's drain.

The server runs in this process (uvicorn in a thread) over an eager 2-layer model; the drain test
starts `python -m compiled_mtp.cli serve` in a subprocess to send it SIGTERM. Tests that need a
request to stay running hold the engine between steps with `Gate` rather than racing it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx2 as httpx
import openai
import pytest

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.cli import main
from compiled_mtp.server.app import create_app, http_server
from compiled_mtp.server.chat import ChatTemplate, ChatTemplateError
from compiled_mtp.server.engine import Engine
from compiled_mtp.server.launch import scrape, serve_command, start

KEY = "test-key"
MODEL = "text"
OPTIONS = dict(mtp_depth=1, batch_sizes=(1, 2, 4, 8), max_seq_len=128, compile_backend="eager")
PROMPTS = ["def f(x):", "class A:", "import os\n", "for i in range(10):", "# a comment", "x = [1, 2"]


@dataclass
class Served:
    url: str
    engine: Engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def post(self, path: str, body: object, **headers: str) -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)

    def metric(self, name: str) -> float:
        return scrape(self.url, KEY)[name]


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by the draining uvicorn server in a thread, on a free port; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = http_server(app)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: srv.started, "the server started")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join()


def until(condition: Callable[[], object], what: str, seconds: float = 60) -> None:
    """Wait for `condition`; fail naming `what` if it does not hold within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(text_model) -> Runtime:
    return Runtime.from_pretrained(text_model, **OPTIONS)


@pytest.fixture(scope="module")
def served(text_model) -> Iterator[Served]:
    rt = Runtime.from_pretrained(text_model, **OPTIONS)
    app = create_app(rt, MODEL, ChatTemplate.of_checkpoint(text_model), api_key=KEY, max_queue=64)
    with serving(app) as url:
        yield Served(url, app.state.server.engine)


class Gate:
    """Stands in for the served runtime's `step`: each step waits for a permit."""

    def __init__(self, step: Callable) -> None:
        self.step, self.permits = step, threading.Semaphore(0)

    def __call__(self):
        self.permits.acquire()
        return self.step()

    def allow(self, steps: int) -> None:
        self.permits.release(steps)


@pytest.fixture
def gate(served, monkeypatch) -> Iterator[Gate]:
    gate = Gate(served.engine.runtime.step)
    monkeypatch.setattr(served.engine.runtime, "step", gate)
    yield gate
    gate.allow(10**6)  # let the engine finish what the test left


def expected(
    reference: Runtime, prompt: str, params: SamplingParams, stop: list[str] = ()
) -> tuple[str, int]:
    """The text and token count `Runtime.generate` gives, the text cut before the first stop string."""
    out = reference.generate([prompt], params)[0]
    cuts = [i for i in map(out.text.find, stop) if i >= 0]
    return out.text[: min(cuts)] if cuts else out.text, len(out.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completions_equal_generate(served, reference, stream):
    client = served.client()
    for prompt in PROMPTS[:3]:
        text, tokens = expected(reference, prompt, SamplingParams(max_new_tokens=20))
        if stream:
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=20,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason in ("length", "stop")
            usage = chunks[-1].usage
        else:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
            got, usage = out.choices[0].text, out.usage
        assert got == text
        assert usage.completion_tokens == tokens
        assert usage.total_tokens == usage.prompt_tokens + tokens
        spec = usage.model_extra["speculative"]
        assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0 and spec["acceptance_length"] >= 1


def test_a_request_without_a_model_goes_to_the_served_one(served, reference):
    text, _ = expected(reference, PROMPTS[0], SamplingParams(max_new_tokens=8))
    response = served.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL and response.json()["choices"][0]["text"] == text


def test_token_id_prompts_and_chat_use_the_template(served, reference, text_model):
    client = served.client()
    ids = reference.tokenizer.encode(PROMPTS[0])
    text, _ = expected(reference, PROMPTS[0], SamplingParams(max_new_tokens=8))
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    rendered = "system: Be brief.\nuser: hello\nassistant:"  # DEFAULT_TEMPLATE's rendering
    assert ChatTemplate.of_checkpoint(text_model).render(messages) == rendered
    text, tokens = expected(reference, rendered, SamplingParams(max_new_tokens=8))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == text and chat.usage.completion_tokens == tokens
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [m.id for m in client.models.list()] == [MODEL]


def test_checkpoint_chat_template_renders_as_hf(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = ChatTemplate.of_checkpoint(tmp_path)
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(ChatTemplateError, match="no system messages"):
        chat.render([{"role": "system", "content": "x"}])
    assert ChatTemplate.of_checkpoint(tmp_path / "missing").render([]) == "assistant:"  # DEFAULT_TEMPLATE


def _requests(n: int) -> list[tuple[str, dict, list[str]]]:
    """n requests of mixed lengths and sampling settings, a few with stop strings."""
    out = []
    for i in range(n):
        body = {"max_tokens": 1 + (7 * i) % 40}
        if i % 3:
            body |= {"temperature": 0.7 + 0.1 * (i % 4), "seed": 1000 + i, "top_p": 0.9 if i % 2 else 1.0}
            body |= {"top_k": 20} if i % 5 == 1 else {}
        else:
            body |= {"temperature": 0}
        stop = [" ", "\n"] if i % 8 == 3 else []
        out.append((PROMPTS[i % len(PROMPTS)], body, stop))
    return out


def _params(body: dict) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=body["max_tokens"],
        temperature=body["temperature"],
        top_p=body.get("top_p", 1.0),
        top_k=body.get("top_k", 0),
        seed=body.get("seed"),
    )


async def _stream(client: openai.AsyncOpenAI, prompt: str, body: dict, stop: list[str]) -> str:
    extra = {"top_k": body["top_k"]} if "top_k" in body else None
    fields = {k: v for k, v in body.items() if k != "top_k"}
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stop=stop or None, extra_body=extra, **fields
    )
    return "".join([c.choices[0].text async for c in stream])


def test_32_concurrent_streams_each_get_their_own_tokens(served, reference):
    requests = _requests(32)

    async def run_all() -> list[str]:
        async with served.async_client() as client:
            return await asyncio.gather(*(_stream(client, *r) for r in requests))

    texts = asyncio.run(run_all())
    for (prompt, body, stop), text in zip(requests, texts):
        assert text == expected(reference, prompt, _params(body), stop)[0], (prompt, body, stop)
    until(lambda: served.metric("cache_slots_in_use") == 0, "every slot is free")


def test_seeded_sample_is_the_same_alone_or_in_a_busy_batch(served, reference):
    prompt, body = PROMPTS[1], {"max_tokens": 30, "temperature": 1.0, "seed": 7}

    async def alone() -> str:
        async with served.async_client() as client:
            return await _stream(client, prompt, body, [])

    async def busy() -> list[str]:
        async with served.async_client() as client:
            others = [_stream(client, p, b, s) for p, b, s in _requests(12)]
            return await asyncio.gather(_stream(client, prompt, body, []), *others)

    text = expected(reference, prompt, _params(body))[0]
    assert asyncio.run(alone()) == text
    assert asyncio.run(busy())[0] == text


def _open_streams(served: Served, n: int, stack: ExitStack) -> list[Iterator[str]]:
    """n streamed requests of 100 tokens, each read up to its first event; `stack` closes them."""
    lines = []
    for i in range(n):
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 100, "temperature": 0, "stream": True}
        response = stack.enter_context(
            httpx.stream(
                "POST", served.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
        )
        lines.append(response.iter_lines())
    return lines


def test_disconnected_streams_are_aborted_and_free_their_slots(served, gate):
    finished = served.metric("e2e_request_latency_seconds_count")
    with ExitStack() as stack:
        streams = _open_streams(served, 4, stack)
        gate.allow(20)  # four prefills and some decode steps: under 100 tokens at K=1
        for lines in streams:
            assert next(line for line in lines if line).startswith("data: {")
        until(lambda: served.metric("cache_slots_in_use") == 4, "the four requests hold slots")
    # The clients are gone; let the engine step again (it aborts them between steps).
    until(lambda: served.engine.in_flight == 0, "the server saw the disconnects")
    gate.allow(10**6)
    until(lambda: served.metric("cache_slots_in_use") == 0, "the aborted requests' slots are free")
    assert not served.engine.runtime.has_unfinished()
    assert served.metric("e2e_request_latency_seconds_count") == finished  # none ran to its end
    assert served.client().completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens


def test_a_full_queue_answers_429(served, gate, monkeypatch):
    monkeypatch.setattr(served.engine, "capacity", 2)
    with ExitStack() as stack:
        _open_streams(served, 2, stack)  # both held: the engine may not step
        response = served.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        gate.allow(10**6)


LONG = "word " * 200  # more tokens than max_seq_len (128)
BAD = [
    ("/v1/completions", '{"model": "text", "prompt": ', None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 500}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -1}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"x": 1}}, "stream_options.x"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_refused_requests_get_an_openai_400_naming_the_field(served, path, body, param):
    response = served.post(path, body)
    status = 404 if param == "model" and "model" in body else 400
    assert (response.status_code, response.headers["content-type"]) == (status, "application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(param or "body:")
    out = served.client().completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1  # still serving


def test_the_api_key_is_required_except_for_health(served):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert served.post("/v1/completions", body, Authorization="Bearer wrong").status_code == 401
    response = httpx.post(served.url + "/v1/completions", json=body)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/metrics").status_code == 401
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_speculative_metrics_count_the_drafts(served):
    drafts, accepted = served.metric("spec_decode_num_draft_tokens_total"), None
    served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert served.metric("spec_decode_num_draft_tokens_total") > drafts
    accepted = served.metric("spec_decode_num_accepted_tokens_total")
    assert served.metric('spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == accepted
    assert served.metric("spec_decode_num_drafts_total") == served.metric(
        "spec_decode_num_draft_tokens_total"
    )
    assert served.metric('spec_decode_depth_bucket{le="1.0"}') > 0
    assert served.metric("time_to_first_token_seconds_count") > 0


def test_serve_without_the_extra_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "compiled_mtp.server.app")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0"])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and err == "error: serve: fastapi is not installed; pip install 'compiled_mtp[serve]'\n"
    )


# Runs the command line with every runtime step waiting while the file argv[1] exists.
HELD = """
import sys, time
from pathlib import Path
from compiled_mtp.runtime import Runtime
from compiled_mtp.cli import main

hold, step = Path(sys.argv[1]), Runtime.step
def held_step(rt):
    while hold.exists():
        time.sleep(0.01)
    return step(rt)
Runtime.step = held_step
main(sys.argv[2:])
"""


def test_sigterm_drains_running_requests_then_exits_0(text_model, reference, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    flags = ["--model", str(text_model), "--backend", "eager", "--max-seq-len", "128", "--mtp-depth", "1"]
    command = serve_command(*flags, "--batch-sizes", "1,2")
    # One thread: a tiny model's first steps take seconds when two OpenMP threads share busy cores.
    proc, url = start([sys.executable, "-c", HELD, str(hold), *command[3:]], {"OMP_NUM_THREADS": "1"})
    try:
        body = {"model": text_model.name, "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}
        with httpx.stream(
            "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60
        ) as running:
            proc.send_signal(signal.SIGTERM)
            until(lambda: httpx.get(url + "/health").status_code == 503, "the server is draining")
            refused = httpx.post(url + "/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            hold.unlink()
            events = [line for line in running.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert text == expected(reference, PROMPTS[0], SamplingParams(max_new_tokens=30))[0]
        assert proc.wait(60) == 0
    finally:
        proc.kill()
