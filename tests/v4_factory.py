"""Test fixtures for DeepSeek-V4 (`deepseek_v4`): tiny checkpoints written by HF, and an MTP oracle built
from HF's own V4 modules.

HF's `save_pretrained` writes the target in DeepSeek's key names (`model.layers.i.attn.wq_a.weight`,
`ffn.experts.{e}.w1.weight`, `head.weight`, ...) and drops the MTP layer, so the MTP layer
(`mtp.0.*`, as DeepSeek publishes it) is added here: its block's keys are those HF writes for a
one-layer model with sliding attention and score-routed MoE, plus `e_proj`, `h_proj`, `enorm`, `hnorm`,
`norm` and `hc_head_{fn,base,scale}`. `hf_mtp_oracle` reads them back into HF modules.

`write_published_v4` rewrites such a checkpoint as DeepSeek publishes V4 (`embed.weight`,
`layers.{i}.attn.kv_norm.weight`, `hc_head_fn`, ...), optionally quantized the way DeepSeek's own
inference code reads it: FP8 e4m3 linears with power-of-two (float8_e8m0fnu) block scales in
`*.scale`, routed experts FP8 the same way or FP4 (e2m1 codes two to an int8, low nibble first, a scale
per 32 inputs of a row).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from compiled_mtp.models.checkpoint import load_model, save_checkpoint
from tests import checkpoints

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_MTP_EXTRA = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight")
# The MTP layer's hc_head keys -> the target's, as HF writes them.
_MTP_HEAD = {f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}
_TINY: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    partial_rotary_factor=0.5,
    n_routed_experts=8,
    num_experts_per_tok=2,
    layer_types=[SLIDING, CSA, HCA],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8},
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    sliding_window=6,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=2,
    swiglu_limit=1.0,
    max_position_embeddings=256,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)


def v4_config(**overrides: Any) -> DeepseekV4Config:
    """A tiny fp32 DeepSeek-V4 config: 3 layers (sliding + hash MoE, CSA, HCA), window 6, CSA over 4
    positions with top-2 of its entries, HCA over 8, 4 streams, SwiGLU clamped at 1, one MTP layer."""
    return DeepseekV4Config(**{**_TINY, **overrides}, dtype=torch.float32, attn_implementation="eager")


@st.composite
def v4_config_strategy(draw: st.DrawFn) -> DeepseekV4Config:
    """Tiny configs over the layer-type and hash-layer mix, windows and compression rates shorter than
    the tests' prompts, index top-k, streams and Sinkhorn iterations, rope widths and head groups."""
    n = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.sampled_from([4, 8]))
    return v4_config(
        num_hidden_layers=n,
        layer_types=draw(st.lists(st.sampled_from([SLIDING, CSA, HCA]), min_size=n, max_size=n)),
        mlp_layer_types=["hash_moe"] * (k := draw(st.integers(0, n))) + ["moe"] * (n - k),
        num_attention_heads=heads,
        head_dim=draw(st.sampled_from([8, 16])),
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5])),
        o_groups=draw(st.sampled_from([1, 2])),
        n_routed_experts=experts,
        num_experts_per_tok=draw(st.integers(1, 3)),
        compress_rates={CSA: draw(st.integers(2, 4)), HCA: draw(st.integers(3, 8))},
        sliding_window=draw(st.integers(2, 8)),
        index_topk=draw(st.integers(1, 3)),
        index_head_dim=draw(st.sampled_from([8, 16])),
        hc_mult=draw(st.sampled_from([2, 4])),
        hc_sinkhorn_iters=draw(st.sampled_from([1, 3, 20])),
        swiglu_limit=draw(st.sampled_from([0.5, 10.0])),
        scoring_func=draw(st.sampled_from(["sqrtsoftplus", "sigmoid"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 1.5])),
    )


def random_hf_model(config: DeepseekV4Config, seed: int) -> DeepseekV4ForCausalLM:
    """checkpoints' seeded random weights; each token's hash experts distinct, drawn at random."""
    model = checkpoints._build_model(config, seed, DeepseekV4ForCausalLM)
    gen = torch.Generator().manual_seed(seed + 7)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("tid2eid"):
            ranks = torch.rand(config.vocab_size, config.n_routed_experts, generator=gen).argsort(-1)
            t.data.copy_(ranks[:, : config.num_experts_per_tok])
    return model


