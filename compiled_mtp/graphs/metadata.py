"""Per-row metadata derived inside the graph from a step's few integer inputs.

Only `slots` and the first position of each block come in; positions, cache write indices and
validity follow. Rows that must not write (padding past a prompt, positions past the cache) are sent
to the scratch slot, so a static shape never needs a data-dependent branch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_positions(first: Tensor, rows: int) -> Tensor:
    """[B] first position -> [B, rows] consecutive positions."""
    return first[:, None] + torch.arange(rows, device=first.device)


def cache_rows(
    slots: Tensor, positions: Tensor, capacity: int, scratch_slot: int, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(positions clamped into the cache, flat write index into a [slots, capacity] cache)."""
    ok = positions < capacity
    if valid is not None:
        ok = ok & valid
    # A block may have more rows than the cache has positions (a catch-up's window): the scratch
    # positions wrap, else they would run into the slot after the scratch slot.
    rows = torch.arange(positions.shape[1], device=positions.device) % capacity
    write = torch.where(ok, slots[:, None] * capacity + positions, scratch_slot * capacity + rows)
    return positions.clamp(max=capacity - 1), write
