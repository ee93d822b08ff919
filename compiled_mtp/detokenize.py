"""Incremental detokenization with stop strings: the text of a request's tokens as they are committed,
never taking back what it already gave (`generate --stream` and the server's streamed responses)."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """One request's output as its tokens are committed: the text safe to show so far, cut before the
    first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], head: str = "") -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text = ""  # the output so far, taken or in `untaken`
        self.untaken = head
        self.stopped = False  # at a stop string: later tokens are dropped

    def add(self, ids: list[int], finished: bool) -> None:
        """Tokens the request gained; `finished` once it gained its last ones (all its text is settled)."""
        if self.stopped:
            return
        self.ids += ids
        text = self.decode(self.ids)
        cut = min((i for i in map(text.find, self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        elif not finished:
            text = text[: len(text) - self._unsettled(text)]
        self.untaken += text[len(self.text) :]
        self.text = text

    def _unsettled(self, text: str) -> int:
        """Trailing characters the next tokens may still change: bytes of an incomplete UTF-8 character
        (decoded as U+FFFD) or the beginning of a stop string."""
        settled = text.rstrip("\ufffd")
        return (
            len(text)
            - len(settled)
            + max([0] + [n for s in self.stops for n in range(1, len(s)) if settled.endswith(s[:n])])
        )

    def take(self) -> str:
        """The text not taken yet."""
        chunk, self.untaken = self.untaken, ""
        return chunk
