"""`compiled-mtp bench`: its arguments, and the run that measures, reports and writes the results."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import hf_baseline, llama_cpp_peer
from ..capture.cache import user_cache
from ..capture.compiler import BACKENDS
from ..capture.profile import DEFAULT_MODEL
from ..expert_reads import Routing, record
from ..folders import writable_folder
from ..llama_cpp_peer import LlamaCpp, LlamaCppMTP
from ..models.checkpoint import load_model
from ..models.draft_vocab import read_ranking
from ..models.family import CausalLM
from ..models.gguf_export import LAYOUTS, export_gguf
from ..ops import library
from ..passes.manager import add_pass_switch
from ..runtime import DTYPES, check_device
from .bound import (
    add_bounds,
    add_roofline,
    bandwidth_bound,
    copy_bandwidth,
    extend_experts_every_row,
    first_depth_bytes,
    gemm_rate,
    resident_bandwidth,
    routed_bytes,
    tile_rate,
    verify_experts,
    weight_bytes,
    weight_flops,
)
from .engine import Peers, bench_engine, timed_prompts
from .goals import goals
from .hf import bench_hf
from .prompts import Prompts, bench_prompts
from .report import plot, print_report
from .results import BenchResult, Bound, Meta

GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
MATPLOTLIB_MISSING = "matplotlib is not installed: install the bench extra: pip install 'compiled_mtp[bench]'"


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    return f"CPU {cpu}, {torch.get_num_threads()} threads"


def _check(args: argparse.Namespace) -> None:
    """One-line errors for options that would fail only after minutes of measuring."""
    if not args.depths or min(args.depths) < 0:
        raise ValueError(f"depths: must be integers >= 0, got {args.depths}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"batch-sizes: must be integers >= 1, got {args.batch_sizes}")
    if args.runs < 1:
        raise ValueError(f"runs: must be >= 1, got {args.runs}")
    if args.new_tokens < max(args.depths) + 3:
        # K + 3 tokens make every request decode at least two steps, whatever it accepts: the first step
        # also prefills, so the per-iteration figures need a second.
        raise ValueError(
            f"new-tokens: must be >= max depth + 3 = {max(args.depths) + 3}, got {args.new_tokens}"
        )
    if min(args.prompt_len, args.accept_prompts, args.timed_prompts, args.copy_mb) < 1:
        raise ValueError("prompt-len, accept-prompts, timed-prompts and copy-mb: must be >= 1")
    if args.prompt_len < max(args.depths) + 2:
        # Where a draft extend routes every row of its block (DeepSeek-V4), the bound measures its routing
        # on windows of K + 1 positions of each prompt's MTP rows, which start at its second token.
        raise ValueError(
            f"prompt-len: must be >= max depth + 2 = {max(args.depths) + 2}, got {args.prompt_len}"
        )
    if not (args.model / "config.json").exists():
        raise ValueError(f"model: {args.model} has no config.json")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise ValueError(f"draft-vocab: must be >= 1, got {args.draft_vocab}")
    check_device(args.device)
    writable_folder(args.out, "out")  # made now: a folder it cannot write would lose the run at its end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `compiled-mtp bench`."""
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="checkpoint directory (default: the shipped default model)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=user_cache(), help="capture cache directory (default: %(default)s)"
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="build every graph in this process, store none (default: use the cache)",
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=BACKENDS,
        help="eager runs the step functions uncompiled (default: inductor)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=tuple(DTYPES), help="engine and HF dtype (default: float32)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--new-tokens", type=int, default=128, help="tokens generated per request (default: 128)"
    )
    parser.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3, 4],
        help='MTP depths K; a row at mtp_depth="auto" over them is added (default: 0 1 2 3 4)',
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="batch sizes B (default: 1 4 16)"
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="draft among the model's N most frequent tokens (default: every token)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed runs per row after a warm-up; the best counts (default: 3)"
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument(
        "--accept-prompts", type=int, default=24, help="prompts for the acceptance measurement (default: 24)"
    )
    parser.add_argument(
        "--timed-prompts",
        type=int,
        default=8,
        help="prompts every system generates per timed run, B at a time (default: 8, rounded up to a multiple of B)",
    )
    parser.add_argument(
        "--copy-mb",
        type=int,
        default=256,
        help="tensor size for the copy-bandwidth measurement (default: 256)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks"),
        help="directory for bench-<device>.json and .png (default: benchmarks)",
    )
    parser.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="skip the llama.cpp rows (default: run them on CPU when llama-cpp-python is installed)",
    )
    add_pass_switch(parser)
    library.add_bfloat16_option(parser)


