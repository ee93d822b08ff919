"""The command line's generate and random-checkpoint, through main(argv), uncompiled."""

from __future__ import annotations

import pytest

from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.cli import main
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.reference import reference_generate
from compiled_mtp.tokenizer import Tokenizer


def test_random_checkpoint_then_generate_from_ids(tmp_path, capsys):
    main(["random-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ckpt"), "--seed", "3"])
    assert capsys.readouterr().out == f"wrote a random 'tiny' DeepSeek-V3 checkpoint to {tmp_path / 'ckpt'}\n"
    main(["generate", "--ids", "5 6 7", "--model", str(tmp_path / "ckpt"), "--mtp-depth", "2", "--max-new-tokens", "9", "--backend", "eager", "--max-seq-len", "32"])
    lines = capsys.readouterr().out.splitlines()
    model = load_model(tmp_path / "ckpt")
    expected = reference_generate(model, [[5, 6, 7]], 9, 0)[0].token_ids
    stops = [i for i, t in enumerate(expected) if t in model.cfg.eos_token_ids]
    assert lines[0] == " ".join(map(str, expected[: stops[0] + 1] if stops else expected))
    assert lines[1].startswith("finish_reason=") and lines[2].startswith("  K=2: ")


def test_generate_text_on_the_shipped_model(capsys):
    prompt = "def add(a, b):\n"
    main(["generate", prompt, "--mtp-depth", "1", "--max-new-tokens", "6", "--backend", "eager", "--max-seq-len", "64"])
    lines = capsys.readouterr().out.splitlines()
    tokenizer = Tokenizer.find(DEFAULT_MODEL)
    expected = reference_generate(load_model(DEFAULT_MODEL), [tokenizer.encode(prompt)], 6, 0)[0].token_ids
    text = "\n".join(lines[: prompt.count("\n") + tokenizer.decode(expected).count("\n") + 1])
    assert text == prompt + tokenizer.decode(expected)
    assert any(line.startswith("finish_reason=") for line in lines)


def test_generate_rejects_bad_sampling_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ids", "1 2", "--top-p", "1.5", "--max-new-tokens", "4", "--backend", "eager", "--max-seq-len", "32"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: top_p: must be in (0, 1], got 1.5\n"

