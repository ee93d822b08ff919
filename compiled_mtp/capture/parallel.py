"""Builds a runtime's missing graphs in several processes at once, one per core.

A graph build is mostly single-threaded (Dynamo, AOTAutograd, Inductor's Python, one C++ compile at
a time), so on a machine with more cores than that uses, the first run's builds can overlap. Helper
processes start on the same model and settings as the runtime, so they compute the same cache keys,
and each goes through the runtime's keys from its own starting point, building what the cache
lacks; the runtime's own process goes through them from the first. The capture cache's per-key
locks make each key built once: a process that meets a key another is building waits for it, then
loads it. A helper only speeds things up: if one fails, the runtime's process builds what is left.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..graphs.plan import GraphKey, example_inputs
from . import aot

HELPER_TIMEOUT = 60.0  # seconds to wait for a helper once the runtime's own pass is done


def missing(rt: Any, keys: list[GraphKey]) -> list[GraphKey]:
    """Those of `keys` whose packages the runtime's capture cache lacks or cannot use."""
    if rt.graphs.cache is None:
        return []
    return [key for key in keys if rt.graphs.cache.problem(_artifact(rt, key)) is not None]


def _artifact(rt: Any, key: GraphKey) -> dict[str, Any]:
    inputs = example_inputs(key, rt.model, rt.prefill_chunk)
    return aot.artifact_key(key, rt.model, rt.graphs.state, inputs, rt.graphs.inductor_options)


@contextmanager
def helpers(
    rt: Any, model: str | Path, options: dict[str, Any], keys: list[GraphKey], processes: int | None = None
) -> Iterator[int]:
    """While the block readies `keys` of `rt`, helper processes (up to `processes` in all, by default
    one per core) build those its cache lacks, each from its own point in the list. Yields the number
    of helpers started (0 without a cache, a spare core, or two graphs to build)."""
    count = min((processes or os.cpu_count() or 1) - 1, len(missing(rt, keys)) - 1)
    started = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(1, count + 1):
            spec = Path(folder) / f"helper{i}.pickle"
            spec.write_bytes(pickle.dumps((str(model), options, keys, i, count + 1)))
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", __name__, str(spec)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            yield len(started)
        finally:
            for helper in started:
                try:
                    helper.wait(HELPER_TIMEOUT)
                except subprocess.TimeoutExpired:
                    helper.kill()


def ready(rt: Any, keys: list[GraphKey]) -> None:
    """Load or build the graphs of `keys`, in order."""
    rt.graphs.prepare_each(keys, lambda key: example_inputs(key, rt.model, rt.prefill_chunk))


def _helper(model: str, options: dict[str, Any], keys: list[GraphKey], index: int, processes: int) -> None:
    """Build what the cache lacks of `keys`, starting `index / processes` of the way through them."""
    import logging

    from ..runtime import Runtime

    logging.getLogger("compiled_mtp.progress").setLevel(logging.WARNING)
    rt = Runtime.from_pretrained(model, **options)
    cache = rt.graphs.cache
    assert cache is not None  # helpers start only for a runtime with a cache
    start = index * len(keys) // processes
    for key in keys[start:] + keys[:start]:
        if cache.problem(_artifact(rt, key)) is not None:
            rt.graphs.prepare(key, example_inputs(key, rt.model, rt.prefill_chunk))


if __name__ == "__main__":
    _helper(*pickle.loads(Path(sys.argv[1]).read_bytes()))
