"""Export a checkpoint to GGUF for llama.cpp: DeepSeek-V3 in its `deepseek2` architecture, GLM-4 MoE
in its `glm4moe` one.

The bench runs llama.cpp on the very weights the engine serves, and users can take a model there.
Names, metadata, the stacked experts and the split of DeepSeek's `kv_b_proj` follow llama.cpp's own
converter for each architecture; one writer serves both, a `_Layout` holding what differs.
By default the file holds the target model only; `with_mtp=True` appends the MTP layers as
llama.cpp's NextN blocks (block `num_hidden_layers + i`, `blk.N.nextn.*` for enorm, hnorm, eh_proj
and shared_head.norm, its decoder tensors under the usual block names, `nextn_predict_layers` set),
which llama.cpp's MTP graph drafts with (see llama_cpp_peer.LlamaCppMTP). Their copies of the
embedding and head are left out, as the engine's: llama.cpp then uses the target's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .checkpoint import load_model
from .registry import read_config

if TYPE_CHECKING:  # gguf is an optional dependency, imported when an export runs
    from gguf import GGMLQuantizationType, GGUFWriter

# torch dtype of the stored tensors, per the CLI's --dtype; norms, the router and its bias stay
# float32, as llama.cpp's converter keeps every 1-D tensor.
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _gguf() -> ModuleType:
    try:
        import gguf
    except ImportError:
        raise ImportError("export-gguf needs the gguf package: pip install 'compiled_mtp[gguf]'") from None
    return gguf


# The MTP layer's own tensors under llama.cpp's NextN names (the gguf package lists these for the
# GLM-4 MoE architecture; llama.cpp's deepseek2 loader reads the same names).
_NEXTN = {
    "enorm": "NEXTN_ENORM",
    "hnorm": "NEXTN_HNORM",
    "eh_proj": "NEXTN_EH_PROJ",
    "shared_head.norm": "NEXTN_SHARED_HEAD_NORM",
}


def export_gguf(checkpoint: str | Path, out: str | Path, dtype: str = "f32", with_mtp: bool = False) -> Path:
    """Write `checkpoint`'s target model (FP8 weights dequantized) to the GGUF file `out`, and its
    MTP layers too with `with_mtp`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf = _gguf()
    checkpoint, out = Path(checkpoint), Path(out)
    family, cfg = read_config(checkpoint / "config.json")
    layout = LAYOUTS.get(family.model_type)
    if layout is None:
        raise ValueError(
            f"{checkpoint}: is {family.name} ({family.model_type}); llama.cpp's GGUF has no "
            f"{family.name} architecture in this gguf package (export-gguf writes {_supported()})"
        )
    if with_mtp and cfg.num_nextn_predict_layers == 0:
        raise ValueError(
            f"{checkpoint}: has no MTP layers (num_nextn_predict_layers is 0); export it without them"
        )
    model = load_model(checkpoint, with_mtp=with_mtp)
    cfg = model.cfg
    arch = gguf.MODEL_ARCH[layout.arch]
    # Written beside `out` and moved into place whole: a failed export leaves no partial file.
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), gguf.MODEL_ARCH_NAMES[arch])
    try:
        _write_parameters(writer, gguf, cfg, dtype)
        layout.parameters(writer, gguf, cfg)
        _write_vocab(writer, gguf, checkpoint, cfg)
        _write_tensors(writer, gguf, model, layout, arch, checkpoint, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return out


def _write_tensors(
    writer: GGUFWriter, gguf: ModuleType, model: Any, layout: _Layout, arch: Any, checkpoint: Path, dtype: str
) -> None:
    """Every parameter under llama.cpp's name for it in `arch`, as `layout` splits it."""
    cfg = model.cfg
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    for name, tensor in model.state_dict().items():
        for hf_name, part in layout.split(_hf_name(name), tensor, cfg):
            gguf_name = _nextn_name(gguf, hf_name, cfg) or names.get_name(
                hf_name, try_suffixes=(".weight", ".bias")
            )
            if gguf_name is None:
                raise ValueError(
                    f"{checkpoint}: tensor {hf_name!r} has no GGUF name in llama.cpp's "
                    f"{gguf.MODEL_ARCH_NAMES[arch]} layout"
                )
            stored = part.float() if part.dim() == 1 else part.to(DTYPES[dtype])
            writer.add_tensor(
                gguf_name,
                stored.contiguous().view(_raw(stored.dtype)).numpy(),
                raw_dtype=_gguf_type(gguf, stored.dtype),
            )


def _nextn_name(gguf: ModuleType, name: str, cfg: Any) -> str | None:
    """`model.layers.{L + i}.enorm.weight` -> `blk.{L + i}.nextn.enorm.weight`; None for any other."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or int(parts[2]) < cfg.num_hidden_layers:
        return None
    key = _NEXTN.get(".".join(parts[3:-1]))
    if key is None:
        return None
    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]].format(bid=parts[2]) + "." + parts[-1]


def _hf_name(name: str) -> str:
    """The engine's parameter name as llama.cpp's name tables know it: the router's bias as
    `e_score_correction.bias`, stacked experts as weights."""
    if name.endswith("e_score_correction_bias"):
        return name.replace("_bias", ".bias")
    if name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
        return name + ".weight"
    return name


def _as_is(name: str, tensor: Tensor, cfg: Any) -> Iterator[tuple[str, Tensor]]:
    yield name, tensor


def _split_mla(name: str, tensor: Tensor, cfg: Any) -> Iterator[tuple[str, Tensor]]:
    """llama.cpp runs MLA absorbed: kv_b_proj becomes k_b (per head, transposed) and v_b."""
    if not name.endswith("kv_b_proj.weight"):
        yield name, tensor
        return
    dn = cfg.qk_nope_head_dim
    kv_b = tensor.view(cfg.num_attention_heads, dn + cfg.v_head_dim, cfg.kv_lora_rank)
    yield name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :dn].transpose(1, 2)
    yield name.replace("kv_b_proj", "v_b_proj"), kv_b[:, dn:]


def _raw(dtype: torch.dtype) -> torch.dtype:
    """numpy has no bfloat16: bf16 tensors travel as their raw 16-bit words."""
    return torch.int16 if dtype == torch.bfloat16 else dtype


def _gguf_type(gguf: ModuleType, dtype: torch.dtype) -> GGMLQuantizationType:
    return {
        torch.float32: gguf.GGMLQuantizationType.F32,
        torch.float16: gguf.GGMLQuantizationType.F16,
        torch.bfloat16: gguf.GGMLQuantizationType.BF16,
    }[dtype]


def _write_parameters(writer: GGUFWriter, gguf: ModuleType, cfg: Any, dtype: str) -> None:
    """The metadata both architectures read alike: sizes, the sigmoid router, the file type."""
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    writer.add_block_count(blocks)  # llama.cpp counts NextN blocks in the block count
    if cfg.num_nextn_predict_layers:
        writer.add_nextn_predict_layers(cfg.num_nextn_predict_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace if cfg.n_routed_experts else blocks)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size or cfg.intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    if cfg.n_routed_experts:
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    }
    writer.add_file_type(file_types[dtype])


def _deepseek2_parameters(writer: GGUFWriter, gguf: ModuleType, cfg: Any) -> None:
    """MLA's ranks and head sizes, its rotary width and YaRN."""
    writer.add_head_count_kv(1)  # MLA runs as one shared latent "head" in llama.cpp
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    if cfg.rope.type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope.factor)
        writer.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)
        writer.add_rope_scaling_yarn_log_mul(
            0.1 * cfg.rope.mscale_all_dim
        )  # llama.cpp's deepseek2 convention


