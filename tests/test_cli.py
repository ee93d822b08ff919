"""The command line: every flag documented with its default, generate's output (several prompts, stop
strings, streaming) against the API's, and a one-line `error: ...` with exit code 2 for bad input."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_mtp import DEFAULT_MODEL, Runtime, SamplingParams
from compiled_mtp.capture.compiler import progress
from compiled_mtp.cli import build_parser, main
from compiled_mtp.detokenize import IncrementalText
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.ops import library
from compiled_mtp.reference import reference_generate
from compiled_mtp.tokenizer import Tokenizer
from tests.precision import BFLOAT16_DOT

ENGINE = ["--backend", "eager", "--max-seq-len", "128"]


def _fails(argv: list[str], capsys) -> str:
    """Run the command line; it must exit 2 with one `error:` line on stderr. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_every_flag_has_help_with_its_default():
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    for name, sub in subcommands.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings or action.required:
                continue
            text = sub._get_formatter()._expand_help(action)
            assert "(default: " in text, f"{name} {action.option_strings[0]}: {text!r}"
            if isinstance(action.default, (int, float, str)) and not isinstance(action.default, bool):
                assert f"default: {action.default}" in text, f"{name} {action.option_strings[0]}: {text!r}"


def _utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=100)
@given(
    text=st.text(st.sampled_from("ab\u20ac\U0001f600\n"), max_size=30),
    stops=st.lists(st.text(st.sampled_from("ab\u20ac"), min_size=1, max_size=3), max_size=2),
    chunks=st.lists(st.integers(1, 4), min_size=30, max_size=30),
)
def test_streamed_text_is_never_taken_back(text, stops, chunks):
    """Byte-level tokens committed a few at a time: what is written is always the beginning of the
    final output, which ends before the first stop string (a character split across tokens, or a
    stop string's first characters, wait for the tokens that settle them)."""
    ids, expected = list(text.encode()), text
    cuts = [i for i in map(text.find, stops) if i >= 0]
    if cuts:
        expected = text[: min(cuts)]
    out = IncrementalText(_utf8, stops)
    written, start = "", 0
    for n in chunks:
        out.add(ids[start : start + n], False)
        start += n
        written += out.take()
        assert expected.startswith(written)
    out.add(ids[start:], True)
    assert written + out.take() == expected
    assert out.stopped == bool(cuts)


PROMPTS = ["def f(x):", "class A:"]


