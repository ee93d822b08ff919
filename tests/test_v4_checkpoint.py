"""DeepSeek-V4 checkpoints as DeepSeek publishes them: its own key names (`embed.weight`,
`layers.{i}.attn.kv_norm.weight`, `hc_head_fn`, `mtp.0.*`), plain or quantized (FP8 linears with
power-of-two block scales in `*.scale`, routed experts FP8 or packed FP4), load as the HF-layout
checkpoint of the weights they stand for; a missing or bad scale is one error naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from compiled_mtp.hf_baseline import load_hf
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.config import CheckpointError
from compiled_mtp.reference import reference_generate
from tests.checkpoints import set_config_fields
from tests.corruption import add_key, copy_checkpoint, delete_key, reshape_key, set_key
from tests.oracle import hf_greedy
from tests.v4_factory import v4_config, write_hf_v4_with, write_published_v4, write_v4_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [2, 71]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory) -> Path:
    """The HF-layout checkpoint the published ones are written from; experts of 64 so that a down
    projection's rows hold two FP4 groups of 32."""
    return write_v4_checkpoint(tmp_path_factory.mktemp("hf"), v4_config(moe_intermediate_size=64), seed=5)


@pytest.fixture(scope="module")
def fp4_path(tmp_path_factory, hf_path) -> Path:
    path = tmp_path_factory.mktemp("fp4") / "published"
    write_published_v4(hf_path, path, experts="fp4")
    return path


def _keys(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def _assert_same_parameters(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_published_layout_loads_the_parameters_of_the_hf_layout(hf_path, tmp_path):
    """Renamed keys only, plus the MTP layer's copies of the embedding and head (zeros), which are
    skipped for the target's."""
    path = tmp_path / "published"
    write_published_v4(hf_path, path, mtp_copies=True)
    keys = _keys(path)
    assert {"embed.weight", "norm.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight"} <= keys.keys()
    assert "mtp.0.head.weight" in keys and not any(k.startswith("model.") for k in keys)
    _assert_same_parameters(load_model(path), load_model(hf_path))
    _assert_same_parameters(load_model(path, with_mtp=False), load_model(hf_path, with_mtp=False))


@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_quantized_checkpoint_loads_the_values_it_stands_for(hf_path, tmp_path, experts):
    """Every parameter equals the test's own dequantization of what it wrote, and greedy decoding
    (K = 1) equals the engine's and HF's on an HF-layout checkpoint of those values."""
    path = tmp_path / "published"
    values = write_published_v4(hf_path, path, experts=experts)
    keys = _keys(path)
    assert keys["layers.0.attn.wq_a.weight"] == "F8_E4M3" and keys["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert keys["mtp.0.ffn.experts.3.w2.weight"] == ("I8" if experts == "fp4" else "F8_E4M3")
    dequantized = write_hf_v4_with(hf_path, tmp_path / "dequantized", values)
    original = load_model(hf_path).state_dict()["model.layers.1.ffn.experts.w2"]
    ours, plain = load_model(path), load_model(dequantized)
    assert not torch.equal(ours.state_dict()["model.layers.1.ffn.experts.w2"], original)
    _assert_same_parameters(ours, plain)
    tokens = [o.token_ids for o in reference_generate(ours, PROMPTS, NEW_TOKENS, 1)]
    assert tokens == [o.token_ids for o in reference_generate(plain, PROMPTS, NEW_TOKENS, 1)]
    hf = load_hf(dequantized)
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def _nan_scale(t: torch.Tensor) -> torch.Tensor:
    raw = t.view(torch.uint8).clone()
    raw[0, 0] = 0xFF  # float8_e8m0fnu's NaN
    return raw.view(torch.float8_e8m0fnu)


BAD_SCALE = {
    "missing FP8 scale": (
        lambda p: delete_key(p, "layers.0.attn.wq_a.scale"),
        r"FP8 key 'layers\.0\.attn\.wq_a\.weight' has no 'layers\.0\.attn\.wq_a\.scale'",
    ),
    "missing FP4 scale": (
        lambda p: delete_key(p, "mtp.0.ffn.experts.3.w2.scale"),
        r"FP4 key 'mtp\.0\.ffn\.experts\.3\.w2\.weight' has no 'mtp\.0\.ffn\.experts\.3\.w2\.scale'",
    ),
    "FP8 scale shape": (
        lambda p: reshape_key(p, "layers.2.attn.wo_b.scale", (3, 1)),
        r"scale 'layers\.2\.attn\.wo_b\.scale' has shape \[3, 1\], expected \[2, 1\]",
    ),
    "FP4 scale shape": (
        lambda p: reshape_key(p, "layers.1.ffn.experts.0.w2.scale", (32, 1)),
        r"scale 'layers\.1\.ffn\.experts\.0\.w2\.scale' has shape \[32, 1\], expected \[32, 2\]",
    ),
    "NaN scale": (
        lambda p: set_key(p, "layers.0.ffn.shared_experts.w1.scale", _nan_scale),
        r"scale 'layers\.0\.ffn\.shared_experts\.w1\.scale' has non-finite values",
    ),
    "raw byte scale": (
        lambda p: set_key(p, "layers.0.attn.wkv.scale", lambda t: t.view(torch.uint8)),
        r"scale 'layers\.0\.attn\.wkv\.scale' has dtype torch\.uint8, expected float32 or float8_e8m0fnu",
    ),
    "FP4 weight width": (
        lambda p: reshape_key(p, "layers.2.ffn.experts.1.w1.weight", (64, 8)),
        r"key 'layers\.2\.ffn\.experts\.1\.w1\.weight' has shape \[64, 16\] unpacked from FP4, expected \[64, 32\]",
    ),
    "missing published key": (
        lambda p: delete_key(p, "layers.1.attn.kv_norm.weight"),
        r"missing key 'layers\.1\.attn\.kv_norm\.weight'",
    ),
    "block size": (
        lambda p: set_config_fields(
            p, quantization_config={"quant_method": "fp8", "weight_block_size": [0, 16]}
        ),
        r"config\.json: quantization_config\.weight_block_size must be two integers >= 1, got \[0, 16\]",
    ),
    "unexpected published key": (
        lambda p: add_key(p, "layers.0.attn.bogus"),
        r"model\.safetensors: unexpected key 'layers\.0\.attn\.bogus'",
    ),
    "expert dtype": (
        lambda p: set_config_fields(p, expert_dtype="nvfp4"),
        r"config\.json: expert_dtype 'nvfp4' is not supported \(supported: fp8, fp4\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SCALE))
def test_bad_quantized_checkpoint_is_one_error_naming_the_key(fp4_path, tmp_path, case):
    breaker, message = BAD_SCALE[case]
    path = copy_checkpoint(fp4_path, tmp_path / "broken")
    breaker(path)
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path)
    assert "\n" not in str(err.value)
