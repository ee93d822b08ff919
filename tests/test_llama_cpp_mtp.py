"""llama.cpp's own MTP drafting (`export-gguf --with-mtp`, llama_cpp_peer.LlamaCppMTP): the export
loads with and without its MTP layer, and the speculative loop's greedy tokens equal llama.cpp's
plain ones and the engine's, with the engine's accepted count at depth 1 (the same drafts: the
NextN block reads the target's post-norm hidden as the engine's MTP layer does), on DeepSeek-V3's
deepseek2 export and GLM-4 MoE's glm4moe one."""

from __future__ import annotations

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams, llama_cpp_peer
from compiled_mtp.cli import main
from compiled_mtp.llama_cpp_peer import LlamaCpp, LlamaCppMTP
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.gguf_export import export_gguf
from tests.checkpoints import set_config_fields, tiny_config, write_checkpoint
from tests.glm_factory import write_glm_distilled_checkpoint

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp", reason="llama-cpp-python comes with the bench extra")

NEW_TOKENS = 24

if not llama_cpp_peer.mtp_available():
    pytest.skip(llama_cpp_peer.NO_MTP, allow_module_level=True)


@pytest.fixture(scope="module")
def exports(distilled_checkpoint, tmp_path_factory):
    """The plain export, and the one with the MTP layer through the CLI."""
    folder = tmp_path_factory.mktemp("gguf")
    plain, mtp = folder / "plain.gguf", folder / "mtp.gguf"
    main(["export-gguf", "--model", str(distilled_checkpoint), "--out", str(mtp), "--with-mtp"])
    return export_gguf(distilled_checkpoint, plain), mtp


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(97, (n,), generator=gen).tolist() for n in (1, 6, 13)]


def test_the_mtp_export_decodes_as_the_plain_one_without_its_mtp_layer(exports, prompts):
    plain, mtp = exports
    a, b = LlamaCpp(plain, context=64, threads=1), LlamaCpp(mtp, context=64, threads=1)
    for prompt in prompts:
        assert b.generate(prompt, NEW_TOKENS) == a.generate(prompt, NEW_TOKENS)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_speculation_keeps_the_greedy_tokens(distilled_checkpoint, exports, prompts, depth):
    plain, mtp = exports
    peer, spec = LlamaCpp(plain, context=64, threads=1), LlamaCppMTP(mtp, 64, 1, depth)
    rt = _engine(distilled_checkpoint, depth)
    engine_accepted = 0
    for prompt in prompts:
        ours = rt.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
        engine_accepted += sum(ours.accepted_per_step)
        assert spec.generate(prompt, NEW_TOKENS) == peer.generate(prompt, NEW_TOKENS) == ours.token_ids
    assert 0 < spec.accepted < spec.drafted
    if depth == 1:
        assert spec.accepted == engine_accepted


def test_glm_mtp_drafts_are_the_engines(tmp_path, prompts):
    """llama.cpp's glm4moe loads the NextN block as well: at depth 1 its drafts, and so its accepted
    count and tokens, are the engine's."""
    checkpoint = write_glm_distilled_checkpoint(tmp_path / "glm")
    spec = LlamaCppMTP(export_gguf(checkpoint, tmp_path / "mtp.gguf", with_mtp=True), 64, 1, 1)
    rt = _engine(checkpoint, 1)
    engine_accepted = 0
    for prompt in prompts:
        ours = rt.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
        engine_accepted += sum(ours.accepted_per_step)
        assert spec.generate(prompt, NEW_TOKENS) == ours.token_ids
    assert 0 < spec.accepted == engine_accepted < spec.drafted


def _engine(checkpoint, depth: int) -> Runtime:
    return Runtime(
        load_model(checkpoint),
        mtp_depth=depth,
        batch_sizes=(1,),
        max_seq_len=64 + depth,
        compile_backend="eager",
        prefill_chunk=8,
    )


def test_an_export_without_mtp_layers_is_refused_for_the_mtp_loop(exports):
    with pytest.raises(ValueError, match="no MTP layer"):
        LlamaCppMTP(exports[0], 64, 1, 1)
    with pytest.raises(ValueError, match="depth: must be >= 1"):
        LlamaCppMTP(exports[1], 64, 1, 0)


def test_with_mtp_on_a_checkpoint_without_mtp_layers_is_one_line(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=1))
    set_config_fields(path, num_nextn_predict_layers=0)
    with pytest.raises(SystemExit) as exit:
        main(["export-gguf", "--model", str(path), "--out", str(tmp_path / "x.gguf"), "--with-mtp"])
    assert exit.value.code == 2
    assert "num_nextn_predict_layers is 0" in capsys.readouterr().err
