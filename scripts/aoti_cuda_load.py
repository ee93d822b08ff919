"""Whether AOTInductor packages built for CUDA load and run here, from the plainest to the capture cache's use.

    python scripts/aoti_cuda_load.py                 # every stage, each in a process of its own
    python scripts/aoti_cuda_load.py --stage plain   # one stage, in this process

Stages (each compares its outputs with the same computation run eagerly):
- plain: a two-layer MLP through torch._inductor.aoti_compile_and_package and aoti_load_package;
- user_managed: the same MLP built as the capture cache builds (no weights in the package) and loaded
  as it loads (AOTIModelPackageLoader, then load_constants with the caller's tensors, user-managed);
- step: one target_verify step graph of a random tiny checkpoint, every custom pass on, through
  capture.aot's build and load;
- cache_cold, cache_warm: a runtime whose graphs come from a capture cache on this device (built in
  the first, loaded by the second process), its greedy tokens against eager steps'.

A stage that kills its process (a signal) is reported with the signal's name and the end of its output.

Inductor builds with the compiler in CXX (else g++). One that links libstdc++ into the packages makes
every stage fail, CPU ones too (docs/capture.md): plain then prints the libraries its code needs, and
the stages that build through capture.aot stop at its refusal. Run it with CXX set to a compiler
that links libstdc++ dynamically, such as the system's g++.
"""

from __future__ import annotations

import argparse
import copy
import signal
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn
from torch._inductor import cpp_builder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp import Runtime, SamplingParams  # noqa: E402
from compiled_mtp.capture import aot, elf  # noqa: E402
from compiled_mtp.capture.cache import GraphCache  # noqa: E402
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs  # noqa: E402
from compiled_mtp.graphs.state import StaticState  # noqa: E402
from compiled_mtp.models.checkpoint import load_model  # noqa: E402
from compiled_mtp.models.synthetic import preset_config, write_random_checkpoint  # noqa: E402
from compiled_mtp.passes.manager import inductor_options  # noqa: E402

PROMPTS = [[5, 17, 3, 9], [40, 2, 2, 9, 11, 60]]


def mlp(device: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(device)
    return model, torch.randn(4, 64, device=device)


def plain(device: str, work: Path) -> None:
    model, x = mlp(device)
    ep = torch.export.export(model, (x,))
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(work / "plain.pt2"))
    # A package that carries a libstdc++ of its own cannot load: see aot._check_cpp_runtime.
    with zipfile.ZipFile(package) as archive:
        needs = [elf.needed(archive.read(n)) for n in archive.namelist() if n.endswith(".so")]
    print(f"built by {cpp_builder.get_cpp_compiler()}; its code needs {needs}", flush=True)
    compare(torch._inductor.aoti_load_package(package)(x), model(x))


def user_managed(device: str, work: Path) -> None:
    model, x = mlp(device)
    package = work / "user_managed.pt2"
    aot.compile_package(torch.export.export(model, (x,)), package, {})
    runner = aot._open(package)
    weights = dict(model.named_parameters())
    runner.load_constants(
        {name: weights[name] for name in runner.get_constant_fqns()},
        check_full_update=True,
        user_managed=True,
    )
    compare(runner(x), model(x))


def step(device: str, work: Path) -> None:
    model = load_model(write_random_checkpoint(work / "tiny", preset_config("tiny")), device=device)
    state = StaticState(model, num_slots=2, max_seq_len=32, max_depth=2)
    key = GraphKey(GraphKind.target_verify, 2, 2)
    inputs = example_inputs(key, model, 8)
    inputs = (torch.tensor([0, 1], device=device), torch.tensor([5, 9], device=device), inputs[2])
    options = inductor_options()
    options["post_grad_custom_post_pass"].prepare(model)
    aot.build(key.kind, model, state, inputs, work / "step.pt2", options)
    eager_state = copy.deepcopy(state)
    expected = key.kind.step(model, eager_state, *inputs)
    compare(aot.load(work / "step.pt2", model, state)(*inputs), expected)


def cache(device: str, work: Path) -> None:
    checkpoint = work / "tiny"
    if not checkpoint.exists():
        write_random_checkpoint(checkpoint, preset_config("tiny"))
    model = load_model(checkpoint, device=device)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    options = {"mtp_depth": 2, "batch_sizes": (2,), "max_seq_len": 48, "prefill_chunk": 8}
    rt = Runtime(model, **options)
    # What Runtime(cache_dir=...) would do on CUDA without the CPU_ONLY refusal.
    rt.graphs.cache, rt.graphs.cuda_graphs = GraphCache(work / "graphs"), False
    got = [o.token_ids for o in rt.generate(PROMPTS, greedy)]
    eager = Runtime(model, compile_backend="eager", **options)
    expected = [o.token_ids for o in eager.generate(PROMPTS, greedy)]
    print(f"graphs built {rt.graphs.compiles}, loaded {rt.graphs.loads}")
    assert got == expected, f"{got} != {expected}"


def compare(got: object, expected: object) -> None:
    flat_got, flat_expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(flat_got) == len(flat_expected), f"{len(flat_got)} outputs, expected {len(flat_expected)}"
    for g, e in zip(flat_got, flat_expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


STAGES = {
    "plain": plain,
    "user_managed": user_managed,
    "step": step,
    "cache_cold": cache,
    "cache_warm": cache,
}


def run_stage(name: str, device: str, work: Path) -> str:
    """Run one stage in a child process: "passed", "failed: ..." or "killed by SIG...: ..."."""
    folder = work / name.removesuffix("_cold").removesuffix("_warm")  # the warm cache is the cold one's
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            __file__,
            "--stage",
            name,
            "--device",
            device,
            "--work",
            str(folder),
        ],
        capture_output=True,
        text=True,
    )
    tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])
    if done.returncode == 0:
        return f"passed: {tail}"
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}: {tail}"
    return f"failed (exit {done.returncode}): {tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stage", choices=sorted(STAGES), help="run only this stage, in this process")
    parser.add_argument("--work", type=Path, help="folder for the packages (default: a new temporary one)")
    args = parser.parse_args()
    if args.stage:
        work = args.work or Path(tempfile.mkdtemp())
        work.mkdir(parents=True, exist_ok=True)
        STAGES[args.stage](args.device, work)
        return
    print(f"torch {torch.__version__} on {args.device}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(STAGES)) as pool:
        work = args.work or Path(tmp)
        # The stages build at once, in their own processes, but the warm cache waits for the cold.
        first = {
            name: pool.submit(run_stage, name, args.device, work) for name in STAGES if name != "cache_warm"
        }
        first["cache_cold"].result()
        results = {**first, "cache_warm": pool.submit(run_stage, "cache_warm", args.device, work)}
        for name, result in results.items():
            print(f"{name}: {result.result()}", flush=True)


if __name__ == "__main__":
    main()
