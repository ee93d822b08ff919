"""Chat templates: a conversation rendered into the prompt text the checkpoint was trained on.

A checkpoint's template is the `chat_template` of its tokenizer_config.json (HF's format), rendered
as HF renders it: Jinja2 in a sandbox, with `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and `raise_exception`. A checkpoint without one (the shipped model) gets DEFAULT_TEMPLATE:
one `role: content` line per message, then `assistant:` to answer after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles out of order)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content", "") if isinstance(token, dict) else token or ""


class ChatTemplate:
    """A compiled chat template with the checkpoint's special tokens."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def of_checkpoint(cls, path: str | Path) -> ChatTemplate:
        """The checkpoint's template, or DEFAULT_TEMPLATE when its tokenizer_config.json has none."""
        config_path = Path(path) / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        source = config.get("chat_template") or DEFAULT_TEMPLATE
        if isinstance(source, list):  # named templates: HF uses the one named "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), DEFAULT_TEMPLATE)
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages` (dicts with "role" and "content"), ending where the assistant's
        answer begins. Raises ChatTemplateError when the template refuses them."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
