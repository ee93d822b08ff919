"""llama.cpp as the bench's CPU peer: the same checkpoint exported to GGUF, decoded greedily by
llama-cpp-python on as many threads as torch uses, and the bench compares its tokens with the
engine's. `LlamaCpp` is llama.cpp's plain decoding. `LlamaCppMTP` drafts with llama.cpp's own MTP
graph (the NextN block of its deepseek2 or glm4moe model, from `export_gguf(..., with_mtp=True)`)
in a greedy speculative loop, driven through llama-cpp-python's low-level API; a llama.cpp without
that graph is `mtp_available() is False`."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np

MISSING = "llama-cpp-python is not installed: pip install 'compiled_mtp[bench]'"
NO_MTP = "this llama-cpp-python's llama.cpp has no MTP context (LLAMA_CONTEXT_TYPE_MTP)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None


def mtp_available() -> bool:
    """Whether the installed llama.cpp can run a model's NextN block as an MTP context."""
    if not available():
        return False
    import llama_cpp

    try:
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError):  # the extension symbols are missing from older builds
        return False
    return hasattr(llama_cpp, "LLAMA_CONTEXT_TYPE_MTP") and hasattr(
        llama_cpp_ext, "llama_set_embeddings_nextn"
    )


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


class LlamaCppMTP:
    """Greedy speculative decoding with llama.cpp's MTP graph drafting `depth` tokens a step.

    Two contexts over one model: the target, which returns every row's hidden state (after the
    final norm), and the MTP context, whose KV cache holds the NextN block's entries. The MTP row
    at position p pairs token p with the target's hidden at p - 1; a step drafts d_1 from the
    seed row (the last greedy token) and each further draft from the previous one and the MTP
    graph's own hidden (DeepSeek-V3's recursive MTP), then the target verifies [seed, d_1..d_K]
    in one batch. Rejected rows leave both caches, and the MTP rows written with drafted hiddens
    are rewritten with the target's at the next step's seed. The tokens are the target's greedy
    ones (llama.cpp's multi-row verify can break a near tie in the last bits otherwise than its
    one-row decoding); `drafted` and `accepted` count drafts over all calls. At depth 1 the drafts
    are the engine's; deeper, llama.cpp feeds back its MTP graph's own hidden, which need not be
    the one the engine feeds back (after shared_head.norm)."""

    def __init__(self, gguf_path: Path, context: int, threads: int, depth: int) -> None:
        import llama_cpp as lib
        from llama_cpp import llama_cpp_ext as ext
        from llama_cpp._utils import suppress_stdout_stderr  # how Llama(verbose=False) quiets loading

        if depth < 1:
            raise ValueError(f"depth: must be >= 1, got {depth}")
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib, self.ext, self.depth, self.context = lib, ext, depth, context
        owned: list[tuple[Any, Any]] = []  # freed last-first when this peer goes
        weakref.finalize(self, _free, owned)
        with suppress_stdout_stderr(disable=False):
            lib.llama_backend_init()
            params = lib.llama_model_default_params()
            params.load_mtp = True
            self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), params)
            if not self.model:
                raise ValueError(f"{gguf_path}: llama.cpp cannot load it")
            owned.append((lib.llama_model_free, self.model))
            if lib.llama_model_n_layer_nextn(self.model) == 0:
                raise ValueError(f"{gguf_path}: has no MTP layer (export it with --with-mtp)")
            self.target = self._context(lib.LLAMA_CONTEXT_TYPE_DEFAULT, threads)
            owned.append((lib.llama_free, self.target))
            self.mtp = self._context(lib.LLAMA_CONTEXT_TYPE_MTP, threads)
            owned.append((lib.llama_free, self.mtp))
        ext.llama_set_embeddings_nextn(self.target, True, False)  # a hidden row per batch row
        ext.llama_set_embeddings_nextn(self.mtp, True, True)  # a hidden row per output row
        self.width = lib.llama_model_n_embd_out(self.model)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.drafted = self.accepted = 0

    def _context(self, kind: int, threads: int) -> Any:
        params = self.lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = (
            self.context + self.depth
        )  # the last verify's drafts
        params.n_threads = params.n_threads_batch = threads
        params.ctx_type = kind
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not make a context of type {kind}")
        return ctx

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Greedy tokens after `prompt`, from empty caches (the prefill included)."""
        memory = self.lib.llama_get_memory
        for ctx in (self.target, self.mtp):
            self.lib.llama_memory_clear(memory(ctx), True)
        # The prefill, then each step: `rows` went through the target from position `start`, its
        # first `a` rows after row 0 are accepted, `seed` is the target's greedy token after them.
        rows, start = list(prompt), 0
        hidden = self._target(rows, start, logits=len(rows) - 1)
        a = len(rows) - 1
        seed = self._greedy(self.target, a)
        out = [seed]
        while len(out) < new_tokens:
            n = start + a + 1  # the seed's position
            # MTP rows for the accepted positions (token i with the target's hidden i - 1), then the seed
            catch_up = [(rows[i], start + i, hidden[i - 1]) for i in range(1, a + 1)]
            drafts = self._draft(catch_up + [(seed, n, hidden[a])])
            rows, start = [seed, *drafts], n
            hidden = self._target(rows, start, logits=0)
            greedy = [self._greedy(self.target, i) for i in range(len(rows))]
            a = 0
            while a < len(drafts) and drafts[a] == greedy[a]:
                a += 1
            self.drafted += len(drafts)
            self.accepted += a
            self.lib.llama_memory_seq_rm(memory(self.target), 0, n + a + 1, -1)  # the rejected drafts
            self.lib.llama_memory_seq_rm(memory(self.mtp), 0, n + 1, -1)  # rows with drafted hiddens
            seed = greedy[a]
            out += [*drafts[:a], seed]
        return out[:new_tokens]

    def _target(self, tokens: list[int], start: int, logits: int) -> np.ndarray:
        """The target over `tokens` from position `start`, logits for rows from `logits` on; returns
        every row's hidden."""
        self._decode(self.target, [(t, start + i, None) for i, t in enumerate(tokens)], logits)
        hidden = self.ext.llama_get_embeddings_nextn(self.target)
        return np.ctypeslib.as_array(hidden, (len(tokens), self.width)).copy()

    def _draft(self, rows: list[tuple[int, int, np.ndarray | None]]) -> list[int]:
        """`depth` drafts: the MTP graph over `rows` drafts d_1 from the last, then reads its own."""
        drafts: list[int] = []
        pos = rows[-1][1]
        while len(drafts) < self.depth:
            self._decode(self.mtp, rows, len(rows) - 1)
            drafts.append(self._greedy(self.mtp, len(rows) - 1))
            own = self.ext.llama_get_embeddings_nextn_ith(self.mtp, len(rows) - 1)
            pos += 1
            rows = [(drafts[-1], pos, np.ctypeslib.as_array(own, (self.width,)).copy())]
        return drafts

    def _decode(self, ctx: Any, rows: list[tuple[int, int, np.ndarray | None]], logits: int) -> None:
        """One llama.cpp decode of (token, position, input hidden) rows, logits for rows from `logits` on."""
        lib = self.lib
        batch = lib.llama_batch_ext_init(ctx)
        try:
            for i, (token, pos, state) in enumerate(rows):
                ok = lib.llama_batch_ext_add_token(batch, 0, token) == i
                ok &= lib.llama_batch_ext_set_pos(batch, i, ctypes.byref(lib.llama_pos(pos)))
                if state is not None:  # the MTP graph reads a row's hidden as the token's embedding
                    data = state.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                    ok &= lib.llama_batch_ext_set_embd_token(batch, i, lib.llama_embd(data, 1, self.width))
                ok &= lib.llama_batch_ext_set_output_logits(batch, i, i >= logits)
                if not ok:
                    raise RuntimeError(f"llama.cpp refused batch row {i} (token {token}, position {pos})")
            if (rc := lib.llama_process(ctx, lib.LLAMA_PROCESS_TYPE_DECODE, batch)) != 0:
                raise RuntimeError(f"llama.cpp decode failed ({rc})")
        finally:
            lib.llama_batch_ext_free(batch)

    def _greedy(self, ctx: Any, row: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, row), (self.vocab,))))


def _free(owned: list[tuple[Any, Any]]) -> None:
    for free, handle in reversed(owned):
        free(handle)
