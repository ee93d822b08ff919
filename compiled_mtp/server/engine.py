"""The engine thread: the one thread that touches the Runtime, stepping it while requests exist.

HTTP handlers run on the asyncio event loop and never call the runtime's stepping methods. They
submit a request (`Engine.submit`, which returns a `Handle`) and read its `Chunk`s from the handle's
asyncio queue; the engine thread takes submissions and aborts from one thread-safe inbox between
steps and hands chunks back with `loop.call_soon_threadsafe`. Detokenization and stop strings are
handled here, next to the runtime, so that a request that reached a stop string is aborted (its slot
freed) before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..detokenize import IncrementalText
from ..runtime import RequestOutput, Runtime, SamplingParams
from .metrics import Metrics

log = logging.getLogger("compiled_mtp.server")


class QueueFull(Exception):
    """Every slot is taken and the queue holds max_queue requests."""


class Draining(Exception):
    """The server is shutting down: it finishes what it has and takes nothing new."""


@dataclass
class Chunk:
    """Text a request gained in one step. Its last chunk has `finish_reason` and `output` (token counts
    for usage), or `error` when the engine failed it."""

    text: str
    finish_reason: str | None = None
    output: RequestOutput | None = None
    error: str | None = None


class Handle:
    """A submitted request, as its HTTP handler holds it."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self.done = False  # the last chunk was read
        self.released = False
        self.request_id = -1  # the runtime's id, known to the engine thread only

    async def stream(self) -> AsyncIterator[Chunk]:
        """The request's chunks as the engine hands them out, up to its last."""
        while not self.done:
            chunk = await self.chunks.get()
            self.done = chunk.finish_reason is not None or chunk.error is not None
            yield chunk


@dataclass
class _Submit:
    handle: Handle
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    arrival: float


@dataclass
class _Live:
    """A request the engine thread is running: its handle, text so far and token times."""

    handle: Handle
    text: IncrementalText
    arrival: float
    last: float | None = None  # when it last gained tokens


class Engine:
    """Owns the runtime and its thread. `submit`, `release` and the counters are for the event loop's
    thread; everything else runs on the engine thread."""

    def __init__(self, runtime: Runtime, metrics: Metrics, max_queue: int) -> None:
        if runtime.tokenizer is None:
            raise ValueError(
                "model: the checkpoint has no tokenizer.json; the server needs one to return text"
            )
        self.runtime, self.metrics = runtime, metrics
        self.capacity = runtime.num_slots + max_queue  # requests held at once, running or queued
        self.in_flight = 0  # submitted and not released
        self.draining = False
        self._decode = runtime.tokenizer.decode
        self._inbox: queue.SimpleQueue[_Submit | Handle | None] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._thread = threading.Thread(target=self._run, name="compiled_mtp-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start stepping; call on the event loop that will read the chunks."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the step under way (requests still running are dropped)."""
        self._inbox.put(None)
        self._thread.join()

    # -- the event loop's side --------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, stops: list[str]) -> Handle:
        """Queue a request `Runtime.check` passed. Raises Draining or QueueFull. The caller must
        `release` the handle once done with it."""
        if self.draining:
            raise Draining
        if self.in_flight >= self.capacity:
            raise QueueFull
        handle = Handle()
        self.in_flight += 1
        self._inbox.put(_Submit(handle, prompt, params, stops, time.monotonic()))
        return handle

    def release(self, handle: Handle) -> None:
        """The handler is done with the request: abort it if it is still running (its client went away).
        Idempotent."""
        if handle.released:
            return
        handle.released = True
        self.in_flight -= 1
        if not handle.done:
            self._inbox.put(handle)

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            for message in self._messages(block=not self.runtime.has_unfinished()):
                if message is None:
                    return
                if isinstance(message, Handle):
                    self._abort(message)
                else:
                    self._add(message)
            if self.runtime.has_unfinished():
                self._step()
            self.metrics.update(self.runtime)

    def _messages(self, block: bool) -> list[_Submit | Handle | None]:
        """What the inbox holds; with `block`, waits for the first message."""
        messages = [self._inbox.get()] if block else []
        while not self._inbox.empty():
            messages.append(self._inbox.get())
        return messages

    def _add(self, submit: _Submit) -> None:
        try:
            request_id = self.runtime.add_request(submit.prompt, submit.params)
        except ValueError as e:  # checked before submitting, so only a bug gets here
            self._send(submit.handle, Chunk("", error=str(e)))
            return
        submit.handle.request_id = request_id
        text = IncrementalText(self._decode, submit.stops)
        self._live[request_id] = _Live(submit.handle, text, submit.arrival)

    def _abort(self, handle: Handle) -> None:
        if self._live.pop(handle.request_id, None) is not None:
            self.runtime.abort(handle.request_id)

    def _step(self) -> None:
        try:
            outputs = self.runtime.step()
        except Exception as e:  # a failed graph call: fail the requests it ran, then take new ones
            log.exception("runtime step failed")
            for failed in list(self._live.values()):
                self._abort(failed.handle)
                self._send(failed.handle, Chunk("", error=f"engine step failed: {e}"))
            return
        now = time.monotonic()
        for s in outputs:
            live = self._live.get(s.request_id)
            if live is not None:  # else aborted since the step
                self._deliver(s.request_id, live, s.new_token_ids, s.output, now)

    def _deliver(
        self, request_id: int, live: _Live, tokens: list[int], output: RequestOutput | None, now: float
    ) -> None:
        live.text.add(tokens, output is not None)
        self.metrics.observe_tokens(live.arrival, live.last, now, len(tokens))
        live.last = now
        if live.text.stopped and output is None:  # at a stop string: end it now, freeing its slot
            output = self.runtime.abort(request_id)
        text = live.text.take()
        if output is None:
            if text:
                self._send(live.handle, Chunk(text))
            return
        del self._live[request_id]
        self.metrics.e2e.observe(now - live.arrival)
        reason = "stop" if live.text.stopped else output.finish_reason
        self._send(live.handle, Chunk(text, reason, output))

    def _send(self, handle: Handle, chunk: Chunk) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(handle.chunks.put_nowait, chunk)
