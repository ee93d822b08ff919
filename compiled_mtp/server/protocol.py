"""The OpenAI request bodies the server accepts, as pydantic models.

Strict and closed: a field of the wrong type (a string for a number, a float for an integer) or one
the server does not know (`logprobs`, `presence_penalty`, ...) is a 400 naming it, not silently coerced
or ignored. Value ranges are not checked here but by the runtime's own validation (app.py), so that
the API and the Python interface refuse the same requests with the same messages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Closed):
    include_usage: bool = False


class _Sampling(_Closed):
    """The fields both endpoints share. `top_k` is an extension (0 = no limit)."""

    model: str | None = None  # as vLLM and SGLang: the served model when left out
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's logs; the server does not use it

    def token_limit(self) -> tuple[str, int | None]:
        """The field that limits the output's tokens, and its value (None: up to max_seq_len)."""
        return "max_tokens", self.max_tokens

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int]


class TextPart(_Closed):
    type: Literal["text"]
    text: str


class ChatMessage(_Closed):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def token_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_limit()