def _mtp_block_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """A one-layer copy of `config` whose layer is the MTP block: sliding attention, score-routed MoE."""
    block = copy.deepcopy(config)
    block.num_hidden_layers = 1
    block.layer_types, block.mlp_layer_types = [SLIDING], ["moe"]
    return block


def write_v4_checkpoint(
    path: str | Path, config: DeepseekV4Config, *, seed: int = 0, num_mtp_layers: int = 1
) -> Path:
    """HF's save_pretrained of a seeded random target, plus `num_mtp_layers` random MTP layers."""
    path = Path(path)
    config = copy.deepcopy(config)
    config.num_nextn_predict_layers = num_mtp_layers
    random_hf_model(config, seed).save_pretrained(path)
    mtp: dict[str, Tensor] = {}
    hidden, hc = config.hidden_size, config.hc_mult
    for i in range(num_mtp_layers):
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        with tempfile.TemporaryDirectory() as tmp:
            random_hf_model(_mtp_block_config(config), seed + 1000 + i).save_pretrained(tmp)
            block = load_file(str(Path(tmp) / "model.safetensors"))
        mtp |= {
            f"mtp.{i}.{k[len('model.layers.0.') :]}": v
            for k, v in block.items()
            if k.startswith("model.layers.0.")
        }
        for name in ("e_proj", "h_proj"):
            mtp[f"mtp.{i}.{name}.weight"] = torch.randn(hidden, hidden, generator=gen) / math.sqrt(hidden)
        for name in ("enorm", "hnorm", "norm"):
            mtp[f"mtp.{i}.{name}.weight"] = torch.rand(hidden, generator=gen) + 0.5
        mtp[f"mtp.{i}.hc_head_fn"] = torch.randn(hc, hc * hidden, generator=gen) / math.sqrt(hc * hidden)
        mtp[f"mtp.{i}.hc_head_base"] = torch.randn(hc, generator=gen) / math.sqrt(hc)
        mtp[f"mtp.{i}.hc_head_scale"] = torch.randn(1, generator=gen)
    checkpoints.rewrite_tensors(path, lambda file, tensors: tensors | mtp)
    return path


