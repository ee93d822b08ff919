"""HF transformers on a checkpoint with MTP layers (any registered family): the benchmark's baseline
and the tests' oracle.

transformers is an optional dependency (the `bench` and `test` extras); it is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

MISSING = "HF transformers is not installed: install the bench extra: pip install 'compiled_mtp[bench]'"


def transformers_version() -> str:
    """The installed transformers version; raises ModuleNotFoundError with MISSING when there is none."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(MISSING) from None
    return transformers.__version__


def load_hf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str | None = "eager",
) -> Any:
    """The checkpoint as an eval-mode HF model of its family (`DeepseekV3ForCausalLM`,
    `Glm4MoeForCausalLM`) with its MTP layers.

    HF finds MTP weights through `_keys_to_ignore_on_load_unexpected`, which it matches against the
    layer numbers of the released models (`model.layers.61.*` for DeepSeek-V3, 46 or 92 for GLM-4.5).
    The class attribute is set to one pattern per MTP layer index of this checkpoint for the load and
    restored after, and the patterns are also set on the instance so that `MtpModel.from_pretrained(model)`
    (and `generate(use_mtp=True)`) find the layers later. `attn_implementation=None` takes HF's
    default (sdpa).
    """
    transformers_version()
    import transformers

    from .models.registry import read_config

    family, cfg = read_config(Path(path) / "config.json")
    model_class = getattr(transformers, family.hf_class)
    first = cfg.num_hidden_layers
    patterns = [rf"model\.layers\.{first + i}\..*" for i in range(cfg.num_nextn_predict_layers)]
    saved = model_class._keys_to_ignore_on_load_unexpected
    model_class._keys_to_ignore_on_load_unexpected = patterns
    try:
        model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    finally:
        model_class._keys_to_ignore_on_load_unexpected = saved
    model._keys_to_ignore_on_load_unexpected = patterns
    return model.to(device).eval()


def _greedy_kwargs(ids: Tensor, max_new_tokens: int) -> dict[str, Any]:
    """`generate` keywords for exactly `max_new_tokens` greedy tokens from unpadded prompts `ids`.

    EOS stopping is off: `eos_token_id=None` as a keyword overrides the checkpoint's
    generation_config (a `GenerationConfig` object would not: its None fields get the model's
    defaults). No logits processor is active, so no token is suppressed.
    """
    return dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )


@torch.no_grad()
def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Batched greedy `generate` over equal-length prompts (no padding); the generated ids per prompt."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts: must all have the same length (HF would pad them)")
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, **_greedy_kwargs(ids, max_new_tokens))
    return out[:, ids.shape[1] :].tolist()


@contextmanager
def wrapped(cls: type, name: str, after: Callable[..., None]) -> Iterator[None]:
    """Temporarily wrap method `cls.name` so that `after(result, *args, **kwargs)` sees each call."""
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(result, *args, **kwargs)
        return result

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, original)


@torch.no_grad()
def hf_mtp_generate(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """Greedy `generate(use_mtp=True)` of one prompt (HF refuses batches): (generated ids, accepted
    drafts per verification step).

    HF drafts K = num_nextn_predict_layers tokens per step (one per MTP layer). Drafts are recorded
    by wrapping `MTPCandidateGenerator.get_candidates` for the duration of the call; its first call
    (before the prefill, no drafts) is not a step. A step's accepted count is the number of leading
    drafts equal to the generated ids at their positions, so it counts only committed drafts; every
    step is counted, the final one included. This equals HF's own `n_matches` except at a final
    step whose bonus token fell past max_new_tokens, where HF's cropped count is one lower.
    EOS stopping is off as in `hf_generate`.
    """
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    steps: list[tuple[int, list[int]]] = []

    def record(
        result: tuple[Tensor, Tensor | None], _self: Any, input_ids: Tensor, *args: Any, **kw: Any
    ) -> None:
        start = input_ids.shape[1]
        if result[0].shape[1] > start:
            steps.append((start - len(prompt), result[0][0, start:].tolist()))

    ids = torch.tensor([prompt], device=model.device)
    with wrapped(MTPCandidateGenerator, "get_candidates", record):
        out = model.generate(ids, use_mtp=True, **_greedy_kwargs(ids, max_new_tokens))
    generated = out[0, len(prompt) :].tolist()
    accepted = []
    for start, drafts in steps:
        count = 0
        while (
            count < len(drafts)
            and start + count < len(generated)
            and generated[start + count] == drafts[count]
        ):
            count += 1
        accepted.append(count)
    return generated, accepted
