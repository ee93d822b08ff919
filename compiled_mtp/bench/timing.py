"""Wall-clock timing that waits for the device's queued work."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    """Wait for queued device work, so wall clocks measure it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_of(runs: int, device: str, fn: Callable[[], object]) -> float:
    """Seconds of the fastest of `runs` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)