class HFMtpOracle:
    """MTP layer 0 of a checkpoint from HF's own V4 modules: a one-layer DeepseekV4ForCausalLM whose
    DeepseekV4DecoderLayer (sliding attention, MoE), DeepseekV4HyperHead and final norm hold the
    MTP block, hc_head and norm, with DeepseekV4RMSNorm enorm / hnorm (float32, as HF keeps its norms)
    and e_proj / h_proj beside, in `dtype` (the target's)."""

    def __init__(
        self, path: str | Path, target: DeepseekV4ForCausalLM, dtype: torch.dtype = torch.float32
    ) -> None:
        tensors = load_file(str(Path(path) / "model.safetensors"))
        mtp = {k[len("mtp.0.") :]: v for k, v in tensors.items() if k.startswith("mtp.0.")}
        keys = {
            "model.embed_tokens.weight": tensors["model.embed_tokens.weight"],
            "head.weight": tensors["head.weight"],
        }
        keys["model.norm.weight"] = mtp["norm.weight"]
        keys |= {hf: mtp[name] for name, hf in _MTP_HEAD.items()}
        extra = {*_MTP_EXTRA, *_MTP_HEAD}
        keys |= {f"model.layers.0.{k}": v for k, v in mtp.items() if k not in extra}
        config = _mtp_block_config(target.config)
        with tempfile.TemporaryDirectory() as tmp:
            save_file(keys, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            (Path(tmp) / "config.json").write_text(json.dumps(config.to_dict()))
            self.block = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        self.target = target
        self.window = config.sliding_window
        self.norms = {}
        for name in ("enorm", "hnorm"):
            self.norms[name] = DeepseekV4RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.norms[name].weight.data.copy_(mtp[f"{name}.weight"])
        self.e_proj, self.h_proj = mtp["e_proj.weight"].to(dtype), mtp["h_proj.weight"].to(dtype)

    @torch.no_grad()
    def draft_logits(self, tokens: list[int]) -> Tensor:
        """Depth-1 MTP logits [T-1, V]: row i takes tokens[i+1] and T's pre-hc_head streams at i."""
        ids = torch.tensor([tokens])
        captured: list[Tensor] = []
        hook = self.target.model.hc_head.register_forward_hook(lambda m, args, out: captured.append(args[0]))
        self.target(ids, use_cache=False)
        hook.remove()
        streams, nxt = captured[0][:, :-1], ids[:, 1:]
        model = self.block.model
        e = torch.nn.functional.linear(self.norms["enorm"](model.embed_tokens(nxt)), self.e_proj)
        x = e[:, :, None] + torch.nn.functional.linear(self.norms["hnorm"](streams), self.h_proj)
        n = x.shape[1]
        pos = torch.arange(n)[None]
        q, k = pos[0, :, None], pos[0, None, :]
        mask = torch.zeros(1, 1, n, n).masked_fill(~((k <= q) & (k > q - self.window)), float("-inf"))
        embeds = {
            kind: model.rotary_emb(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")
        }
        out = model.layers[0](
            x, input_ids=nxt, position_embeddings=embeds, position_ids=pos, attention_mask=mask
        )
        return self.block.lm_head(model.norm(model.hc_head(out)))[0]


def write_v4_distilled_checkpoint(
    path: str | Path, *, seed: int = 0, steps: int = 100, **overrides: Any
) -> Path:
    """A V4 checkpoint whose MTP layer drafts often but not always right: one CSA target layer with
    score routing, the MTP layer a copy of it without the compressor and indexer (e_proj the
    identity, h_proj a random mix of the target's streams, the target's hc_head and norm)
    distilled on the target's distribution for `steps` Adam steps (checkpoints.distill_mtp).

    What the tests rely on (greedy, 6 random prompts x 24 new tokens, bucket 1): at K = 1 the share
    of drafts accepted is 0.6 to 0.85 by the seed (seed 1: 0.73 on test_deepseek_v4's prompts); more
    steps do not raise it (the MTP layer sees the window only, the target the compressed entries too).
    """
    config = v4_config(num_hidden_layers=1, layer_types=[CSA], mlp_layer_types=["moe"], **overrides)
    write_v4_checkpoint(path, config, seed=seed)
    model = load_model(path)
    gen = torch.Generator().manual_seed(seed + 11)
    hidden = model.cfg.hidden_size
    with torch.no_grad():
        mtp = model.mtp_layer(0)
        mtp.load_state_dict(model.model.layers[-1].state_dict(), strict=False)
        mtp.e_proj.weight.copy_(torch.eye(hidden))
        mtp.h_proj.weight.copy_(torch.randn(hidden, hidden, generator=gen) * 0.5 / math.sqrt(hidden))
        for norm in (mtp.enorm, mtp.hnorm):
            norm.weight.fill_(1.0)
        mtp.norm.weight.copy_(model.model.norm.weight)
        mtp.hc_head_fn.copy_(model.model.hc_head.hc_fn)
        mtp.hc_head_base.copy_(model.model.hc_head.hc_base)
        mtp.hc_head_scale.copy_(model.model.hc_head.hc_scale)
    checkpoints.distill_mtp(model, steps, seed)
    return save_checkpoint(model, json.loads((Path(path) / "config.json").read_text()), path)


# ----------------------------------------------------------------------------- DeepSeek's published layout

# HF save_pretrained's top-level keys -> DeepSeek's (transformers' conversion_mapping "deepseek_v4").
_PUBLISHED_TOP = {"model.embed_tokens.": "embed.", "model.norm.": "norm.", "model.hc_head.hc_": "hc_head_"}
# What DeepSeek quantizes: the linears FP8 (HF's V4 keeps the compressors and the indexer's
# weights_proj in bf16), the routed experts FP8 or FP4.
_FP8_LINEAR = re.compile(r".*\.(wq_a|wq_b|wkv|wo_a|wo_b|shared_experts\.w[123]|e_proj|h_proj)\.weight$")
_ROUTED_EXPERT = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight$")
_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX, FP4_MAX, FP4_GROUP = 448.0, 6.0, 32


def published_key(key: str) -> str:
    """DeepSeek's name for a key HF's save_pretrained writes."""
    for hf, published in _PUBLISHED_TOP.items():
        if key.startswith(hf):
            return published + key[len(hf) :]
    if key.startswith("model.layers."):
        key = key[len("model.") :]
    return key.replace(".attn.norm.", ".attn.kv_norm.")


def _power_of_two_scale(amax: Tensor, top: float) -> Tensor:
    """The smallest power of two s with amax / s <= top (1 for an all-zero block), as ue8m0 holds."""
    return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / top))), torch.ones_like(amax))


