"""Tiny DeepSeek-V3 checkpoints with MTP layers, written the way DeepSeek releases them.

Checkpoints are written in the DeepSeek-V3 release layout (see docs/design.md, "Checkpoints"):
HF's `save_pretrained` writes the target model (routed experts as per-expert keys), then MTP layer i
is added at `model.layers.{num_hidden_layers + i}.` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and a MoE decoder layer's keys. Three kinds:
`write_checkpoint` (random weights, any config, optionally FP8 or sharded), `write_echo_checkpoint`
(drafts the target's next token) and `write_distilled_checkpoint` (drafts accepted about 60% of the
time). `read_state_dict` and `dequantize_checkpoint` read them back.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from compiled_mtp.models.checkpoint import load_model, save_checkpoint
from compiled_mtp.models.deepseek_v3 import DeepseekV3
from compiled_mtp.models.family import CausalLM

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
# Linear weights of decoder layers (target and MTP blocks) that DeepSeek releases in FP8. Not FP8:
# embeddings, heads, norms, eh_proj, the router (`mlp.gate.weight`) and `e_score_correction_bias`.
FP8_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
# tiny_config's rope: YaRN, 4x over 64 positions.
TINY_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
# What the tiny configs of every family share: 8 experts in 2 groups, the first layer dense, one MTP layer.
TINY_MOE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=256,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)
_TINY: dict[str, Any] = dict(
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    **TINY_MOE,
    rope_parameters=TINY_YARN,
    rope_interleave=True,
)


# ----------------------------------------------------------------------------- configs


def tiny_config(**overrides: Any) -> DeepseekV3Config:
    """A tiny fp32 DeepSeek-V3 config (2 layers, first dense, 8 experts, YaRN, one MTP layer).

    `num_key_value_heads` follows `num_attention_heads` unless given.
    """
    params = {**_TINY, **overrides}
    params.setdefault("num_key_value_heads", params["num_attention_heads"])
    return DeepseekV3Config(**params, dtype=torch.float32, attn_implementation="eager")


# ----------------------------------------------------------------------------- weights


@torch.no_grad()
def randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter and persistent buffer with well-conditioned random values.

    Linear weights are N(0, 1/fan_in) so activations keep unit scale; norms are U(0.5, 1.5) and
    `e_score_correction_bias` N(0, 0.1^2) so a missing norm or bias changes the output; the
    embedding is N(0, 1); lm_head is N(0, 9/H), giving logits of scale ~3 with clear top-2 gaps.
    """

    def normal(shape: torch.Size, std: float) -> Tensor:
        return torch.randn(shape, generator=gen) * std

    for name, t in module.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight"):
            value = torch.rand(t.shape, generator=gen) + 0.5
        elif name.endswith("e_score_correction_bias"):
            value = normal(t.shape, 0.1)
        elif name.endswith("embed_tokens.weight"):
            value = normal(t.shape, 1.0)
        elif name.endswith("lm_head.weight"):
            value = normal(t.shape, 3.0 / math.sqrt(t.shape[1]))
        else:  # [out, in] or fused experts [E, out, in]
            value = normal(t.shape, 1.0 / math.sqrt(t.shape[-1]))
        t.copy_(value)


def _build_model(config: Any, seed: int, model_class: type = DeepseekV3ForCausalLM) -> Any:
    """The seeded fp32 target model (all weights drawn from a generator seeded with `seed`)."""
    model = model_class(config).eval()
    randomize_(model, torch.Generator().manual_seed(seed))
    return model


