"""The capture cache: profiles, cache keys, AOTInductor artifacts that hold code only.

One capture of the tiny profile (a 1-layer echo checkpoint, bucket 1, depth 2: four graphs) is made by
two processes at once and shared by the module's tests; the recovery tests damage a copy of it, and
rebuild what a runtime's check finds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture import aot, parallel, weight_copies
from compiled_mtp.capture.aot import environment
from compiled_mtp.capture.cache import GraphCache
from compiled_mtp.capture.compiler import progress
from compiled_mtp.capture.profile import PROFILES, ProfileError, load_profile
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs, graph_keys
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.passes import bfloat16_reads
from compiled_mtp.passes.manager import inductor_options
from compiled_mtp.reference import reference_generate
from tests.checkpoints import write_echo_checkpoint
from tests.corruption import truncate_file, write_garbage

ROOT = Path(__file__).resolve().parents[1]
PROFILE = PROFILES / "test-tiny.toml"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4]]  # the first spans two prefill chunks
GREEDY = {"max_new_tokens": 12, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 3, "ignore_eos": True}

# Generates PROMPTS greedily and sampled in a fresh interpreter; prints the outputs and counters.
NEW_PROCESS = """
import json, sys
from compiled_mtp import Runtime, SamplingParams
from compiled_mtp.capture.profile import load_profile
model, profile, cache, prompts, greedy, sampled = sys.argv[1:]
rt = Runtime.from_pretrained(model, **load_profile(profile).runtime_options(), cache_dir=cache)
outs = [[o.token_ids for o in rt.generate(json.loads(prompts), SamplingParams(**json.loads(p)))]
        for p in (greedy, sampled)]
print(json.dumps({"outputs": outs, "compiles": rt.stats()["compiles"], "loads": rt.graphs.loads}))
"""


def _python(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


def _runtime(model_dir: Path, cache: Path | None, backend: str = "inductor", **options) -> Runtime:
    return Runtime.from_pretrained(
        model_dir,
        **load_profile(PROFILE).runtime_options() | options,
        cache_dir=cache,
        compile_backend=backend,
    )


def _generate(rt: Runtime) -> list[list[list[int]]]:
    return [[o.token_ids for o in rt.generate(PROMPTS, SamplingParams(**p))] for p in (GREEDY, SAMPLED)]


def _reference(model) -> list[list[int]]:
    return [reference_generate(model, [p], GREEDY["max_new_tokens"], 0)[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one config with different weights."""
    return tuple(
        write_echo_checkpoint(tmp_path_factory.mktemp(f"echo{s}"), mtp_noise=0.3, attn_scale=0.5, seed=s)
        for s in (1, 2)
    )


@pytest.fixture(scope="module")
def captured(checkpoints, tmp_path_factory) -> tuple[Path, list[str]]:
    """The tiny profile captured into one cache directory by two `compiled-mtp capture` commands
    running at the same time (one per checkpoint), the first with a helper process building beside
    it; returns the directory and their outputs."""
    cache = tmp_path_factory.mktemp("cache")
    procs = [
        _python(
            "-m",
            "compiled_mtp.cli",
            "capture",
            "--profile",
            str(PROFILE),
            "--model",
            str(m),
            "--cache-dir",
            str(cache),
            "--processes",
            str(n),
        )
        for m, n in zip(checkpoints, (2, 1))
    ]
    return cache, [_finish(p) for p in procs]


def _copy(cache: Path, dst: Path) -> Path:
    return Path(shutil.copytree(cache, dst, ignore=shutil.ignore_patterns("locks")))


def _cache_log(caplog) -> list[str]:
    """The capture cache's messages (torch's own records can reach caplog too)."""
    return [r.getMessage() for r in caplog.records if r.name == "compiled_mtp.capture"]


def _package(cache: Path, kind: str) -> Path:
    (package,) = cache.glob(f"{kind}-*.pt2")
    return package


# ----------------------------------------------------------------------------- profiles


def test_shipped_profiles_load():
    default = load_profile(PROFILES / "default-cpu.toml")
    assert default.device == "cpu" and default.model == ROOT / "compiled_mtp" / "default_model"
    tiny = load_profile(PROFILE)
    assert [key.name for key in graph_keys(tiny.batch_sizes, tiny.mtp_depths)] == [
        "prefill/B1/K0",
        "draft_decode/B1/K2",
        "target_verify/B1/K2",
        "draft_extend/B1/K2",
    ]