def quantize_fp8_ue8m0(w: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """(e4m3 weight, float8_e8m0fnu scale [ceil(rows/br), ceil(cols/bc)], the float32 values they
    stand for) of a 2-D weight; edge blocks may be partial."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = w.new_zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    scale = _power_of_two_scale(padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3)), FP8_MAX)
    per_element = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    q = (w.float() / per_element).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu), q.float() * per_element


def _e2m1_value(code: Tensor) -> Tensor:
    """An e2m1 code's value from its bits: sign, two exponent bits (bias 1), one mantissa bit."""
    sign = 1.0 - 2.0 * ((code >> 3) & 1).float()
    exponent, mantissa = ((code >> 1) & 3).float(), (code & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    return sign * magnitude


def quantize_fp4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(int8 [rows, cols / 2] of e2m1 codes, the even column's in the low nibble, float8_e8m0fnu
    scale [rows, cols / 32], the float32 values they stand for) of a weight, cols a multiple of 32."""
    rows, cols = w.shape
    groups = w.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _power_of_two_scale(groups.abs().amax(-1), FP4_MAX)
    x = groups / scale[..., None]
    code = (x.abs()[..., None] - _E2M1_MAGNITUDES).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.view(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    values = _e2m1_value(code) * scale.repeat_interleave(FP4_GROUP, 1)
    return packed, scale.to(torch.float8_e8m0fnu), values


def _quantizer(
    key: str, experts: str | None, block: tuple[int, int]
) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]] | None:
    """How `write_published_v4` stores HF key `key`: None for as it is."""
    if experts is None or not (_FP8_LINEAR.match(key) or _ROUTED_EXPERT.match(key)):
        return None
    if experts == "fp4" and _ROUTED_EXPERT.match(key):
        return quantize_fp4
    return lambda w: quantize_fp8_ue8m0(w, block)


def write_published_v4(
    src: str | Path,
    dst: str | Path,
    *,
    experts: str | None = None,
    block: tuple[int, int] = (16, 16),
    mtp_copies: bool = False,
) -> dict[str, Tensor]:
    """HF-layout V4 checkpoint `src` rewritten at `dst` in DeepSeek's published layout (one file).

    `experts` None keeps the weights as they are; "fp8" or "fp4" quantizes the linears to FP8 with
    `block` scales and the routed experts to that format, and writes quantization_config and
    expert_dtype. `mtp_copies` adds copies of the embedding and head under the MTP layer, with
    zeros for values (a loader must use the target's). Returns every weight as the file's values
    stand for it, under HF's key names (the quantized ones dequantized here)."""
    dst = Path(dst)
    dst.mkdir(parents=True)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out: dict[str, Tensor] = {}
    values: dict[str, Tensor] = {}
    for key, value in tensors.items():
        name, quantize = published_key(key), _quantizer(key, experts, block)
        if quantize is None:
            out[name] = values[key] = value
        else:
            out[name], out[name.removesuffix(".weight") + ".scale"], values[key] = quantize(value)
    if mtp_copies:
        out["mtp.0.emb.tok_emb.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
        out["mtp.0.head.weight"] = torch.zeros_like(tensors["head.weight"])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    if experts is not None:
        config["expert_dtype"] = experts
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return values


def write_hf_v4_with(src: str | Path, dst: str | Path, values: dict[str, Tensor]) -> Path:
    """A copy of HF-layout checkpoint `src` at `dst` holding `values` (float32) instead."""
    dst = Path(shutil.copytree(src, dst))
    checkpoints.rewrite_tensors(dst, lambda _, tensors: tensors | values)
    return dst