def _unfuse_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as DeepSeek per-expert keys."""
    out = {}
    for key, value in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, inter = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[key] = value.detach().clone()
    return out


def _mtp_layer_state(
    model: DeepseekV3ForCausalLM,
    block: dict[str, Tensor],
    norms: dict[str, Tensor],
    eh_proj: Tensor,
    index: int,
) -> dict[str, Tensor]:
    """Keys of one MTP layer in DeepSeek layout at `model.layers.{index}.`.

    `block` is a MoE decoder layer's state dict (HF fused experts allowed); `norms` holds
    `enorm`, `hnorm` and `shared_head.norm` weights.
    """
    prefix = f"model.layers.{index}."
    state = {f"{prefix}{name}.weight": w.clone() for name, w in norms.items()}
    state[f"{prefix}eh_proj.weight"] = eh_proj.clone()
    state[f"{prefix}shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    state[f"{prefix}embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    state |= {prefix + k: v for k, v in _unfuse_experts(block).items()}
    return state


def _random_mtp_state(
    model: Any, num_mtp_layers: int, seed: int, layer_class: type = DeepseekV3DecoderLayer
) -> dict[str, Tensor]:
    """Seeded random MTP layers (MoE blocks of `layer_class`, random norms and eh_proj) for `model`."""
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    config, hidden = model.config, model.config.hidden_size
    state: dict[str, Tensor] = {}
    for i in range(num_mtp_layers):
        block = layer_class(config.get_mtp_config(), layer_idx=0)
        randomize_(block, gen)
        norms = {n: torch.rand(hidden, generator=gen) + 0.5 for n in ("enorm", "hnorm", "shared_head.norm")}
        eh_proj = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)
        state |= _mtp_layer_state(model, block.state_dict(), norms, eh_proj, config.num_hidden_layers + i)
    return state


# ----------------------------------------------------------------------------- fp8


def quantize_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Block-quantize a 2-D weight like DeepSeek-V3: (float8_e4m3fn weight, float32 scale_inv).

    scale_inv has shape [ceil(out/128), ceil(in/128)]; each 128x128 block's max |w| maps to 448.
    """
    rows, cols = weight.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = weight.new_zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def dequantize_fp8(weight: Tensor, scale_inv: Tensor) -> Tensor:
    """fp8 weight times its 128x128-block scale_inv, as float32."""
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    return weight.float() * scale


# ----------------------------------------------------------------------------- files on disk


def shard_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files (from the index when sharded), sorted."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(path / n for n in names)
    return [path / "model.safetensors"]