@pytest.mark.parametrize(
    "edit, field",
    [
        ("", "dtype"),  # missing
        ('dtype = "int8"', "dtype"),
        ('dtype = "float32"\nmax_seq_len = "long"', "max_seq_len"),
        ('dtype = "float32"\nbatch_sizes = []', "batch_sizes"),
        ('dtype = "float32"\nmtp_depths = [true]', "mtp_depths"),
        ('dtype = "float32"\ndevice = "gpu0"', "device"),
        ('dtype = "float32"\ndevice = "cuda"', "device"),  # the capture cache is CPU-only
        ('dtype = "float32"\nprefill_chunk = 100', "prefill_chunk"),
        ('dtype = "float32"\nbatch_size = [1]', "batch_size"),  # unknown
        ('dtype = "float32"\nmodel = 3', "model"),
        ('dtype = "float32"\ndraft_vocab = 0', "draft_vocab"),
    ],
)
def test_malformed_profile_names_the_field(tmp_path, edit, field):
    base = {"device": '"cpu"', "max_seq_len": "64", "batch_sizes": "[1]", "mtp_depths": "[1]"}
    lines = dict(line.split(" = ", 1) for line in edit.splitlines())
    path = tmp_path / "p.toml"
    path.write_text("\n".join(f"{k} = {v}" for k, v in ({**base, **lines}).items()))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and repr(field) in message


