"""`compiled-mtp export-gguf`: every target tensor under llama.cpp's deepseek2 name with its exact
values, the metadata llama.cpp reads, the tokenizer; and, where llama-cpp-python is installed (the
bench extra), llama.cpp's greedy tokens equal the engine's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.cli import main
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.gguf_export import export_gguf
from tests.checkpoints import tiny_config, write_checkpoint

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


def test_every_target_tensor_is_exported_with_its_values(fp8_checkpoint, tmp_path):
    model = load_model(fp8_checkpoint, with_mtp=False)  # FP8 dequantized: what the engine serves
    tensors, _ = _read(export_gguf(fp8_checkpoint, tmp_path / "m.gguf"))
    cfg = model.cfg
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    seen = set()
    for name, value in model.state_dict().items():
        base = name.replace("_bias", ".bias").removesuffix(".weight").removesuffix(".bias")
        if name.endswith("kv_b_proj.weight"):
            k_b = torch.from_numpy(tensors[names.get_name(base.replace("kv_b", "k_b")) + ".weight"])
            v_b = torch.from_numpy(tensors[names.get_name(base.replace("kv_b", "v_b")) + ".weight"])
            seen |= {names.get_name(base.replace("kv_b", p)) + ".weight" for p in ("k_b", "v_b")}
            rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(value.shape)
            assert torch.equal(rebuilt, value), name
            continue
        key = names.get_name(base) + (".bias" if name.endswith("_bias") else ".weight")
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


def test_llama_cpp_greedy_tokens_equal_the_engine(fp8_checkpoint, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python comes with the bench extra")
    from compiled_mtp.llama_cpp_peer import LlamaCpp

    peer = LlamaCpp(export_gguf(fp8_checkpoint, tmp_path / "m.gguf"), context=64, threads=1)
    rt = Runtime(
        load_model(fp8_checkpoint, with_mtp=False),
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