def rewrite_tensors(path: str | Path, edit: Callable[[Path, dict[str, Tensor]], dict[str, Tensor]]) -> None:
    """Apply `edit(file, tensors)` to every safetensors file and rebuild the index (when sharded)."""
    path, weight_map, total = Path(path), {}, 0
    for file in shard_files(path):
        tensors = edit(file, load_file(file))
        save_file(tensors, file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file.name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = path / "model.safetensors.index.json"
    if index.exists():
        meta = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index.write_text(json.dumps(meta, indent=2))


def set_config_fields(path: str | Path, remove: tuple[str, ...] = (), **fields: Any) -> None:
    """Set top-level fields of config.json (e.g. num_nextn_predict_layers=0, model_type="llama") and
    remove those named in `remove`."""
    file = Path(path) / "config.json"
    config = {k: v for k, v in json.loads(file.read_text()).items() if k not in remove} | fields
    file.write_text(json.dumps(config, indent=2, sort_keys=True))


# ----------------------------------------------------------------------------- writers


def _convert(tensors: dict[str, Tensor], dtype: torch.dtype, fp8: re.Pattern | None) -> dict[str, Tensor]:
    """Cast to `dtype` (e_score_correction_bias stays float32, as released) and FP8-quantize the
    weights `fp8` matches."""
    out = {}
    for key, value in tensors.items():
        if fp8 is not None and fp8.match(key):
            out[key], out[f"{key}_scale_inv"] = quantize_fp8(value)
        elif key.endswith("e_score_correction_bias"):
            out[key] = value.float().contiguous()
        else:
            out[key] = value.to(dtype).contiguous()
    return out


def _save(
    path: Path,
    model: DeepseekV3ForCausalLM,
    mtp_state: dict[str, Tensor],
    *,
    dtype: torch.dtype,
    max_shard_size: int | str | None,
    fp8: re.Pattern | None,
) -> Path:
    """save_pretrained, then add `mtp_state` to the last shard, cast / quantize the weights `fp8`
    matches, and patch config.json."""
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    last = shard_files(path)[-1]

    def edit(file: Path, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return _convert(tensors | mtp_state if file == last else tensors, dtype, fp8)

    rewrite_tensors(path, edit)
    fields: dict[str, Any] = {"quantization_config": FP8_QUANTIZATION_CONFIG} if fp8 is not None else {}
    set_config_fields(path, dtype=str(dtype).removeprefix("torch."), **fields)
    return path


def write_checkpoint(
    path: str | Path,
    config: DeepseekV3Config,
    *,
    seed: int = 0,
    num_mtp_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    fp8: bool = False,
) -> Path:
    """Write a seeded random DeepSeek-V3 checkpoint with `num_mtp_layers` MTP layers (0: none).

    config.json gets `num_nextn_predict_layers = num_mtp_layers`. `max_shard_size` shards the
    files (with model.safetensors.index.json; MTP keys go to the last shard). `dtype` is the
    storage dtype. `fp8=True` stores decoder-layer linear weights as float8_e4m3fn with
    `weight_scale_inv` block scales and adds `quantization_config`; such a checkpoint does not
    load in HF: compare against `read_state_dict` or load `dequantize_checkpoint`'s copy.
    """
    return write_random(
        path, config, seed, num_mtp_layers, dtype, max_shard_size, FP8_WEIGHT if fp8 else None
    )


def write_random(
    path: str | Path,
    config: Any,
    seed: int,
    num_mtp_layers: int,
    dtype: torch.dtype,
    max_shard_size: int | str | None,
    fp8: re.Pattern | None,
    classes: tuple[type, type] = (DeepseekV3ForCausalLM, DeepseekV3DecoderLayer),
) -> Path:
    """Any family's seeded random checkpoint: `classes` are HF's model and decoder layer classes."""
    config = copy.deepcopy(config)
    config.num_nextn_predict_layers = num_mtp_layers
    model = _build_model(config, seed, classes[0])
    mtp_state = _random_mtp_state(model, num_mtp_layers, seed, classes[1])
    return _save(Path(path), model, mtp_state, dtype=dtype, max_shard_size=max_shard_size, fp8=fp8)


@torch.no_grad()
def write_echo_checkpoint(
    path: str | Path,
    *,
    vocab_size: int = 97,
    hidden: int = 32,
    attn_scale: float = 0.0,
    mtp_noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    **overrides: Any,
) -> Path:
    """A high-acceptance checkpoint: the MTP layer is a copy of the 1-layer MoE target.

    `num_layers` > 1 adds target layers whose output projections are zero: they compute at full
    cost but leave the residual stream unchanged, so the target's function stays that of layer 0
    while the MTP layer costs 1/num_layers of it, as in real checkpoints (for speed benchmarks).

    Embedding rows have RMS exactly 1; the target's o_proj is scaled by `attn_scale` (0: the next
    token depends only on the current one). lm_head is built so that at attn_scale 0 the target's
    greedy successor map is one random cycle through the whole vocabulary (no early fixed point):
    row succ(x) of lm_head is the unit-normalized final hidden of token x. The MTP layer has
    enorm = hnorm = 1, eh_proj = [I | 0] (keeps the normalized embedding, drops the hidden), the
    target's layer 0 as block (plus `mtp_noise` x RMS seeded Gaussian noise per tensor) and the
    final norm as shared_head.norm, so its greedy draft equals the target's next greedy token.
    Greedy draft/target agreement (200 random tokens): ~1.0 at defaults, 0.96 / 0.84 / 0.63 at
    mtp_noise 0.1 / 0.3 / 0.5, 0.95 / 0.92 at attn_scale 1 / 2.
    `overrides` go to `tiny_config` (keep the layer count and first_k_dense_replace).
    """
    config = tiny_config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        first_k_dense_replace=0,
        num_nextn_predict_layers=1,
        **overrides,
    )
    model = _build_model(config, seed)
    for layer in model.model.layers[1:]:
        for name, weight in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                weight.zero_()
    gen = torch.Generator().manual_seed(seed + 7)
    embed = model.model.embed_tokens.weight
    embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
    model.model.layers[0].self_attn.o_proj.weight *= attn_scale
    final = model.model(torch.arange(vocab_size)[:, None]).last_hidden_state[:, 0]
    cycle = torch.randperm(vocab_size, generator=gen)
    model.lm_head.weight[cycle.roll(-1)] = final[cycle] / final[cycle].norm(dim=-1, keepdim=True)

    block = {k: v.detach().clone() for k, v in model.model.layers[0].state_dict().items()}
    for value in block.values():
        value += mtp_noise * value.pow(2).mean().sqrt() * torch.randn(value.shape, generator=gen)
    norms = {
        "enorm": torch.ones(hidden),
        "hnorm": torch.ones(hidden),
        "shared_head.norm": model.model.norm.weight.detach().clone(),
    }
    eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    mtp_state = _mtp_layer_state(model, block, norms, eh_proj, config.num_hidden_layers)
    return _save(Path(path), model, mtp_state, dtype=dtype, max_shard_size=None, fp8=None)


def write_distilled_checkpoint(
    path: str | Path, *, num_mtp_layers: int = 1, seed: int = 0, steps: int = 100, **overrides: Any
) -> Path:
    """A checkpoint whose MTP layers draft from the target's hidden and their own attention.

    The target is `write_checkpoint(tiny_config(num_hidden_layers=1, first_k_dense_replace=0,
    **overrides))`: one MoE layer with attention, so each MTP layer (same shape) starts as a copy of
    it with eh_proj = [I | R] (R seeded, scale 0.5) and is then distilled for `steps` Adam steps on
    the KL from the target's own distribution of the token it predicts (`distill_mtp`). Written
    with `save_checkpoint`; `load_model` and `load_hf` both read it.

    What the tests rely on (greedy, 6 random prompts, 24 new tokens, the defaults): drafts are
    often but not always accepted, so a changed draft changes accepted counts. Measured: accepted
    fraction per draft position about 0.6 at position 1, 0.4 at 2, 0.2 at 3 at K = 3 (each
    position accepted about 60% of the times it is reached); with two MTP layers about the same.
    """
    config = tiny_config(num_hidden_layers=1, first_k_dense_replace=0, **overrides)
    write_checkpoint(path, config, seed=seed, num_mtp_layers=num_mtp_layers)
    model = load_model(path)
    _copy_target_into_mtp_(model, torch.Generator().manual_seed(seed + 11))
    distill_mtp(model, steps, seed)
    return save_checkpoint(model, json.loads((Path(path) / "config.json").read_text()), path)


@torch.no_grad()
def _copy_target_into_mtp_(model: DeepseekV3, gen: torch.Generator) -> None:
    """Each MTP block := the target's last layer; eh_proj keeps the token's embedding and mixes in
    the hidden through a random matrix, so the draft depends on the hidden from the start."""
    first, hidden = model.cfg.num_hidden_layers, model.cfg.hidden_size
    block = model.model.layers[first - 1].state_dict()
    for j in range(model.num_mtp_layers):
        mtp = model.model.layers[first + j]
        mtp.load_state_dict(block, strict=False)
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
        mix = torch.randn(hidden, hidden, generator=gen) * 0.5 / math.sqrt(hidden)
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), mix], dim=1))