def test_invalid_toml_is_one_line(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("dtype = \n")
    with pytest.raises(ProfileError, match="not a valid TOML file") as e:
        load_profile(path)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- keys


PREFILL = GraphKey(GraphKind.prefill, 1, 0)
VERIFY_K2 = GraphKey(GraphKind.target_verify, 1, 2)
EXTEND_K2 = GraphKey(GraphKind.draft_extend, 1, 2)


def _key(
    model_dir: Path,
    key=VERIFY_K2,
    max_seq_len=64,
    slots=1,
    depth=2,
    chunk=8,
    passes=None,
    dtype=torch.float32,
):
    model = load_model(model_dir, dtype=dtype)
    state = StaticState(model, slots, max_seq_len, depth)
    return aot.artifact_key(key, model, state, example_inputs(key, model, chunk), inductor_options(passes))


def test_key_covers_the_code_not_the_checkpoint(checkpoints, tmp_path):
    cache = GraphCache(tmp_path)
    one, two = checkpoints
    base = _key(one)
    assert _key(two) == base  # other weights, other path: same artifact
    assert base["torch"] == torch.__version__ and base["target"].startswith("cpu ")
    assert cache.package(base).name.startswith("target_verify-B1-K2-")  # the file names caches already hold
    variants = [
        _key(one, key=GraphKey(GraphKind.target_verify, 1, 1)),
        _key(one, key=GraphKey(GraphKind.target_verify, 2, 2), slots=2),
        _key(one, slots=2),  # slots = the largest bucket: the state's shape
        _key(one, max_seq_len=32),
        _key(one, depth=3),
        _key(one, dtype=torch.bfloat16),
    ]
    stems = {cache.stem(k) for k in variants}
    assert len(stems) == len(variants) and cache.stem(base) not in stems
    prefill = _key(one, key=GraphKey(GraphKind.prefill, 1, 0))
    assert cache.stem(_key(one, key=GraphKey(GraphKind.prefill, 1, 0), chunk=16)) != cache.stem(prefill)
    # Another torch version: same file, found stale rather than missing.
    assert cache.stem({**base, "torch": "0.0"}) == cache.stem(base)
    other_config = write_echo_checkpoint(tmp_path / "wide", hidden=64, seed=1)
    assert cache.stem(_key(other_config)) != cache.stem(base)
    # Inductor splits its loops for the process's thread count: another count, another package.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cache.stem(_key(one)) != cache.stem(base)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the cache


def test_concurrent_captures_build_each_graph_once(captured):
    cache, outputs = captured
    built = [int(re.search(r"(\d+) built here", out).group(1)) for out in outputs]
    # The locks make a process wait for a key another is building, then load it; the first command's
    # helper builds some keys too, so the two commands' own builds add up to 4 at most.
    assert sum(built) <= 4, outputs
    assert "(1 helper process built beside this one)" in outputs[0] and "helper" not in outputs[1], outputs
    assert all("[####################] 4/4" in out for out in outputs)
    artifacts = GraphCache(cache).artifacts(environment)
    assert sorted(a.name for a in artifacts) == [
        "draft_decode/B1/K2",
        "draft_extend/B1/K2",
        "prefill/B1/K0",
        "target_verify/B1/K2",
    ]
    assert all(a.status == "valid" for a in artifacts)
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp files left
    # Code only: each package is a few MB at most whatever the weights (echo weights: ~0.1 MB).
    assert all(a.size < 8e6 for a in artifacts)


def test_inspect_lists_artifacts(captured):
    cache, _ = captured
    out = _finish(_python("-m", "compiled_mtp.cli", "inspect", "--cache-dir", str(cache)))
    assert f"{cache}: 4 graphs" in out
    assert (
        len(re.findall(r"/B1/K\d .* seq 64, 1 slots, K<=2, passes [0-9a-f]{8} .* 2\.13\.0.* valid", out)) == 4
    )


def test_the_per_user_cache_serves_without_a_profile(captured, checkpoints, tmp_path, monkeypatch):
    """from_pretrained's default cache is $XDG_CACHE_HOME/compiled_mtp/graphs, and a runtime loads every
    stored graph whose key its settings match, whether they come from a profile or not."""
    cache, _ = captured
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _copy(cache, tmp_path / "compiled_mtp" / "graphs")
    tiny = load_profile(PROFILE)
    rt = Runtime.from_pretrained(
        checkpoints[0], mtp_depth=2, batch_sizes=(1,), max_seq_len=64, prefill_chunk=tiny.prefill_chunk
    )
    assert _generate(rt)[0] == _reference(rt.model)
    assert rt.stats()["compiles"] == 0 and rt.graphs.loads == 4


def test_new_process_loads_with_zero_compiles_and_identical_output(captured, checkpoints):
    cache, _ = captured
    args = [json.dumps(a) for a in (PROMPTS, GREEDY, SAMPLED)]
    result = json.loads(
        _finish(
            _python("-c", NEW_PROCESS, str(checkpoints[0]), str(PROFILE), str(cache), *args)
        ).splitlines()[-1]
    )
    assert result["compiles"] == 0 and result["loads"] == 4
    eager = _runtime(checkpoints[0], None, backend="eager")
    assert result["outputs"] == _generate(eager)
    assert result["outputs"][0] == _reference(eager.model)


def test_one_artifact_serves_two_checkpoints(captured, checkpoints):
    cache, _ = captured
    runtimes = [_runtime(m, cache) for m in checkpoints]
    for rt in runtimes:
        assert _generate(rt)[0] == _reference(rt.model)
        assert rt.stats()["compiles"] == 0 and rt.graphs.loads == 4
    assert _generate(runtimes[0])[0] != _generate(runtimes[1])[0]
    assert len(list(cache.glob("*.pt2"))) == 4


def test_graphs_read_the_callers_weights_in_place(captured, checkpoints):
    """Weights are not copied into the graphs: overwrite the live tensors and every graph follows."""
    cache, _ = captured
    rt = _runtime(checkpoints[0], cache)
    _generate(rt)
    other = load_model(checkpoints[1])
    rt.model.load_state_dict(other.state_dict())  # copies into the existing tensors
    assert _generate(rt)[0] == _reference(other)
    assert rt.stats()["compiles"] == 0


def test_graphs_read_bfloat16_copies_that_follow_the_weights(tmp_path):
    """On weights of bfloat16 values the generated loops read bfloat16 copies of them (bfloat16_reads),
    made on load once for all graphs: the output is still the reference's, a checkpoint loaded into the
    same tensors reaches the copies with the next request, and an update to other values is refused
    with one line before anything is queued."""
    models = [
        write_echo_checkpoint(
            tmp_path / f"bf16-{s}", mtp_noise=0.3, attn_scale=0.5, seed=s, dtype=torch.bfloat16
        )
        for s in (1, 2)
    ]
    rt = _runtime(models[0], tmp_path / "cache", mtp_depth=1, mtp_depths=[1])  # three graphs, not four
    assert _generate(rt)[0] == _reference(rt.model)
    copied = {n for p in (tmp_path / "cache").glob("*.pt2") for n in aot._open(p).get_constant_fqns()}
    names = [bfloat16_reads.weight_of(n) for n in copied if n.startswith(bfloat16_reads.PREFIX)]
    weight = rt.model.get_parameter(names[0].removeprefix("model."))
    assert weight_copies.copy_bytes(weight) == 2 * weight.numel()  # what the bench's bound counts
    assert weight_copies.copy_bytes(rt.model.model.embed_tokens.weight) == 0  # its lookup reads float32
    other = load_model(models[1])
    rt.model.load_state_dict(other.state_dict())  # copies into the existing tensors
    assert _generate(rt)[0] == _reference(other)
    with torch.no_grad():
        rt.model.model.layers[0].self_attn.o_proj.weight.view(torch.int32)[0, 0] |= 1  # its lowest bit
    with pytest.raises(
        ValueError, match=r"^model\.model\.layers\.0\.self_attn\.o_proj\.weight: the graphs read"
    ):
        rt.add_request(PROMPTS[0], SamplingParams(**GREEDY))
    assert rt.num_waiting == 0 and rt.stats()["compiles"] == 3


def test_truncated_artifacts_are_found_corrupt_before_they_are_read(captured, checkpoints, tmp_path):
    """A package cut short (a full disk, an interrupted copy) is told by its size, by `inspect` and by
    the runtime's check alike; a runtime rebuilds whatever that check finds, as
    test_stale_artifacts_are_reported_and_rebuilt shows."""
    cache = _copy(captured[0], tmp_path / "cache")
    extend = _package(cache, "draft_extend")
    size = extend.stat().st_size
    truncate_file(extend)
    corrupt = f"corrupt (size {size // 2} bytes, expected {size})"
    assert GraphCache(cache).problem(_key(checkpoints[0], key=EXTEND_K2)) == corrupt
    status = {a.name: a.status for a in GraphCache(cache).artifacts(environment)}
    assert status.pop("draft_extend/B1/K2") == corrupt and set(status.values()) == {"valid"}


def _reseal(package: Path) -> None:
    """Make the metadata's size and checksum those of the package as it is now."""
    meta_path = package.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta |= {"size": package.stat().st_size, "sha256": hashlib.sha256(package.read_bytes()).hexdigest()}
    meta_path.write_text(json.dumps(meta))


def test_damaged_artifacts_are_reported_and_rebuilt(captured, checkpoints, tmp_path, caplog):
    """One fault per graph. Those the files show are found before loading, by the check every load
    makes (a fault it finds takes the rebuild test_stale_artifacts_are_reported_and_rebuilt runs);
    a package intact by its checksum that does not load is reported in one line naming it and the
    fault, and rebuilt in place; the output stays exact."""
    faults = _copy(captured[0], tmp_path / "faults")
    altered, missing, garbled = (
        _package(faults, kind) for kind in ("prefill", "target_verify", "draft_extend")
    )
    data = bytearray(altered.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    altered.write_bytes(bytes(data))
    missing.unlink()
    garbled.with_suffix(".json").write_text('{"format": 1, "key": ')
    for key, fault in [
        (PREFILL, "corrupt (checksum mismatch)"),
        (VERIFY_K2, "corrupt (package missing)"),
        (EXTEND_K2, "corrupt (metadata unreadable)"),
    ]:
        assert GraphCache(faults).problem(_key(checkpoints[0], key=key)) == fault
    cache = _copy(captured[0], tmp_path / "cache")
    unloadable = _package(cache, "draft_decode")
    write_garbage(unloadable)
    _reseal(unloadable)  # its checksum is the garbage's: only loading it can tell
    rt = _runtime(checkpoints[0], cache)
    with caplog.at_level(logging.WARNING, logger="compiled_mtp.capture"):
        assert _generate(rt)[0] == _reference(rt.model)
    assert rt.stats()["compiles"] == 1 and rt.graphs.loads == 3
    (line,) = _cache_log(caplog)
    assert line.startswith(f"capture cache: draft_decode/B1/K2 at {unloadable} is corrupt (cannot load: ")
    assert "\n" not in line
    assert all(a.status == "valid" for a in GraphCache(cache).artifacts(environment))
    again = _runtime(checkpoints[0], cache)
    assert _generate(again) == _generate(rt)
    assert again.stats()["compiles"] == 0 and again.graphs.loads == 4


# g++, linking libstdc++ statically into the shared objects it links: a compiler like the one that
# made CUDA packages crash their loader on a lent GPU machine (docs/capture.md).
STATIC_LIBSTDCXX_GXX = """#!/bin/sh
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; esac
exec g++ "$@"
"""


# The command line with the compiler given to Inductor alone, as CXX gives it: under CXX the engine's
# C++ ops would build again too, 20-70 s, into a library folder of that compiler's own.
INDUCTOR_CXX_CLI = """
import sys
import torch._inductor.config
torch._inductor.config.cpp.cxx = (None, sys.argv[1])
from compiled_mtp.cli import main
main(sys.argv[2:])
"""


def test_packages_with_their_own_libstdcxx_are_refused(captured, checkpoints, tmp_path):
    """A package whose code carries a copy of libstdc++ cannot be loaded beside torch's (std::bad_cast
    here, a segmentation fault there). The graph built by such a compiler is refused before the
    loader opens it: one line naming cache_dir and the compiler, exit status 2, and the cache keeps
    its valid packages and nothing half-written."""
    cache = _copy(captured[0], tmp_path / "cache")
    _package(cache, "draft_decode").unlink()
    gxx = tmp_path / "g++-static-libstdc++"
    gxx.write_text(STATIC_LIBSTDCXX_GXX)
    gxx.chmod(0o755)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            INDUCTOR_CXX_CLI,
            str(gxx),
            "generate",
            "--ids",
            "5 6 7",
            "--max-new-tokens",
            "4",
        ]
        + [
            "--model",
            str(checkpoints[0]),
            "--profile",
            str(PROFILE),
            "--cache-dir",
            str(cache),
            "--no-progress",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: cache_dir: the C++ compiler Inductor uses ({gxx}) links libstdc++ into each package"
        )
    )
    artifacts = GraphCache(cache).artifacts(environment)
    assert len(artifacts) == 3 and all(a.status == "valid" for a in artifacts)
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_readying_some_graphs_counts_those_in_its_progress(captured, checkpoints, tmp_path, caplog):
    """The demo readies the batch-1 graphs of a runtime that has more: its progress lines count the
    graphs it readies, not every graph the runtime might call."""
    cache = _copy(captured[0], tmp_path / "cache")
    _package(cache, "target_verify").unlink()
    rt = _runtime(checkpoints[0], cache)
    assert len(rt.graphs.keys) == 4
    progress.addHandler(caplog.handler)
    try:
        parallel.ready(rt, [PREFILL, VERIFY_K2])
    finally:
        progress.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == progress.name]
    assert lines == [f"building target_verify/B1/K2 into {cache} (1 of 2 graphs ready)"], lines
    assert rt.graphs.compiles == 1 and rt.graphs.loads == 1
    assert _generate(rt)[0] == _reference(rt.model)