@pytest.fixture(scope="module")
def api_outputs(text_model):
    rt = Runtime.from_pretrained(
        text_model, mtp_depth=1, batch_sizes=(1,), max_seq_len=128, compile_backend="eager"
    )
    return rt.generate(PROMPTS, SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize("stream", [False, True])
def test_prompts_file_stop_and_stream_match_the_api(text_model, api_outputs, tmp_path, monkeypatch, stream):
    prompts, (first, second) = PROMPTS, api_outputs
    # A stop string from the middle of the first output that the second does not contain.
    stop = next(
        first.text[i : i + 3]
        for i in range(4, len(first.text) - 3)
        if first.text[i : i + 3] not in second.text
    )
    cut = first.text.index(stop)
    (tmp_path / "prompts.txt").write_text(f"{prompts[0]}\n\n{prompts[1]}\n")

    # Record each write to stdout with the number of runtime steps taken before it.
    steps, writes = [0], []
    step = Runtime.step
    monkeypatch.setattr(Runtime, "step", lambda rt: steps.__setitem__(0, steps[0] + 1) or step(rt))
    monkeypatch.setattr(
        sys,
        "stdout",
        type("Out", (), {"write": lambda _, s: writes.append((steps[0], s)), "flush": lambda _: None})(),
    )
    flags = ["--stream"] * stream
    main(
        [
            "generate",
            "--prompts-file",
            str(tmp_path / "prompts.txt"),
            "--model",
            str(text_model),
            "--max-new-tokens",
            "8",
            "--mtp-depth",
            "1",
            "--stop",
            stop,
            *flags,
            *ENGINE,
        ]
    )

    out = "".join(s for _, s in writes)
    finish = r"\nfinish_reason={} drafted=\d+ accepted=\d+\n"
    expected = (
        re.escape(prompts[0] + first.text[:cut])
        + finish.format("stop")
        + re.escape(prompts[1] + second.text)
        + finish.format(second.finish_reason)
        + r"  K=1: (\d+) tokens in .* acceptance length [\d.]+, .*\n"
    )
    match = re.fullmatch(expected, out, re.S)
    assert match, out
    assert int(match[1]) < 16  # the first request ended at its stop text (aborted), not at 8 tokens
    text_writes = [n for n, s in writes if s.strip() and not s.startswith("  K=")]
    if stream:  # the first output was on the terminal before the second request ran
        assert text_writes[0] < steps[0] - 1
    else:
        assert min(text_writes) == steps[0]


def test_depth_zero_reports_acceptance_length_one(text_model, capsys):
    for new_tokens in ("1", "6"):  # with no decode step, and with five
        main(
            [
                "generate",
                "def",
                "--model",
                str(text_model),
                "--mtp-depth",
                "0",
                "--max-new-tokens",
                new_tokens,
                *ENGINE,
            ]
        )
        assert ", acceptance length 1.00, " in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--seed", str(2**70), "--temperature", "1"],
            r"seed: must be in \[0, 2\*\*63 - 1\] or None, got 1180591620717411303424",
        ),
        (["--seed", "-1"], r"seed: must be in \[0, 2\*\*63 - 1\] or None, got -1"),
        (["--temperature", "inf"], r"temperature: must be finite and >= 0 \(0 = greedy\), got inf"),
        (["--ids"], r"prompt: expected token ids separated by spaces or commas, got 'def'"),
        (["--stop", ""], r"stop: must not be empty"),
        (["--prompts-file", "missing.txt"], r"prompt: give a prompt or --prompts-file, not both"),
        (["--device", "gpu"], r"device: must be cpu or cuda\[:N\], got 'gpu'"),
    ],
)
def test_bad_generate_options_are_one_line_errors(text_model, capsys, argv, message):
    err = _fails(["generate", "def", "--model", str(text_model), *argv, *ENGINE], capsys)
    assert re.fullmatch("error: " + message, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_on_a_cpu_only_torch_is_a_one_line_error(text_model, capsys):
    err = _fails(["generate", "def", "--model", str(text_model), "--device", "cuda"], capsys)
    assert re.fullmatch(
        r"error: device: cuda (needs a CUDA build of torch; this one \(.*\) is CPU-only, use cpu"
        r"|is not available \(0 CUDA devices visible\))",
        err,
    )


def test_cache_paths_that_are_files_or_missing(text_model, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("")
    generate = ["generate", "def", "--model", str(text_model), "--cache-dir"]
    assert _fails([*generate, str(file)], capsys) == f"error: cache_dir: {file} is not a directory"
    assert (
        _fails([*generate, str(file / "graphs")], capsys)
        == f"error: cache_dir: {file / 'graphs'}: {file} is not a directory"
    )
    capture = [
        "capture",
        "--profile",
        "profiles/test-tiny.toml",
        "--model",
        str(text_model),
        "--cache-dir",
        str(file),
    ]
    assert _fails(capture, capsys) == f"error: cache_dir: {file} is not a directory"
    assert (
        _fails(["inspect", "--cache-dir", str(file)], capsys)
        == f"error: cache_dir: {file} is not a directory"
    )
    assert (
        _fails(["inspect", "--cache-dir", str(tmp_path / "none")], capsys)
        == f"error: cache_dir: {tmp_path / 'none'} does not exist"
    )
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    "command,out,message",
    [
        (
            ["random-checkpoint", "--preset", "tiny"],
            "file/ckpt",
            "out: {file}/ckpt: {file} is not a directory",
        ),
        (["random-checkpoint", "--preset", "tiny"], "file", "out: {file} is not a directory"),
        (["export-gguf"], "file/m.gguf", "out: {file} is not a directory"),
        (["export-gguf"], ".", "out: {tmp} is a directory; name the .gguf file to write"),
        (
            ["bench", "--depths", "0", "--batch-sizes", "1"],
            "file/results",
            "out: {file}/results: {file} is not a directory",
        ),
        (
            ["bench", "--depths", "0", "--batch-sizes", "1"],
            "/proc/results",
            "out: cannot write into /proc/results (.*)",
        ),
    ],
)
def test_an_output_path_that_cannot_be_written_fails_before_the_work(
    tmp_path, capsys, monkeypatch, command, out, message
):
    """Checked before a model loads: a bench's folder that cannot be written would otherwise lose its
    run at the end."""
    file = tmp_path / "file"
    file.write_text("")

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the output path was checked")

    monkeypatch.setattr("compiled_mtp.bench.command.load_model", loaded)
    monkeypatch.setattr("compiled_mtp.models.gguf_export.load_model", loaded)
    monkeypatch.setattr("compiled_mtp.models.synthetic.save_checkpoint", loaded)
    err = _fails([*command, "--out", str(tmp_path / out)], capsys)
    expected = message.format(file=re.escape(str(file)), tmp=re.escape(str(tmp_path)))
    assert re.fullmatch("error: " + expected, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    "raised,line,code",
    [
        (
            OSError(28, "No space left on device", "/data/m.gguf"),
            "error: /data/m.gguf: No space left on device",
            1,
        ),
        (KeyboardInterrupt(), "interrupted", 130),
    ],
)
def test_what_a_command_could_not_check_first_is_one_line(monkeypatch, capsys, raised, line, code):
    def export(*args, **kwargs):
        raise raised

    monkeypatch.setattr("compiled_mtp.cli.export_gguf", export)
    with pytest.raises(SystemExit) as exit_info:
        main(["export-gguf", "--out", "m.gguf"])
    assert exit_info.value.code == code and capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("kind", ["read-only directory", "path nobody may create"])
def test_an_unwritable_cache_falls_back_to_in_process_graphs(text_model, tmp_path, caplog, kind):
    if kind == "read-only directory":
        if os.geteuid() == 0:
            pytest.skip("root ignores permissions")
        cache = tmp_path / "locked"
        cache.mkdir(mode=0o500)
        why = re.escape(f"{cache} is not writable")
    else:  # sysfs refuses new directories even to root
        cache = Path("/sys/compiled_mtp_graphs")
        try:
            cache.mkdir()
        except OSError:
            why = re.escape(f"cannot create {cache / 'locks'} (") + r".*\)"
        else:
            cache.rmdir()
            pytest.skip(f"{cache.parent} accepts new directories here")
    with caplog.at_level(logging.WARNING, logger="compiled_mtp"):
        rt = Runtime.from_pretrained(
            text_model, mtp_depth=0, batch_sizes=(1,), max_seq_len=64, cache_dir=cache
        )
    assert rt.graphs.cache is None  # graphs compile in the process, as without a cache
    assert len(caplog.records) == 1
    assert re.fullmatch(
        f"capture cache: {why}; building the graphs in this process instead", caplog.records[0].getMessage()
    )
    assert not cache.exists() or list(cache.iterdir()) == []


def test_from_pretrained_names_the_shipped_model():
    options = dict(mtp_depth=0, batch_sizes=(1,), max_seq_len=64, compile_backend="eager")
    shipped = Runtime.from_pretrained(DEFAULT_MODEL, **options)
    for rt in (Runtime.from_pretrained("default", **options), Runtime.from_pretrained(**options)):
        assert rt.model.cfg == shipped.model.cfg and rt.tokenizer is not None
        assert torch.equal(rt.model.lm_head.weight, shipped.model.lm_head.weight)


def test_graph_builds_report_their_key_time_and_the_count_left(text_model, caplog):
    def reported() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == progress.name]

    rt = Runtime.from_pretrained(
        text_model, mtp_depth=0, batch_sizes=(1,), max_seq_len=64, compile_backend="aot_eager"
    )
    progress.addHandler(caplog.handler)
    try:
        rt.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
        built = reported()
        rt.generate([[4, 5]], SamplingParams(max_new_tokens=3))  # every graph is ready: nothing to report
    finally:
        progress.removeHandler(caplog.handler)
    expected = [
        r"building prefill/B1/K0 in this process \(0 of 2 graphs ready\)",
        r"built prefill/B1/K0 in \d+\.\d s; 1 of 2 graphs left",
        r"building target_verify/B1/K0 in this process \(1 of 2 graphs ready\)",
        r"built target_verify/B1/K0 in \d+\.\d s; 0 of 2 graphs left",
    ]
    assert len(built) == len(expected) and all(re.fullmatch(e, m) for e, m in zip(expected, built)), built
    assert reported() == built


