"""draft_vocab: the token ranking (`compiled-mtp calibrate`), its file and its errors. Drafting from the
restricted vocabulary is tested in test_engine.py (greedy), test_distribution.py (sampled) and
test_compiled.py (Inductor with every pass)."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compiled_mtp import Runtime
from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.cli import main
from compiled_mtp.models.config import CheckpointError
from compiled_mtp.models.draft_vocab import FILE, read_ranking, token_ranking, write_ranking


@given(streams=st.lists(st.lists(st.integers(0, 15), max_size=30), max_size=4))
def test_ranking_is_by_count_then_by_id(streams):
    ranking = token_ranking(streams, 16)
    assert sorted(ranking) == list(range(16))
    counts = [sum(s.count(t) for s in streams) for t in range(16)]
    keys = [(-counts[t], t) for t in ranking]
    assert keys == sorted(keys)


def test_ranking_file_round_trip_and_errors(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=r"^draft_vocab: .*draft_vocab.json does not exist; write it with: compiled-mtp calibrate",
    ):
        read_ranking(tmp_path, 4)
    write_ranking(tmp_path, [2, 0, 3, 1], "test")
    assert read_ranking(tmp_path, 4) == [2, 0, 3, 1]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(CheckpointError, match=r"token_ids must rank every id in \[0, 5\) once"):
        read_ranking(tmp_path, 5)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"draft_vocab.json: unreadable"):
        read_ranking(tmp_path, 4)


def test_calibrate_command_writes_a_ranking_the_runtime_reads(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(DEFAULT_MODEL / name, model)
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 50)
    main(["calibrate", "--model", str(model), "--text", str(text)])
    assert "wrote" in capsys.readouterr().out
    data = json.loads((model / FILE).read_text())
    assert data["source"].startswith("1 files") and len(data["token_ids"]) == 4096
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--model", str(model), "--text", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("error: text: cannot read")


@pytest.mark.parametrize("n", [0, 4097, 2.5])
def test_draft_vocab_out_of_range_is_refused_before_anything_is_built(n):
    with pytest.raises(ValueError, match=r"^draft_vocab: must be an integer in \[1, 4096\], got"):
        Runtime.from_pretrained(DEFAULT_MODEL, draft_vocab=n, compile_backend="eager")