def _glm4moe_parameters(writer: GGUFWriter, gguf: ModuleType, cfg: Any) -> None:
    """Grouped-query heads of head_dim, rotary on each head's leading partial_rotary_factor share."""
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.rotary_dim)


@dataclass(frozen=True)
class _Layout:
    """What one llama.cpp architecture needs beyond the shared writer."""

    arch: str  # the gguf package's MODEL_ARCH member
    split: Callable[[str, Tensor, Any], Iterator[tuple[str, Tensor]]]  # an HF tensor -> its GGUF parts
    parameters: Callable[[GGUFWriter, ModuleType, Any], None]  # the architecture's own metadata


# model_type -> its llama.cpp architecture
LAYOUTS = {
    "deepseek_v3": _Layout("DEEPSEEK2", _split_mla, _deepseek2_parameters),
    "glm4_moe": _Layout("GLM4_MOE", _as_is, _glm4moe_parameters),
}


def _supported() -> str:
    return " and ".join(sorted(LAYOUTS))


def _write_vocab(writer: GGUFWriter, gguf: ModuleType, checkpoint: Path, cfg: Any) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp's "gpt2" tokenizer; without one, token ids only."""
    path = checkpoint / "tokenizer.json"
    if not path.exists():
        writer.add_tokenizer_model("none")
        return
    spec = json.loads(path.read_text())
    if spec["model"]["type"] != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"{path}: only byte-level BPE tokenizers export to GGUF, got {spec['model']['type']}"
        )
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    for text, i in {**vocab, **special}.items():
        if i < cfg.vocab_size:
            tokens[i], types[i] = text, gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    writer.add_add_bos_token(False)
