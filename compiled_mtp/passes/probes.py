"""Probe inputs for the sampling passes: logits and sampling parameters that make every parameter
matter, so that the region and the op agree under one assignment of the [B] inputs only."""

from __future__ import annotations

import torch

# (temperature, top_k, top_p) of probe rows: greedy, temperature-only, top-k, top-p, mixes, chosen so
# that swapping temperature and top_p changes the distribution a lot (a top_p >= 1 keeps every
# token, a top_p near 0 acts greedy): probe rows tell the two [B] float inputs apart.
_PROBE_PARAMS = [
    (0.0, 0, 1.0),
    (4.0, 0, 1.0),
    (3.0, 0, 0.3),
    (2.0, 5, 1.0),
    (1.0, 0, 0.5),
    (3.0, 0, 1.0),
    (0.8, 3, 0.9),
    (2.5, 0, 0.6),
]
_PROBE_ROWS = 32
_LIVE_TOKENS = 16


def probe_rounds(batch: int) -> int:
    """How many probes of `batch` rows make up _PROBE_ROWS rows: two at the least."""
    return max(2, -(-_PROBE_ROWS // batch))


def probe_logits(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A few live tokens per row and the rest far below: the draws depend on every parameter, and the
    steps of the CDF are wide, so rounding in the region's sums never decides a token."""
    logits = torch.full(shape, -40.0)
    live = torch.rand(shape, generator=gen).argsort(-1)[..., :_LIVE_TOKENS]
    return logits.scatter_(-1, live, 1.5 * torch.randn(live.shape, generator=gen))


def probe_params(batch: int, probe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) [batch] of probe `probe`, cycling rows through _PROBE_PARAMS."""
    params = [_PROBE_PARAMS[(row + probe) % len(_PROBE_PARAMS)] for row in range(batch)]
    temperature, top_k, top_p = (torch.tensor(v) for v in zip(*params))
    return temperature.float(), top_k.long(), top_p.float()
