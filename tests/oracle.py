"""HF transformers as the oracle: target logits, MTP draft logits and greedy decoding of a checkpoint.

Loading (`load_hf`) and MTP generation (`hf_mtp_generate`) are shared with the benchmark and live in
compiled_mtp/hf_baseline.py; these are the oracle's other views of a loaded model.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DeepseekV3ForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.hf_baseline import hf_generate, load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate


@torch.no_grad()
def hf_logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> Tensor:
    """Target logits [T, V] for one sequence (no cache); row t predicts tokens[t + 1]."""
    return model(torch.tensor([tokens]), use_cache=False).logits[0]


def hf_greedy(model: DeepseekV3ForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy `generate` of one prompt: exactly `max_new_tokens` ids, EOS ignored (`hf_generate`)."""
    return hf_generate(model, [prompt], max_new_tokens)[0]


@torch.no_grad()
def hf_mtp_draft_logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> Tensor:
    """Depth-1 MTP logits [T-1, V] from HF's MtpModel (its first MTP layer) over a whole sequence.

    Row i takes token tokens[i+1] and the target's post-final-norm hidden at position i
    (`hidden_states[-1]`, which HF ties to `last_hidden_state`), and predicts tokens[i+2]. As in
    HF's MTPCandidateGenerator prefill, the row's position id is i + 1 (its token's position) and
    the cache is a fresh MtpCache.
    """
    ids = torch.tensor([tokens])
    hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
    mtp = MtpModel.from_pretrained(model).eval()
    out = mtp.forward_layer(
        0,
        hidden[:, :-1],
        position_ids=torch.arange(1, len(tokens))[None],
        mtp_cache=MtpCache(config=model.config.get_mtp_config()),
        input_ids=ids[:, 1:],
    )
    return mtp._project_to_logits(out)[0]


def assert_depth_switching_matches_hf(path: str, hf: torch.nn.Module, prompts: list[list[int]]) -> None:
    """aot_eager traces what Inductor compiles (whole graphs, static shapes): every kind at K = 0 and
    3, buckets 1 and 2 (the first prompt finishes early, the second runs on in bucket 1), the depth
    switching so that M catches up. HF's greedy tokens, every graph kind replayed, no recompiles."""
    max_new = [6, 12]
    rt = Runtime.from_pretrained(
        path,
        mtp_depth=0,
        mtp_depths=(0, 3),
        batch_sizes=(1, 2),
        max_seq_len=32,
        compile_backend="aot_eager",
        cache_dir=None,
        prefill_chunk=8,
    )
    ids = [
        rt.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_new)
    ]
    got: dict[int, list[int]] = {i: [] for i in ids}
    schedule = iter((0, 0, 3, 0, 3))
    while rt.has_unfinished():
        rt.mtp_depth = next(schedule, 3)
        for out in rt.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in ids] == [hf_greedy(hf, p, n) for p, n in zip(prompts, max_new)]
    kinds = {key.kind.name for key in rt.graphs.replays}
    assert kinds == {"prefill", "draft_decode", "target_verify", "draft_extend", "mtp_catch_up"}
    assert {key.batch for key in rt.graphs.replays if key.kind.name == "target_verify"} == {1, 2}
    assert rt.stats()["recompiles"] == 0


def assert_reference_matches_hf(
    path: str, prompts: list[list[int]], new_tokens: int, depths: int = 5
) -> None:
    """The eager reference loop's greedy tokens at every depth below `depths` are HF generate's."""
    hf, ours = load_hf(path), load_model(path)
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]
    for k in range(depths):
        got = [o.token_ids for o in reference_generate(ours, prompts, new_tokens, k)]
        assert got == expected, f"K={k}"


def assert_buckets_match_hf(path: str, hf: torch.nn.Module, prompts: list[list[int]], k: int) -> None:
    """Four requests of different lengths (max_new_tokens 3, 7, 12, 16) finish at different steps, so
    the batch moves through buckets 4, 2 and 1 at depth k (eager): HF's greedy tokens."""
    max_new = [3, 7, 12, 16]
    rt = Runtime.from_pretrained(
        path,
        mtp_depth=k,
        batch_sizes=(1, 2, 4),
        max_seq_len=64,
        compile_backend="eager",
        cache_dir=None,
        prefill_chunk=8,
    )
    outs = rt.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in max_new])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, n) for p, n in zip(prompts, max_new)]
    assert {key.split("/")[1] for key in rt.stats()["graph_replays"] if "verify" in key} == {"B1", "B2", "B4"}