def _llama_cpp(args: argparse.Namespace, model_type: str, folder: Path) -> Peers:
    """llama.cpp on a GGUF export of the model into `folder`, when it is installed and the device is
    the CPU: its plain decoding, and its MTP speculative decoding at each depth above 0 the bench
    runs where its llama.cpp has the MTP graph."""
    skipped = (
        "--no-llama-cpp"
        if args.no_llama_cpp
        else "CPU only"
        if torch.device(args.device).type != "cpu"
        else None
    )
    if skipped is None and model_type not in LAYOUTS:
        skipped = f"llama.cpp's GGUF has no architecture for {model_type} in this gguf package"
    if skipped is None and not llama_cpp_peer.available():
        skipped = llama_cpp_peer.MISSING
    if skipped:
        print(f"  no llama.cpp row: {skipped}", flush=True)
        return {}
    context, threads = args.prompt_len + args.new_tokens, torch.get_num_threads()
    path = export_gguf(args.model, folder / "model.gguf", GGUF_DTYPES[args.dtype])
    peers: Peers = {"llama.cpp": LlamaCpp(path, context=context, threads=threads)}
    depths = [k for k in args.depths if k > 0]
    if not depths:
        return peers
    if not llama_cpp_peer.mtp_available():
        print(f"  no llama.cpp MTP rows: {llama_cpp_peer.NO_MTP}", flush=True)
        return peers
    path = export_gguf(args.model, folder / "mtp.gguf", GGUF_DTYPES[args.dtype], with_mtp=True)
    try:
        for k in depths:
            peers[f"llama.cpp MTP K={k}"] = LlamaCppMTP(path, context, threads, k)
    except ValueError as e:  # a llama.cpp that loads no NextN block, or makes no MTP context
        print(f"  no llama.cpp MTP rows: {e}", flush=True)
        return {"llama.cpp": peers["llama.cpp"]}
    return peers


def run(args: argparse.Namespace) -> None:
    """Run the whole benchmark, print the report and write the JSON and the plot."""
    _check(args)
    try:
        hf_version = hf_baseline.transformers_version()
        import matplotlib  # noqa: F401  (checked now, not after the measurements)
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: {MATPLOTLIB_MISSING if e.name == 'matplotlib' else e}") from None
    args.depths, args.batch_sizes = sorted(set(args.depths)), sorted(set(args.batch_sizes))
    model = load_model(
        args.model, dtype=DTYPES[args.dtype], device=args.device, with_mtp=max(args.depths) > 0
    )
    if args.draft_vocab is not None:
        model.restrict_drafts(
            torch.tensor(read_ranking(args.model, model.cfg.vocab_size)[: args.draft_vocab])
        )
    timed = max(timed_prompts(args.timed_prompts, b) for b in args.batch_sizes)
    prompts = bench_prompts(
        args.model, model.cfg.vocab_size, max(args.accept_prompts, timed), args.prompt_len
    )
    meta = _meta(args, prompts, hf_version)
    print(f"benchmarking {args.model} on {meta.device_name}; prompts: {prompts.detail}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        systems = _llama_cpp(args, model.model_type, Path(folder))
        acceptance, engine, peers, meta.compiles, meta.recompiles = bench_engine(
            model, prompts, args, systems
        )
        del systems
    reads = _model_reads(model, prompts, args)
    del model  # HF loads its own copy next
    hf, meta.hf_attention = bench_hf(args.model, prompts.token_ids, args)
    bound = _bound(reads, args)
    add_bounds(engine, bound)
    result = BenchResult(meta, acceptance, engine, hf, bound, peers, [])
    result.goals = goals(result)
    print_report(result)
    _write(result, args)


def _meta(args: argparse.Namespace, prompts: Prompts, hf_version: str) -> Meta:
    return Meta(
        model=str(args.model),
        device=args.device,
        device_name=device_name(args.device),
        dtype=args.dtype,
        backend=args.backend,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=hf_version,
        python=platform.python_version(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        runs=args.runs,
        depths=args.depths,
        batch_sizes=args.batch_sizes,
        prompt_source=prompts.source,
        prompts=prompts.detail,
        accept_prompts=args.accept_prompts,
        draft_vocab=args.draft_vocab,
        bfloat16_mlps=args.device == "cpu" and args.dtype == "float32" and library.bfloat16_products(),
    )


@dataclass
class _Reads:
    """What the bound needs from the model, taken before it is freed: weight bytes and multiply-adds,
    and the routed experts' bytes and counts on the prompts."""

    target_bytes: int
    mtp_bytes: list[int]
    flops: tuple[int, list[int], int]
    routing: Routing
    routed: dict[str, int]


def _model_reads(model: CausalLM, prompts: Prompts, args: argparse.Namespace) -> _Reads:
    target_bytes, mtp_bytes = weight_bytes(model)
    routing = record(model, prompts.token_ids, max(args.depths))
    routed = routed_bytes(routing, args.depths, args.batch_sizes, extend_experts_every_row(model))
    return _Reads(target_bytes, mtp_bytes, weight_flops(model), routing, routed)


def _bound(reads: _Reads, args: argparse.Namespace) -> Bound:
    """The bandwidth bound and the roofline, from this machine's measured rates."""
    bandwidth = copy_bandwidth(args.device, args.copy_mb)
    resident = resident_bandwidth(args.device, first_depth_bytes(reads.target_bytes, reads.mtp_bytes))
    bound = bandwidth_bound(
        reads.target_bytes,
        reads.mtp_bytes,
        bandwidth,
        args.copy_mb * 2**20,
        resident,
        args.depths,
        args.batch_sizes,
        reads.routed,
    )
    bound.expert_count = reads.routing.target[0].expert_count() if reads.routing.target else 0
    bound.verify_experts = verify_experts(reads.routing, args.depths, args.batch_sizes)
    dtype = DTYPES[args.dtype]
    add_roofline(bound, reads.flops, gemm_rate(args.device, dtype), tile_rate(args.device, dtype))
    return bound


def _write(result: BenchResult, args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench-{torch.device(args.device).type}"
    stem.with_suffix(".json").write_text(json.dumps(asdict(result), indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
