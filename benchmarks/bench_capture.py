"""The capture cache: cold capture against warm start for every graph of a profile, and the demo's start-up.

    python benchmarks/bench_capture.py                              # profiles/default-cpu.toml, its model
    python benchmarks/bench_capture.py --profile P --model DIR      # any profile and checkpoint

- cold: `compiled-mtp capture` into an empty cache directory, with an empty Inductor cache as well
  (TORCHINDUCTOR_CACHE_DIR), so nothing compiled earlier is reused;
- warm: a new process builds the profile's Runtime on that cache and readies every graph; the time
  counts from creating the Runtime to the last graph loaded (importing torch and reading the
  checkpoint are reported apart), plus the resident memory those graphs added;
- demo: `compiled-mtp demo` twice on a fresh cache; for each run, the time from starting the process
  to its first generated tokens (the "K=0: graphs ready" line).
Every command runs in its own process, as a person would run it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp.capture.profile import PROFILES, load_profile  # noqa: E402

# Readies every graph of a profile from a cache in a fresh process; prints timings as JSON.
WARM = """
import json, sys, time
start = time.perf_counter()
import torch
from compiled_mtp import Runtime
from compiled_mtp.graphs.plan import example_inputs
from compiled_mtp.capture.profile import load_profile

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

imported = time.perf_counter()
profile = load_profile(sys.argv[2])
rt = Runtime.from_pretrained(sys.argv[1], **profile.runtime_options(), cache_dir=sys.argv[3])
loaded, before = time.perf_counter(), rss()
for key in rt.graphs.keys:
    rt.graphs.prepare(key, example_inputs(key, rt.model, rt.prefill_chunk))
ready = time.perf_counter()
weights = sum(t.numel() * t.element_size() for t in rt.model.state_dict().values())
print(json.dumps({"import_s": imported - start, "runtime_s": loaded - imported, "graphs_s": ready - loaded,
                  "compiles": rt.graphs.compiles, "loads": rt.graphs.loads, "rss_growth": rss() - before,
                  "weights": weights}))
"""


def _env(inductor_cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}


def _run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:4])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def cold_capture(model: Path, profile: Path, cache: Path, env: dict[str, str]) -> tuple[float, str]:
    out = _run(
        [
            "-m",
            "compiled_mtp.cli",
            "capture",
            "--profile",
            str(profile),
            "--model",
            str(model),
            "--cache-dir",
            str(cache),
        ],
        env,
    )
    print(out, end="")
    return float(re.search(r"done in ([\d.]+) s", out).group(1)), out


def warm_start(model: Path, profile: Path, cache: Path, env: dict[str, str]) -> dict:
    return json.loads(_run(["-c", WARM, str(model), str(profile), str(cache)], env).splitlines()[-1])


def demo_start(cache: Path, env: dict[str, str]) -> float:
    """Seconds from starting `compiled-mtp demo` to its first generated tokens; the run is finished."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compiled_mtp.cli",
            "demo",
            "--cache-dir",
            str(cache),
            "--max-new-tokens",
            "16",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    first = None
    for line in proc.stdout:
        if first is None and line.strip().startswith("K=0: graphs ready"):
            first = time.perf_counter() - start
        print("    " + line, end="")
    if proc.wait() or first is None:
        raise SystemExit("compiled-mtp demo failed")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=PROFILES / "default-cpu.toml")
    parser.add_argument("--model", type=Path, help="default: the profile's model")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    model = args.model or load_profile(args.profile).model
    if model is None or not (model / "config.json").exists():
        raise SystemExit(f"model: {model} is not a checkpoint directory; pass --model DIR")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = _env(tmp / "inductor")
        print(f"cold capture of {args.profile} for {model}")
        cold, _ = cold_capture(model, args.profile, tmp / "cache", env)
        warm = warm_start(model, args.profile, tmp / "cache", env)
        sizes = [p.stat().st_size for p in (tmp / "cache").glob("*.pt2")]
        print(
            f"\ncold capture: {cold:.1f} s for {len(sizes)} graphs ({cold / len(sizes):.1f} s each)\n"
            f"warm start:   {warm['graphs_s']:.2f} s for {warm['loads']} graphs, {warm['compiles']} compiled "
            f"({100 * warm['graphs_s'] / cold:.1f}% of cold; import torch {warm['import_s']:.1f} s and "
            f"read the checkpoint {warm['runtime_s']:.1f} s come before it)\n"
            f"artifacts:    {sum(sizes) / 1e6:.1f} MB in all, {max(sizes) / 1e6:.1f} MB the largest; weights "
            f"{warm['weights'] / 1e6:.1f} MB; "
            f"resident memory added by loading every graph: {warm['rss_growth'] / 1e6:.1f} MB"
        )
        if not args.skip_demo:
            print("\ncompiled-mtp demo, first run (empty cache):")
            first = demo_start(tmp / "demo-cache", env)
            print("compiled-mtp demo, second run:")
            second = demo_start(tmp / "demo-cache", env)
            print(
                f"\ndemo: first tokens {first:.1f} s after start on the first run, {second:.1f} s on the second"
            )


if __name__ == "__main__":
    main()
