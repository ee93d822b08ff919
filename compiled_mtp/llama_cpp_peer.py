"""llama.cpp as the bench's CPU peer: the same checkpoint exported to GGUF, decoded greedily by
llama-cpp-python on as many threads as torch uses. llama.cpp's DeepSeek-V3 graph has no MTP layer,
so this is its plain decoding; the bench compares its tokens with the engine's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MISSING = "llama-cpp-python is not installed: pip install 'compiled_mtp[bench]'"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None


class LlamaCpp:
    """One llama.cpp context over a GGUF file (see models/gguf_export.py)."""

    def __init__(self, gguf_path: Path, context: int, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_batch=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Greedy tokens after `prompt`, from a fresh context (the prefill included, as the engine's)."""
        out: list[int] = []
        self.llm.reset()  # else llama-cpp-python reuses the cached prompt and skips the prefill
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == new_tokens:
                break
        return out
