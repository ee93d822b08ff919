"""The HTTP routes: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events
or not), /v1/models, /health and /metrics; errors as OpenAI's error JSON; SIGTERM drains.

A request is checked by the runtime's own validation (`Runtime.check`) on the event loop, before it
is queued: whatever the runtime would refuse is a 400 naming the API's field.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Receive, Scope, Send

from ..runtime import RequestOutput, Runtime, SamplingParams, acceptance_length
from .chat import ChatTemplate, ChatTemplateError
from .engine import Chunk, Draining, Engine, Handle, QueueFull
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.json(), status_code=self.status)


@dataclass
class Server:
    """What the routes share: the engine, its metrics, the chat template and the settings."""

    engine: Engine
    metrics: Metrics
    template: ChatTemplate
    model_name: str

    @property
    def runtime(self) -> Runtime:
        return self.engine.runtime


router = APIRouter()


def _server(request: Request) -> Server:
    return request.app.state.server


# -- requests into the engine ---------------------------------------------------------------------


def _params(server: Server, body: _Sampling) -> SamplingParams:
    """The request's SamplingParams with max_new_tokens 1, after the checks that are the API's own: the
    model's name, n and empty stop strings. Raises APIError."""
    if body.model is not None and body.model != server.model_name:
        raise APIError(
            404,
            f"model: {body.model!r} is not served here; {server.model_name!r} is",
            "model",
            "model_not_found",
        )
    if body.n != 1:
        raise APIError(400, f"n: only 1 is supported, got {body.n}", "n")
    if "" in body.stops():
        raise APIError(400, "stop: must not be an empty string", "stop")
    return SamplingParams(
        max_new_tokens=1, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed
    )


def _validate(
    server: Server, body: _Sampling, prompt: str | list[int], prompt_field: str
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the request's SamplingParams, checked by `Runtime.check`: first with
    one token to generate (a length error then is the prompt's), then with the request's limit, or
    up to max_seq_len without one. Raises APIError naming the request's field."""
    runtime, (limit_field, limit) = server.runtime, body.token_limit()
    params = _params(server, body)
    try:
        ids = runtime.check(prompt, params)
    except ValueError as e:
        raise _refused(str(e), prompt_field, prompt_field) from None
    params = dataclasses.replace(
        params, max_new_tokens=runtime.max_seq_len - len(ids) if limit is None else limit
    )
    try:
        runtime.check(ids, params)
    except ValueError as e:
        raise _refused(str(e), limit_field, prompt_field) from None
    return ids, params


def _refused(message: str, limit_field: str, prompt_field: str) -> APIError:
    """The runtime's `field: ...` error as a 400 naming the API's field: the prompt's, or for
    max_new_tokens the field that set it (the prompt's when the prompt alone is too long)."""
    field = re.split(r"[:\[]", message, maxsplit=1)[0]
    if field == "max_new_tokens" and limit_field == prompt_field:
        message = f"{prompt_field}: too long ({message.split(': ', 1)[1]})"
    elif field == "max_new_tokens":
        message = message.replace("max_new_tokens", limit_field)
    return APIError(400, message, {"max_new_tokens": limit_field, "prompt": prompt_field}.get(field, field))


def _submit(server: Server, ids: list[int], params: SamplingParams, stops: list[str]) -> Handle:
    try:
        return server.engine.submit(ids, params, stops)
    except QueueFull:
        raise APIError(
            429, "the server's queue is full; retry later", None, "queue_full", "rate_limit_error"
        ) from None
    except Draining:
        raise APIError(503, "the server is shutting down", None, "draining", "service_unavailable") from None


# -- responses ------------------------------------------------------------------------------------


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage, plus `speculative`: the request's draft tokens, those accepted, and its acceptance
    length (tokens per decode step that drafted; 1.0 without drafts)."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    steps = len(output.accepted_per_step)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculative": {
            "draft_tokens": output.num_draft_tokens,
            "accepted_tokens": output.num_accepted_tokens,
            "acceptance_length": acceptance_length(steps + output.num_accepted_tokens, steps),
        },
    }


class _Shape:
    """The JSON of one endpoint's responses and stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.first = True  # no chunk sent yet

    def body(self, choices: list[dict], streamed: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion" + ".chunk" * streamed) if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def choice(self, text: str, reason: str | None) -> dict[str, Any]:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **content, "logprobs": None, "finish_reason": reason}

    def delta(self, text: str, reason: str | None) -> dict[str, Any]:
        if not self.chat:
            return self.choice(text, reason)
        delta = {"role": "assistant", "content": text} if self.first else {"content": text}
        self.first = False
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}


def _event(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(engine: Engine, handle: Handle, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response; ends with `data: [DONE]`."""
    extra = {"usage": None} if include_usage else {}
    last = Chunk("")
    try:
        async for last in handle.stream():
            if last.error:
                yield _event(APIError(500, last.error).json())
                break
            if last.text or last.finish_reason:
                yield _event(shape.body([shape.delta(last.text, last.finish_reason)], True, **extra))
        if include_usage and last.output is not None:
            yield _event(shape.body([], True, usage=usage(last.output)))
        yield _event("[DONE]")
    finally:  # also when the client went away: the engine aborts the request
        engine.release(handle)


async def _release(engine: Engine, handle: Handle) -> None:
    """`engine.release`, as a coroutine: Starlette runs a plain function's background task in a worker
    thread, and the engine's counters belong to the event loop's."""
    engine.release(handle)


async def _respond(server: Server, handle: Handle, shape: _Shape, body: _Sampling) -> Response:
    engine = server.engine
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(engine, handle, shape, include_usage)
        # The background release covers a client gone before the first event (the generator never ran).
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(_release, engine, handle)
        )
    try:
        chunks = [chunk async for chunk in handle.stream()]
    finally:
        engine.release(handle)
    last = chunks[-1]
    if last.error or last.output is None:
        raise APIError(500, last.error or "the engine lost the request")
    text = "".join(c.text for c in chunks)
    return JSONResponse(shape.body([shape.choice(text, last.finish_reason)], False, usage=usage(last.output)))