def test_random_checkpoint_then_generate_from_ids(tmp_path, capsys):
    main(["random-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ckpt"), "--seed", "3"])
    assert capsys.readouterr().out == f"wrote a random 'tiny' DeepSeek-V3 checkpoint to {tmp_path / 'ckpt'}\n"
    main(
        [
            "generate",
            "--ids",
            "5 6 7",
            "--model",
            str(tmp_path / "ckpt"),
            "--mtp-depth",
            "2",
            "--max-new-tokens",
            "9",
            "--backend",
            "eager",
            "--max-seq-len",
            "32",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    model = load_model(tmp_path / "ckpt")
    expected = reference_generate(model, [[5, 6, 7]], 9, 0)[0].token_ids
    stops = [i for i, t in enumerate(expected) if t in model.cfg.eos_token_ids]
    assert lines[0] == " ".join(map(str, expected[: stops[0] + 1] if stops else expected))
    assert lines[1].startswith("finish_reason=") and lines[2].startswith("  K=2: ")


@pytest.mark.parametrize("max_seq_len", [64, 16])  # 16: below the profile's prefill chunk, which it caps
def test_generate_text_on_the_shipped_model(capsys, max_seq_len):
    prompt = "def add(a, b):\n"
    main(
        [
            "generate",
            prompt,
            "--mtp-depth",
            "1",
            "--max-new-tokens",
            "6",
            "--backend",
            "eager",
            "--max-seq-len",
            str(max_seq_len),
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    tokenizer = Tokenizer.find(DEFAULT_MODEL)
    expected = reference_generate(load_model(DEFAULT_MODEL), [tokenizer.encode(prompt)], 6, 0)[0].token_ids
    text = "\n".join(lines[: prompt.count("\n") + tokenizer.decode(expected).count("\n") + 1])
    assert text == prompt + tokenizer.decode(expected)
    assert any(line.startswith("finish_reason=") for line in lines)


def test_demo_runs_every_depth_and_prints_the_greedy_text(capsys):
    from compiled_mtp.cli import DEMO_PROMPT

    main(["demo", "--backend", "eager", "--no-cache", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert re.search(r"^graphs ready in [\d.]+ s \(0 built here, 0 loaded from the cache\)$", out, re.M), out
    for depth in ("0", "3", "auto"):
        assert re.search(
            rf"^  K={depth}: graphs ready in [\d.]+ s \(0 compiled, 0 loaded from the cache\)$", out, re.M
        ), out
        assert re.search(
            rf"^  K={depth}.*: 4 tokens in [\d.]+ s \([\d.]+ tok/s\), acceptance length", out, re.M
        ), out
    tokenizer = Tokenizer.find(DEFAULT_MODEL)
    expected = reference_generate(load_model(DEFAULT_MODEL), [tokenizer.encode(DEMO_PROMPT)], 4, 0)[
        0
    ].token_ids
    assert out.endswith("generated (auto, greedy):\n" + DEMO_PROMPT + tokenizer.decode(expected) + "\n")


def test_bfloat16_mlps_turns_the_products_on_for_the_process(text_model, capsys):
    """--bfloat16-mlps turns the MLPs' bfloat16 products on where the machine has them, and says so on
    stderr in one line where it does not."""
    try:
        main(
            [
                "generate",
                "def",
                "--model",
                str(text_model),
                "--max-new-tokens",
                "2",
                "--bfloat16-mlps",
                *ENGINE,
            ]
        )
        err = capsys.readouterr().err
        assert library.bfloat16_products() == BFLOAT16_DOT
        assert ("AVX512-BF16" in err) != BFLOAT16_DOT
    finally:
        library.bfloat16_products(False)