def test_stale_artifacts_are_reported_and_rebuilt(captured, checkpoints, tmp_path, caplog):
    cache = _copy(captured[0], tmp_path / "cache")
    # Built by another torch version: the metadata says so.
    meta = _package(cache, "draft_decode").with_suffix(".json")
    meta.write_text(meta.read_text().replace(torch.__version__, "2.0.0"))
    assert (
        "stale (built for torch 2.0.0"
        in {a.name: a.status for a in GraphCache(cache).artifacts(environment)}["draft_decode/B1/K2"]
    )
    rt = _runtime(checkpoints[0], cache)
    with caplog.at_level(logging.WARNING, logger="compiled_mtp.capture"):
        assert _generate(rt)[0] == _reference(rt.model)
    assert rt.stats()["compiles"] == 1
    (line,) = _cache_log(caplog)
    decode = _package(cache, "draft_decode")
    assert line == (
        f"capture cache: draft_decode/B1/K2 at {decode} is stale (built for torch 2.0.0, not {torch.__version__}); "
        "rebuilding it"
    )
    # Another graph at this graph's path (another config's package copied over it): stale, so never
    # run but rebuilt, as each fault the runtime's check finds is.
    extend = _package(cache, "draft_extend")
    for suffix in (".pt2", ".json"):
        shutil.copy(decode.with_suffix(suffix), extend.with_suffix(suffix))
    problem = GraphCache(cache).problem(_key(checkpoints[0], key=EXTEND_K2))
    assert problem.startswith("stale (") and "built for kind draft_decode, not draft_extend" in problem
