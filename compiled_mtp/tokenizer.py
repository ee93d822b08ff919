"""The checkpoint's tokenizer (`tokenizer.json`, HF `tokenizers` format), when it ships one."""

from __future__ import annotations

from pathlib import Path

from .models.config import CheckpointError


class Tokenizer:
    """Text <-> token ids with the checkpoint's own tokenizer."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Impl  # only checkpoints with a tokenizer need the package

        try:
            self._impl = _Impl.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise CheckpointError(f"{path}: unreadable tokenizer ({e})") from None

    @classmethod
    def find(cls, checkpoint: str | Path) -> Tokenizer | None:
        path = Path(checkpoint) / "tokenizer.json"
        return cls(path) if path.exists() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` leaves out those the tokenizer adds around it
        (a chat template writes its own)."""
        return self._impl.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._impl.decode(ids)
