"""The step plan: which graphs the engine runs, keyed (kind, B, K), and the step tensors each takes.

Runtime._decode runs a step by its `step_plan`; `graph_keys` (what a runtime may call: what capture
builds and the progress lines count) and `example_inputs` (what a graph is built for ahead of its
first call) read the same plan, so a new graph kind or a changed step touches this module and the
runtime's call of it only.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, member
from typing import Any, NamedTuple

import torch

from ..models.family import CausalLM
from . import steps
from .state import LAG_WINDOW


class GraphKind(Enum):
    """A step function the engine captures. The member's name is how keys, logs and the capture
    cache's file names spell the kind."""

    prefill = member(steps.prefill)
    draft_decode = member(steps.draft_decode)
    target_verify = member(steps.target_verify)
    draft_extend = member(steps.draft_extend)
    mtp_catch_up = member(steps.mtp_catch_up)
    mtp_fill = member(steps.mtp_fill)

    # A member is its only instance, so its identity hashes it as well as Enum's Python-level hash of
    # its name does: the graphs are looked up by key at every decode step, on the caches they empty.
    __hash__ = object.__hash__

    @property
    def step(self) -> Callable[..., Any]:
        """The step function: step(model, state, *step tensors)."""
        return self.value


class GraphKey(NamedTuple):
    """One graph: a step function at fixed shapes, batch bucket B and draft depth K."""

    kind: GraphKind
    batch: int
    depth: int

    @property
    def name(self) -> str:
        """The key as logs, stats and `compiled-mtp inspect` print it: "target_verify/B4/K3"."""
        return f"{self.kind.name}/B{self.batch}/K{self.depth}"

    @property
    def uniforms(self) -> int:
        """Uniforms per request the graph takes: one per draft it samples, one per accept test and one
        for the target's own token."""
        return {
            GraphKind.prefill: 2,  # t_n, d_1
            GraphKind.draft_decode: self.depth - 1,  # d_2..d_K
            GraphKind.target_verify: self.depth + 1,  # K accept tests, then the bonus or correction token
            GraphKind.draft_extend: self.depth,  # the next step's d_1..d_K
            GraphKind.mtp_catch_up: 1,  # a fresh d_1
            GraphKind.mtp_fill: 0,  # nothing is drafted
        }[self.kind]


# Prompts go through prefill one at a time, one fixed-size chunk per call.
PREFILL = GraphKey(GraphKind.prefill, 1, 0)


@dataclass(frozen=True)
class StepPlan:
    """The graphs of one decode step of a bucket at depth K, in the order they run; None where the
    depth runs none of that kind. `catch_up` (K > 0) or `fill` (K = 0) runs first, and only when some
    request's MTP layer lags behind (depth-0 steps skip it): before a step at K > 0, or, writing M's
    cache alone, once the lag fills the window."""

    catch_up: GraphKey | None
    fill: GraphKey | None
    draft_decode: GraphKey | None
    target_verify: GraphKey
    draft_extend: GraphKey | None

    @functools.cached_property
    def keys(self) -> tuple[GraphKey, ...]:
        """The graphs the step may run, in order."""
        return tuple(
            key
            for key in (self.catch_up, self.fill, self.draft_decode, self.target_verify, self.draft_extend)
            if key
        )

    @functools.cached_property
    def columns(self) -> tuple[slice, ...]:
        """Where draft_decode's, target_verify's and draft_extend's uniforms sit among the step's
        (empty for a graph that does not run): a step draws each request's at once."""
        widths = [
            key.uniforms if key else 0 for key in (self.draft_decode, self.target_verify, self.draft_extend)
        ]
        return tuple(slice(end - width, end) for width, end in zip(widths, itertools.accumulate(widths)))

    @functools.cached_property
    def uniforms(self) -> int:
        """Uniforms per request the step draws (the catch-up draws its own)."""
        return self.columns[-1].stop


@functools.cache
def step_plan(batch: int, depth: int, depths: tuple[int, ...]) -> StepPlan:
    """The plan of a decode step of `batch` (a bucket) at `depth`, on a runtime with these depths:
    draft_decode drafts d_2..d_K (K >= 2) where the last step drafted fewer, target_verify checks
    d_1..d_K, draft_extend drafts the next step's d_1..d_K (K >= 1). A depth-0 step is target_verify
    alone; on a runtime that also speculates, mtp_catch_up later runs M over the positions it skipped
    and drafts d_1 before a step at K > 0, and mtp_fill writes M's cache there when the batch stays at
    depth 0 (each one graph per bucket, keyed K = 0)."""

    def key(kind: GraphKind, runs: bool = True) -> GraphKey | None:
        return GraphKey(kind, batch, depth) if runs else None

    mixed = 0 in depths and max(depths) > 0
    return StepPlan(
        # Its shapes do not depend on the step's depth: one graph per bucket serves them all.
        catch_up=GraphKey(GraphKind.mtp_catch_up, batch, 0) if mixed and depth > 0 else None,
        fill=GraphKey(GraphKind.mtp_fill, batch, 0) if mixed and depth == 0 else None,
        draft_decode=key(GraphKind.draft_decode, depth >= 2),
        target_verify=GraphKey(GraphKind.target_verify, batch, depth),
        draft_extend=key(GraphKind.draft_extend, depth >= 1),
    )


def graph_keys(batch_sizes: Sequence[int], depths: Sequence[int]) -> list[GraphKey]:
    """Every graph a runtime with these buckets and depths may call, each once: prefill, then per
    bucket the graphs of its steps at each depth."""
    depths = tuple(depths)
    keys = [key for b in batch_sizes for k in depths for key in step_plan(b, k, depths).keys]
    return [PREFILL, *dict.fromkeys(keys)]


def example_inputs(key: GraphKey, model: CausalLM, prefill_chunk: int) -> tuple[torch.Tensor, ...]:
    """Step tensors with the shapes and dtypes Runtime._prefill and Runtime._decode pass for `key`
    (values do not matter: export traces shapes)."""
    kind, b, k = key
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype

    def ids(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=device)

    noise = torch.zeros(b, key.uniforms, device=device)
    slots, lens = ids(b), ids(b)
    if kind is GraphKind.prefill:  # tokens, next tokens, slot, start, prompt length
        return ids(1, prefill_chunk), ids(1, prefill_chunk), slots, ids(1), ids(1), noise
    if kind is GraphKind.draft_extend:  # accepted counts, committed tokens, T's hiddens
        hidden = torch.zeros(b, k + 1, model.hidden_width, dtype=dtype, device=device)
        return slots, lens, ids(b), ids(b, k + 1), hidden, noise
    if kind is GraphKind.mtp_catch_up:  # lags, the committed tokens of the window
        return slots, lens, ids(b), ids(b, LAG_WINDOW), noise
    if kind is GraphKind.mtp_fill:
        return slots, lens, ids(b), ids(b, LAG_WINDOW)
    if kind is GraphKind.draft_decode:  # the drafts each request has
        return slots, lens, ids(b), noise
    return slots, lens, noise  # target_verify