def _fresh_block(
    model: CausalLM, batch: int, length: int, layers: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """positions, write indices, slots and a zero cache for a [batch, length] block at positions 0.."""
    slots = torch.arange(batch)
    positions = torch.arange(length)[None].expand(batch, length)
    return positions, slots[:, None] * length + positions, slots, model.new_cache(layers, batch, length)


def distill_mtp(
    model: CausalLM, steps: int, seed: int, batch: int = 8, length: int = 16, lr: float = 3e-3
) -> None:
    """Train the MTP layers (target frozen) on seeded random token blocks. MTP layer j row i reads
    token t_{i+1+j} and layer j-1's hidden at row i (the target's h_i for j = 0), as the engine's
    depth j + 1 does, and learns the target's distribution of t_{i+2+j}."""
    gen = torch.Generator().manual_seed(seed + 13)
    first, layers = model.cfg.num_hidden_layers, model.num_mtp_layers
    params = [p for j in range(layers) for p in model.mtp_layer(j).parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        x = torch.randint(model.cfg.vocab_size, (batch, length), generator=gen)
        with torch.no_grad():
            h = model.forward_target(x, *_fresh_block(model, batch, length, first))
            target = F.log_softmax(model.logits(h), dim=-1)
        loss, hidden = torch.zeros(()), h
        for j in range(layers):
            rows = length - 1 - j
            hidden = model.forward_mtp(
                j, x[:, 1 + j :], hidden[:, :rows], *_fresh_block(model, batch, rows, layers)
            )
            draft = F.log_softmax(model.draft_logits(hidden), dim=-1)
            loss = loss + F.kl_div(
                draft.flatten(0, 1), target[:, 1 + j :].flatten(0, 1), log_target=True, reduction="batchmean"
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)


# ----------------------------------------------------------------------------- reading back


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint as float32, FP8 weights dequantized (their scale_inv keys dropped).

    This is the reference an engine loader's output (before its own fusing) is compared with.
    """
    raw: dict[str, Tensor] = {}
    for file in shard_files(path):
        raw |= load_file(file)
    out = {}
    for key, value in raw.items():
        if key.endswith("_scale_inv"):
            continue
        scale_inv = raw.get(f"{key}_scale_inv")
        out[key] = value.float() if scale_inv is None else dequantize_fp8(value, scale_inv)
    return out


def dequantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A float32, unsharded copy of checkpoint `src` at `dst` (FP8 dequantized), loadable by `load_hf`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    save_file(read_state_dict(src), dst / "model.safetensors", metadata={"format": "pt"})
    set_config_fields(dst, remove=("quantization_config",), dtype="float32")
    return dst
