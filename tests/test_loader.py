"""Checkpoint loading: layouts, dtypes, FP8 dequantization, and one clear error per kind of bad checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch

from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.config import CheckpointError
from tests.checkpoints import (
    dequantize_checkpoint,
    read_state_dict,
    set_config_fields,
    tiny_config,
    write_checkpoint,
)
from tests.corruption import add_key, copy_checkpoint, delete_key, reshape_key, truncate_file, write_garbage
from tests.test_models import engine_logits

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6]


def _engine_state(model) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint key names (stacked experts split back)."""
    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$", name)
        if m:
            out.update({f"{m.group(1)}.{e}.{m.group(2)}.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = write_checkpoint(tmp_path / "single", tiny_config(), seed=1)
    sharded = write_checkpoint(tmp_path / "sharded", tiny_config(), seed=1, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_model(single), load_model(sharded)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_upcasts(tmp_path, dtype):
    path = write_checkpoint(tmp_path, tiny_config(), dtype=dtype)
    model = load_model(path, dtype=torch.float32)
    stored = read_state_dict(path)
    for key, value in _engine_state(model).items():
        assert value.dtype == torch.float32
        assert torch.equal(value, stored[key]), key


def test_fp8_block_scaled_weights_dequantize(tmp_path):
    # hidden 160 and experts of 136: weights span several 128x128 blocks, some partial.
    cfg = tiny_config(hidden_size=160, moe_intermediate_size=136, intermediate_size=200)
    path = write_checkpoint(tmp_path / "fp8", cfg, fp8=True)
    model = load_model(path)
    reference = read_state_dict(path)
    engine = _engine_state(model)
    assert engine.keys() <= reference.keys()
    for key, value in engine.items():
        assert torch.equal(value, reference[key]), key
    # And the model computes what the dequantized fp32 checkpoint computes.
    plain = load_model(dequantize_checkpoint(path, tmp_path / "fp32"))
    with torch.no_grad():
        torch.testing.assert_close(engine_logits(model, TOKENS), engine_logits(plain, TOKENS))


def test_mtp_shared_copies_are_not_loaded_twice(tiny_checkpoint):
    """Released MTP layers carry copies of embed_tokens and the head; the target's are used."""
    model = load_model(tiny_checkpoint)
    names = set(model.state_dict())
    assert not any("shared_head.head" in n or n.endswith("layers.2.embed_tokens.weight") for n in names)


def test_depth_zero_skips_mtp_layers(tiny_checkpoint):
    model = load_model(tiny_checkpoint, with_mtp=False)
    assert model.num_mtp_layers == 0 and len(model.model.layers) == 2


def _broken(tmp_path, src, breaker):
    path = copy_checkpoint(src, tmp_path / "broken")
    breaker(path)
    return path


BAD = {
    "missing key": (
        lambda p: delete_key(p, "model.layers.1.self_attn.o_proj.weight"),
        r"missing key 'model\.layers\.1\.self_attn\.o_proj\.weight'",
    ),
    "missing expert": (
        lambda p: delete_key(p, "model.layers.2.mlp.experts.3.up_proj.weight"),
        r"missing key 'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight'",
    ),
    "unexpected key": (
        lambda p: add_key(p, "model.layers.0.mlp.bogus.weight"),
        r"model\.safetensors: unexpected key 'model\.layers\.0\.mlp\.bogus\.weight'",
    ),
    "shape mismatch": (
        lambda p: reshape_key(p, "model.layers.0.self_attn.kv_b_proj.weight", (7, 16)),
        r"model\.safetensors: key 'model\.layers\.0\.self_attn\.kv_b_proj\.weight' "
        r"has shape \[7, 16\], expected \[80, 16\]",
    ),
    "truncated file": (
        lambda p: truncate_file(p / "model.safetensors"),
        r"model\.safetensors: unreadable or truncated",
    ),
    "garbage file": (
        lambda p: write_garbage(p / "model.safetensors"),
        r"model\.safetensors: unreadable or truncated",
    ),
    "model type": (
        lambda p: set_config_fields(p, model_type="llama"),
        r"config\.json: model_type 'llama' is not supported",
    ),
    "architecture": (
        lambda p: set_config_fields(p, architectures=["LlamaForCausalLM"]),
        r"config\.json: architectures \['LlamaForCausalLM'\] not supported",
    ),
    "missing config field": (
        lambda p: set_config_fields(p, remove=("kv_lora_rank",)),
        r"config\.json: missing required field 'kv_lora_rank'",
    ),
    "no mtp layers": (
        lambda p: set_config_fields(p, num_nextn_predict_layers=0),
        r"config\.json: num_nextn_predict_layers is 0, so mtp_depth must be 0",
    ),
    "no config": (lambda p: (p / "config.json").unlink(), r"config\.json: not found"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_raises_one_clear_error(tmp_path, tiny_checkpoint, case):
    breaker, message = BAD[case]
    path = _broken(tmp_path, tiny_checkpoint, breaker)
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path)
    assert "\n" not in str(err.value)


def test_missing_shard_is_named(tmp_path):
    path = write_checkpoint(tmp_path / "sharded", tiny_config(), max_shard_size="20KB")
    victim = sorted(path.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"names shard '{victim.name}', which does not exist"):
        load_model(path)


def test_index_pointing_at_the_wrong_shard_is_named(tmp_path):
    path = write_checkpoint(tmp_path / "sharded", tiny_config(), max_shard_size="20KB")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = "model.norm.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][key])
    index["weight_map"][key] = wrong
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{wrong}: cannot read key '{re.escape(key)}'"):
        load_model(path)
