"""`compiled-mtp export-gguf`: every tensor under its llama.cpp name (deepseek2 for DeepSeek-V3,
glm4moe for GLM-4 MoE) with its exact values, the metadata llama.cpp reads, the tokenizer, a
one-line refusal of a family llama.cpp has no architecture for; and, where llama-cpp-python is
installed (the bench extra), llama.cpp's greedy tokens equal the engine's on both families."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.cli import main
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.gguf_export import LAYOUTS, export_gguf
from compiled_mtp.models.synthetic import preset_config
from tests.checkpoints import tiny_config, write_checkpoint
from tests.glm_factory import glm_config, write_glm_checkpoint

gguf = pytest.importorskip("gguf")


def _read(path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return tensors, fields


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """q_lora, YaRN, a dense and a MoE layer, FP8 block-scaled weights."""
    return write_checkpoint(tmp_path_factory.mktemp("fp8"), tiny_config(), fp8=True)


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    """GQA with q/k/v bias and qk-norm, half-rotary heads, a dense and a MoE layer, grouped routing,
    one MTP layer."""
    return write_glm_checkpoint(tmp_path_factory.mktemp("glm"), glm_config())


@pytest.fixture(scope="module")
def glm_bare_checkpoint(tmp_path_factory):
    """GLM's other switches: no bias, no qk-norm, a tied LM head, multi-query attention, a quarter
    of each head rotary, every layer MoE, one expert group."""
    config = glm_config(
        attention_bias=False,
        use_qk_norm=False,
        tie_word_embeddings=True,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
    )
    return write_glm_checkpoint(tmp_path_factory.mktemp("glm_bare"), config)


# (checkpoint fixture, with its MTP layer): GLM's layout names the NextN tensors, deepseek2's does not
CHECKPOINTS = [("fp8_checkpoint", False), ("glm_checkpoint", True)]


@pytest.mark.parametrize(("checkpoint", "with_mtp"), CHECKPOINTS)
def test_every_tensor_is_exported_with_its_values(checkpoint, with_mtp, request, tmp_path):
    checkpoint = request.getfixturevalue(checkpoint)
    model = load_model(checkpoint, with_mtp=with_mtp)  # FP8 dequantized: what the engine serves
    tensors, _ = _read(export_gguf(checkpoint, tmp_path / "m.gguf", with_mtp=with_mtp))
    cfg = model.cfg
    arch = gguf.MODEL_ARCH[LAYOUTS[model.model_type].arch]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers + with_mtp * cfg.num_nextn_predict_layers)
    seen = set()
    for name, value in model.state_dict().items():
        kind = "bias" if name.endswith("bias") else "weight"
        base = name.replace("_bias", ".bias").removesuffix("." + kind)
        if name.endswith("kv_b_proj.weight"):
            k_b = torch.from_numpy(tensors[names.get_name(base.replace("kv_b", "k_b")) + ".weight"])
            v_b = torch.from_numpy(tensors[names.get_name(base.replace("kv_b", "v_b")) + ".weight"])
            seen |= {names.get_name(base.replace("kv_b", p)) + ".weight" for p in ("k_b", "v_b")}
            rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(value.shape)
            assert torch.equal(rebuilt, value), name
            continue
        key = f"{names.get_name(base)}.{kind}"
        seen.add(key)
        assert torch.equal(torch.from_numpy(tensors[key]), value.float()), name
    assert seen == set(tensors)


def test_metadata_is_what_llama_cpp_reads(fp8_checkpoint, tmp_path):
    cfg = load_model(fp8_checkpoint, with_mtp=False).cfg
    _, fields = _read(export_gguf(fp8_checkpoint, tmp_path / "m.gguf", dtype="f16"))
    arch = "deepseek2"
    expected = {
        "general.architecture": arch,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.leading_dense_block_count": cfg.first_k_dense_replace,
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.attention.q_lora_rank": cfg.q_lora_rank,
        f"{arch}.attention.kv_lora_rank": cfg.kv_lora_rank,
        f"{arch}.attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        f"{arch}.attention.key_length_mla": cfg.qk_head_dim,
        f"{arch}.attention.value_length_mla": cfg.v_head_dim,
        f"{arch}.expert_count": cfg.n_routed_experts,
        f"{arch}.expert_group_count": cfg.n_group,
        f"{arch}.expert_group_used_count": cfg.topk_group,
        f"{arch}.rope.dimension_count": cfg.qk_rope_head_dim,
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.original_context_length": cfg.rope.original_max_position_embeddings,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "tokenizer.ggml.model": "none",  # this checkpoint has no tokenizer.json
    }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields[f"{arch}.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * cfg.rope.mscale_all_dim)
    assert fields[f"{arch}.expert_weights_scale"] == pytest.approx(cfg.routed_scaling_factor)


def test_glm_metadata_is_what_llama_cpp_reads(glm_checkpoint, tmp_path):
    cfg = load_model(glm_checkpoint).cfg
    _, fields = _read(export_gguf(glm_checkpoint, tmp_path / "m.gguf", with_mtp=True))
    arch, keys = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM4_MOE], gguf.Keys
    expected = {
        keys.General.ARCHITECTURE: arch,
        keys.LLM.BLOCK_COUNT: cfg.num_hidden_layers + 1,  # the NextN block counts
        keys.LLM.NEXTN_PREDICT_LAYERS: 1,
        keys.LLM.LEADING_DENSE_BLOCK_COUNT: cfg.first_k_dense_replace,
        keys.LLM.EXPERT_COUNT: cfg.n_routed_experts,
        keys.LLM.EXPERT_SHARED_COUNT: cfg.n_shared_experts,
        keys.LLM.EXPERT_FEED_FORWARD_LENGTH: cfg.moe_intermediate_size,
        keys.LLM.EXPERT_GROUP_COUNT: cfg.n_group,
        keys.LLM.EXPERT_GROUP_USED_COUNT: cfg.topk_group,
        keys.LLM.EXPERT_GATING_FUNC: int(gguf.ExpertGatingFuncType.SIGMOID),
        keys.LLM.EXPERT_WEIGHTS_NORM: cfg.norm_topk_prob,
        keys.Attention.HEAD_COUNT_KV: cfg.num_key_value_heads,
        keys.Attention.KEY_LENGTH: cfg.head_dim,
        keys.Attention.VALUE_LENGTH: cfg.head_dim,
        keys.Rope.DIMENSION_COUNT: cfg.head_dim // 2,  # partial_rotary_factor 0.5
    }
    assert {k.format(arch=arch): fields.get(k.format(arch=arch)) for k in expected} == {
        k.format(arch=arch): v for k, v in expected.items()
    }
    assert fields[keys.LLM.EXPERT_WEIGHTS_SCALE.format(arch=arch)] == pytest.approx(cfg.routed_scaling_factor)


def test_a_family_llama_cpp_has_no_architecture_for_is_one_line(tmp_path, capsys):
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(preset_config("v4-tiny")))
    with pytest.raises(SystemExit) as exit:
        main(["export-gguf", "--model", str(tmp_path / "v4"), "--out", str(tmp_path / "x.gguf")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "llama.cpp's GGUF has no DeepSeek-V4 architecture in this gguf package" in err
    assert not (tmp_path / "x.gguf").exists()


def test_a_failed_export_leaves_no_file(glm_checkpoint, tmp_path, monkeypatch):
    """An export that fails after its header and metadata are written (the disk filled up) leaves
    neither the file nor a partial one."""
    import gguf

    def full(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(glm_checkpoint, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_the_shipped_tokenizer_goes_along(tmp_path, capsys):
    main(["export-gguf", "--out", str(tmp_path / "d.gguf"), "--dtype", "bf16"])
    assert "d.gguf" in capsys.readouterr().out
    _, fields = _read(tmp_path / "d.gguf")
    spec = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.tokens"] == vocab
    assert len(fields["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])


def test_bad_dtype_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["export-gguf", "--out", "x.gguf", "--dtype", "q4"])
    assert exit.value.code == 2


@pytest.mark.parametrize("checkpoint", [*(name for name, _ in CHECKPOINTS), "glm_bare_checkpoint"])
def test_llama_cpp_greedy_tokens_equal_the_engine(checkpoint, request, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python comes with the bench extra")
    from compiled_mtp.llama_cpp_peer import LlamaCpp

    checkpoint = request.getfixturevalue(checkpoint)
    peer = LlamaCpp(export_gguf(checkpoint, tmp_path / "m.gguf"), context=64, threads=1)
    rt = Runtime(
        load_model(checkpoint, with_mtp=False),
        mtp_depth=0,
        batch_sizes=(1,),
        max_seq_len=64,
        compile_backend="eager",
        prefill_chunk=8,
    )
    gen = torch.Generator().manual_seed(3)
    for n in (1, 5, 12):
        prompt = torch.randint(97, (n,), generator=gen).tolist()
        ours = rt.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
        assert peer.generate(prompt, 20) == ours
