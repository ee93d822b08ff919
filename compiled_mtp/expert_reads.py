"""How many of a MoE layer's routed experts a step's rows read, measured on text: the bandwidth
bound's term for rows that route apart.

One row reads the k experts it is routed to; rows that route apart read the union of their choices
(the group_experts pass reads each chosen expert once). A K-step's verify runs B (K + 1) rows through
every target layer: K + 1 consecutive positions of each of B requests. Each of its draft steps runs
B rows, one a request, through an MTP layer's experts: the draft extend too, whose other rows only
write their cache entries, except where the family's MTP block runs every row through its experts
(DeepSeek-V4's), which then reads the same rows' union in MTP layer 0. How far rows' choices
overlap depends on the text, so it is measured: an eager pass over each prompt records every MoE
layer's choices at every position, and a step's union is the mean over B prompts' aligned windows of
as many positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .models.family import CausalLM


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether `module` holds a layer's routed experts: every family stacks them in one module whose
    own parameters are all [E, ...] over the same E, and that is called as (x, idx, weights)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() == 3 for p in own) and len({p.shape[0] for p in own}) == 1


@dataclass
class Reader:
    """A MoE layer's routed experts, and which of them each position chose on the recorded prompts."""

    experts: nn.Module
    chosen: Tensor  # [prompts, positions, experts] bool

    def expert_count(self) -> int:
        return self.chosen.shape[-1]


@dataclass
class Routing:
    target: list[Reader]  # the target's MoE layers, in order
    drafts: list[Reader | None]  # draft depth j's: MTP layer j % (MTP layers)'s (None: it is dense)


def experts_read(chosen: Tensor, batch: int, rows: int) -> float:
    """The mean count of experts that `batch` requests' windows of `rows` consecutive positions choose
    together: the prompts taken `batch` at a time in order (as the bench batches them), every aligned
    window of each batch."""
    prompts, positions, experts = chosen.shape
    if prompts < batch or positions < rows:
        raise ValueError(
            f"routing of {prompts} prompts of {positions} positions has no {batch} x {rows} window"
        )
    windows = chosen.unfold(1, rows, 1).any(-1)  # [prompts, windows, experts]
    groups = windows[: prompts // batch * batch].view(prompts // batch, batch, -1, experts).any(1)
    return groups.sum(-1).float().mean().item()


def one_hot(idx: Tensor, expert_count: int) -> Tensor:
    """[positions, k] expert indices -> [positions, experts] bool."""
    return torch.zeros(len(idx), expert_count, dtype=torch.bool).scatter_(1, idx, True)


Calls = list[tuple[nn.Module, Tensor]]  # (stacked experts, [positions, experts] bool), in call order


class _Choices:
    """Forward pre-hooks on stacked experts that keep each call's choices."""

    def __init__(self, stacked: list[nn.Module]) -> None:
        self.expert_count = next(stacked[0].parameters()).shape[0]
        self.calls: list[tuple[nn.Module, Tensor]] = []
        self.hooks = [
            m.register_forward_pre_hook(lambda m, args: self.calls.append((m, args[1]))) for m in stacked
        ]

    def take(self) -> Calls:
        """The calls since the last take."""
        calls, self.calls = self.calls, []
        return [(m, one_hot(idx.cpu(), self.expert_count)) for m, idx in calls]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def record(model: CausalLM, prompts: Sequence[Sequence[int]], depths: int) -> Routing:
    """The choices of every MoE layer at every position of each prompt (of equal lengths): the target
    over the prompt, then draft depths 0..`depths` - 1 as the reference loop chains them, depth j on
    the prompt's tokens from j + 1 on and depth j - 1's hiddens (depth 0: the target's)."""
    stacked = [m for m in model.modules() if is_stacked_experts(m)]
    if not stacked:
        return Routing([], [None] * depths)
    choices = _Choices(stacked)
    try:
        calls = [_prompt_calls(model, choices, prompt, depths) for prompt in prompts]
    finally:
        choices.close()
    by_depth = [_readers([depth_calls[j] for _, depth_calls in calls]) for j in range(depths)]
    return Routing(_readers([target for target, _ in calls]), [r[0] if r else None for r in by_depth])


def _prompt_calls(
    model: CausalLM, choices: _Choices, prompt: Sequence[int], depths: int
) -> tuple[Calls, list[Calls]]:
    """One prompt's calls: the target's, and each draft depth's."""
    device = model.lm_head.weight.device
    ids = torch.tensor([list(prompt)], device=device)
    length = ids.shape[1]
    slot = torch.zeros(1, dtype=torch.long, device=device)
    pos = torch.arange(length, device=device)[None]
    hidden = model.forward_target(
        ids, pos, pos, slot, model.new_cache(model.cfg.num_hidden_layers, 1, length)
    )
    target, drafts = choices.take(), []
    for j in range(depths):
        rows = pos[:, j : length - 1]  # depth j's row i sits at position i + j, as in the loop
        cache = model.new_cache(model.num_mtp_layers, 1, length)
        layer = j % model.num_mtp_layers
        hidden = model.forward_mtp(
            layer, ids[:, j + 1 :], hidden[:, : rows.shape[1]], rows, rows, slot, cache
        )
        drafts.append(choices.take())
    return target, drafts


def _readers(per_prompt: list[Calls]) -> list[Reader]:
    """One Reader per call position, its choices stacked over the prompts."""
    return [Reader(calls[0][0], torch.stack([chosen for _, chosen in calls])) for calls in zip(*per_prompt)]
