"""The `compiled-mtp` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .models.config import CheckpointError
from .models.synthetic import PRESETS, preset_config, write_random_checkpoint
from .runtime import Runtime, SamplingParams


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "compiled_mtp"


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"prompt: expected token ids separated by spaces or commas, got {text!r}") from None


def _runtime(args: argparse.Namespace, depth: int) -> Runtime:
    return Runtime.from_pretrained(
        args.model,
        mtp_depth=depth,
        batch_sizes=(1,),
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
        device=args.device,
        compile_backend=args.backend,
    )


def _report(rt: Runtime, outs, seconds: float) -> None:
    tokens = sum(len(o.token_ids) for o in outs)
    s = rt.stats()
    rates = ", ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"]) or "-"
    print(
        f"  K={rt.mtp_depth}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), "
        f"acceptance length {s['acceptance_length']:.2f}, per-position acceptance [{rates}], "
        f"compiles {s['compiles']}, recompiles {s['recompiles']}"
    )


def cmd_generate(args: argparse.Namespace) -> None:
    rt = _runtime(args, args.mtp_depth)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    prompt = _parse_ids(args.prompt)
    rt.generate([prompt], params)  # first run compiles
    start = time.perf_counter()
    out = rt.generate([prompt], params)[0]
    print(" ".join(map(str, out.token_ids)))
    print(f"finish_reason={out.finish_reason} drafted={out.num_draft_tokens} accepted={out.num_accepted_tokens}")
    _report(rt, [out], time.perf_counter() - start)


def cmd_random_checkpoint(args: argparse.Namespace) -> None:
    path = write_random_checkpoint(args.out, preset_config(args.preset), seed=args.seed)
    print(f"wrote a random {args.preset!r} DeepSeek-V3 checkpoint to {path}")


def cmd_demo(args: argparse.Namespace) -> None:
    model = _user_cache() / "demo-tiny-random"
    if not (model / "config.json").exists():
        write_random_checkpoint(model, preset_config("tiny"), seed=0)
        print(f"built a tiny random DeepSeek-V3 checkpoint with one MTP layer in {model}")
    print("(random weights: the MTP layer is untrained, so acceptance is near zero)")
    rt = Runtime.from_pretrained(
        model, mtp_depth=3, mtp_depths=(0, 3), batch_sizes=(1,), max_seq_len=args.max_seq_len,
        dtype=args.dtype, device=args.device, compile_backend=args.backend,
    )
    prompt = list(range(1, 17))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for depth in (0, 3):
        rt.mtp_depth = depth
        start = time.perf_counter()
        rt.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
        print(f"  K={depth}: graphs ready in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        outs = rt.generate([prompt], params)
        _report(rt, outs, time.perf_counter() - start)
    print("generated:", " ".join(map(str, outs[0].token_ids)))


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="inductor", choices=("inductor", "eager"), help="eager runs uncompiled")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="compiled-mtp", description="MTP speculative decoding on captured torch.compile graphs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from token ids")
    g.add_argument("prompt", help="token ids, e.g. '1 2 3'")
    g.add_argument("--model", required=True, type=Path)
    g.add_argument("--mtp-depth", type=int, default=3)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    _add_engine_options(g)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("random-checkpoint", help="write a random DeepSeek-V3-shaped checkpoint")
    r.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_random_checkpoint)

    d = sub.add_parser("demo", help="generate with and without MTP on a small model")
    d.add_argument("--max-new-tokens", type=int, default=64)
    _add_engine_options(d)
    d.set_defaults(func=cmd_demo)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
