"""Shared pytest setup: hypothesis profiles and session-scoped tiny checkpoints."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

# The commands and Runtime.from_pretrained default to the per-user capture cache: the tests get their own,
# which goes with the process (each pytest-xdist worker has one; removed below, after the imports).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="compiled_mtp_tests_")

# pytest-xdist: each worker takes its share of the cores (OpenMP threads beyond them spin at every
# barrier while another process holds the core), and so do the processes the tests start, whose
# graphs must be built for the same thread count as the worker's (it is in the capture cache's key).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

if not torch.cuda.is_available():  # before any Triton kernel is defined: they run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from compiled_mtp.ops import library

atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
library.load()  # the C++ ops: the tests name them (torch.ops.compiled_mtp.*) when they are collected
from hypothesis import HealthCheck, settings  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from compiled_mtp import DEFAULT_MODEL  # noqa: E402
from compiled_mtp.hf_baseline import load_hf  # noqa: E402
from compiled_mtp.models.synthetic import preset_config, write_random_checkpoint  # noqa: E402
from tests.checkpoints import (  # noqa: E402
    tiny_config,
    write_checkpoint,
    write_distilled_checkpoint,
    write_echo_checkpoint,
)

# "ci" (default): deterministic and quick. "thorough": HYPOTHESIS_PROFILE=thorough pytest ...
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`write_checkpoint(tiny_config())`: 2 layers (dense + MoE), one random MTP layer, fp32, seed 0."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config())


@pytest.fixture(scope="session")
def echo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`write_echo_checkpoint` at attn_scale 0, no MTP noise: near-100% greedy acceptance."""
    return write_echo_checkpoint(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="session")
def distilled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`write_distilled_checkpoint`: one MTP layer that uses the hidden and attention, drafts accepted
    about 60% of the times they are reached."""
    return write_distilled_checkpoint(tmp_path_factory.mktemp("distilled"))


@pytest.fixture(scope="session")
def distilled2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`write_distilled_checkpoint` with two MTP layers (depth 2 drafts with the second)."""
    return write_distilled_checkpoint(tmp_path_factory.mktemp("distilled2"), num_mtp_layers=2)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer checkpoint with the shipped model's tokenizer: text in and out, quickly."""
    path = write_random_checkpoint(
        tmp_path_factory.mktemp("text"), preset_config("tiny") | {"vocab_size": 4096, "num_hidden_layers": 2}
    )
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", path)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_checkpoint: Path) -> DeepseekV3ForCausalLM:
    """`tiny_checkpoint` loaded by `load_hf` (shared: do not modify)."""
    return load_hf(tiny_checkpoint)


@pytest.fixture(scope="session")
def echo_hf(echo_checkpoint: Path) -> DeepseekV3ForCausalLM:
    """`echo_checkpoint` loaded by `load_hf` (shared: do not modify)."""
    return load_hf(echo_checkpoint)


# pytest-xdist hands out whole files (--dist loadfile) in collection order (--no-loadscope-reorder).
# The files that build the most graphs go first, longest first, so that no worker is left running
# one of them alone at the end while the other has finished.
LONGEST_FIRST = (
    "test_passes.py",
    "test_capture.py",
    "test_compiled.py",
    "test_deepseek_v4.py",
    "test_inductor_paths.py",
    "test_glm.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