# -- routes ---------------------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    server = _server(request)
    ids, params = _validate(server, body, body.prompt, "prompt")
    handle = _submit(server, ids, params, body.stops())
    return await _respond(server, handle, _Shape(False, server.model_name), body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    server = _server(request)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = server.template.render(messages)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    tokenizer = server.runtime.tokenizer
    assert tokenizer is not None  # the engine refuses a checkpoint without one
    ids, params = _validate(server, body, tokenizer.encode(text, add_special_tokens=False), "messages")
    handle = _submit(server, ids, params, body.stops())
    return await _respond(server, handle, _Shape(True, server.model_name), body)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    name = _server(request).model_name
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "compiled_mtp"}],
    }


@router.get("/health")
async def health(request: Request) -> Response:
    if _server(request).engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.exposition(), media_type="text/plain; version=0.0.4")


# -- errors and authorization ---------------------------------------------------------------------


def _param(loc: tuple) -> str | None:
    """A validation error's location as a field path, e.g. messages[0].content (without pydantic's
    union-member tags such as `str` or `list[int]`)."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_]+", part) and part not in ("str", "int", "float", "bool", "list"):
            path += f".{part}" if path else part
        else:
            break
    return path or None


async def _invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0]
    param = _param(tuple(error.get("loc", ())))
    if error.get("type") == "json_invalid":
        return APIError(
            400, f"body: not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
        ).response()
    return APIError(400, f"{param or 'body'}: {error['msg']}", param).response()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


class _Authorize:
    """Every path but /health needs `Authorization: Bearer KEY`. Plain ASGI, so that streamed responses
    and client disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    runtime: Runtime,
    model_name: str,
    template: ChatTemplate,
    api_key: str | None = None,
    max_queue: int = 256,
) -> FastAPI:
    """The server's ASGI app over `runtime`; its lifespan starts and stops the engine thread."""
    metrics = Metrics(runtime)
    engine = Engine(runtime, metrics, max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="compiled_mtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = Server(engine, metrics, template, model_name)
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(APIError, _api_error)
    if api_key:
        app.add_middleware(_Authorize, api_key=api_key)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM or Ctrl-C drains: requests in flight finish, new ones get
    503, and the server exits once none is left (a second signal exits at once)."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.engine.draining:
            self.should_exit = self.force_exit = True
        self.engine.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.engine.draining and self.engine.in_flight == 0:
            self.should_exit = True
        return await super().on_tick(counter)


def http_server(app: FastAPI) -> DrainingServer:
    """A draining uvicorn server for `app`: `.run(sockets=[sock])` serves on a bound socket until SIGTERM
    (or, in a thread, until `should_exit` is set)."""
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    return DrainingServer(config, app.state.server.engine)
