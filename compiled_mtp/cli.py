"""The `compiled-mtp` command line."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from . import bench
from .capture import parallel
from .capture.aot import ArtifactError, environment
from .capture.cache import GraphCache, user_cache
from .capture.compiler import progress
from .capture.profile import DEFAULT_MODEL, PROFILES, Profile, ProfileError, load_profile
from .depth_policy import depth_arg
from .detokenize import IncrementalText
from .folders import not_a_folder, writable_folder
from .graphs.plan import example_inputs
from .graphs.state import LAG_WINDOW
from .models.config import CheckpointError
from .models.draft_vocab import token_ranking, write_ranking
from .models.gguf_export import DTYPES as GGUF_DTYPES
from .models.gguf_export import export_gguf
from .models.registry import family_of, read_config
from .models.synthetic import PRESETS, preset_config, write_random_checkpoint
from .ops.library import add_bfloat16_option, apply_bfloat16_option
from .passes.manager import add_pass_switch, without
from .runtime import MAX_SEED, RequestOutput, Runtime, SamplingParams
from .tokenizer import Tokenizer

# Engine settings when neither a flag nor a profile gives them (max_seq_len None: the runtime's default).
ENGINE_DEFAULTS = {"max_seq_len": None, "dtype": "float32", "device": "cpu", "draft_vocab": None}


def _graph_cache() -> Path:
    """The capture cache every command uses when given no --cache-dir."""
    return user_cache()


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"prompt: expected token ids separated by spaces or commas, got {text!r}") from None


def _prompt_texts(args: argparse.Namespace) -> list[str]:
    """The prompt given on the command line, or each non-blank line of --prompts-file."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError(
            "prompt: give a prompt or --prompts-file" + (", not both" if args.prompt is not None else "")
        )
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"prompts-file: cannot read {args.prompts_file} ({e.__class__.__name__}: {e})"
        ) from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"prompts-file: {args.prompts_file} holds no prompts (one per line)")
    return texts


def _engine_options(args: argparse.Namespace, profile: Profile | None) -> dict:
    """Runtime settings: a flag given on the command line, else the profile's, else ENGINE_DEFAULTS.
    With the profile's settings the runtime's graphs are the ones `capture` stored for it."""
    options: dict[str, Any] = (
        profile.runtime_options() if profile else {"mtp_depth": 3, "batch_sizes": (1,), **ENGINE_DEFAULTS}
    )
    options |= {name: getattr(args, name) for name in ENGINE_DEFAULTS if getattr(args, name) is not None}
    if "prefill_chunk" in options:  # the profile's, which a shorter --max-seq-len caps
        options["prefill_chunk"] = min(options["prefill_chunk"], options["max_seq_len"])
    cache_dir = None if getattr(args, "no_cache", False) else args.cache_dir
    return options | {
        "compile_backend": getattr(args, "backend", "inductor"),
        "cache_dir": cache_dir,
        "passes": without(args.disable_pass),
    }


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _report(rt: Runtime, outs: list[RequestOutput], seconds: float) -> None:
    tokens = sum(len(o.token_ids) for o in outs)
    s = rt.stats()
    rates = ", ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"]) or "-"
    depths = f" (steps per depth {s['depth_histogram']})" if rt.mtp_depth == "auto" else ""
    print(
        f"  K={rt.mtp_depth}{depths}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), "
        f"acceptance length {s['acceptance_length']:.2f}, per-position acceptance [{rates}], "
        f"compiles {s['compiles']}, recompiles {s['recompiles']}"
    )


def _ids_text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _run(
    rt: Runtime, prompts: list, heads: list[str], params: SamplingParams, stops: list[str], stream: bool
) -> list[RequestOutput]:
    """Run the prompts to completion and write each one's head and text, in prompt order; with `stream`,
    as the tokens are committed (the next request's text follows once the one before it finished)."""
    decode = rt.tokenizer.decode if rt.tokenizer else _ids_text
    texts = {
        rt.add_request(p, params): IncrementalText(decode, stops, head) for p, head in zip(prompts, heads)
    }
    outs: dict[int, RequestOutput] = {}
    pending = list(texts)  # ids not yet written in full, in prompt order
    while rt.has_unfinished():
        for s in rt.step():
            text = texts[s.request_id]
            text.add(s.new_token_ids, s.output is not None)
            if s.output is not None:
                outs[s.request_id] = s.output
            elif text.stopped and (aborted := rt.abort(s.request_id)):  # at a stop text: its slot goes
                outs[s.request_id] = aborted
        while stream and pending:
            sys.stdout.write(_take(texts[pending[0]], outs.get(pending[0])))
            if pending[0] not in outs:
                break
            pending.pop(0)
        sys.stdout.flush()
    for i in pending:
        sys.stdout.write(_take(texts[i], outs[i]))
    return [outs[i] for i in texts]


def _take(text: IncrementalText, out: RequestOutput | None) -> str:
    """The text not written yet; once the request finished, with its finish line."""
    chunk = text.take()
    if out is not None:
        reason = "stop" if text.stopped else out.finish_reason
        chunk += (
            f"\nfinish_reason={reason} drafted={out.num_draft_tokens} accepted={out.num_accepted_tokens}\n"
        )
    return chunk


def cmd_generate(args: argparse.Namespace) -> None:
    texts = _prompt_texts(args)
    if "" in args.stop:
        raise ValueError("stop: must not be empty")
    options = _runtime_options(args)
    rt = Runtime.from_pretrained(args.model, **options)
    if args.stop and rt.tokenizer is None:
        raise ValueError(f"stop: {args.model} has no tokenizer.json to decode text with")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    by_ids = args.ids or rt.tokenizer is None
    prompts = [_parse_ids(t) if by_ids else t for t in texts]
    # Token ids print as the output's ids alone; text prints as prompt and continuation.
    heads = ["" if rt.tokenizer is None else t for t in texts]
    rt.generate(prompts, params)  # the first run compiles the graphs or loads them from the cache
    rt.reset_stats()
    start = time.perf_counter()
    outs = _run(rt, prompts, heads, params, args.stop, args.stream)
    _report(rt, outs, time.perf_counter() - start)


def _runtime_options(args: argparse.Namespace) -> dict:
    """generate's and serve's engine settings: those of `_engine_options`, with --mtp-depth's depth
    added to the captured ones."""
    options = _engine_options(args, _profile_for(args))
    if args.mtp_depth is not None:
        extra = () if args.mtp_depth == "auto" else (args.mtp_depth,)
        options |= {
            "mtp_depth": args.mtp_depth,
            "mtp_depths": (*options.get("mtp_depths", ()), *extra) or None,
        }
    return options


def _profile_for(args: argparse.Namespace) -> Profile | None:
    """--profile's; for the shipped model without one, the demo's, so that the graphs it stored serve."""
    if args.profile:
        return load_profile(args.profile)
    return (
        load_profile(PROFILES / "default-cpu.toml")
        if args.model.resolve() == DEFAULT_MODEL.resolve()
        else None
    )


def cmd_random_checkpoint(args: argparse.Namespace) -> None:
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"seed: must be in [0, 2**63 - 1], got {args.seed}")
    config = preset_config(args.preset)
    path = write_random_checkpoint(writable_folder(args.out, "out"), config, seed=args.seed)
    print(f"wrote a random {args.preset!r} {family_of(config).name} checkpoint to {path}")


def cmd_export_gguf(args: argparse.Namespace) -> None:
    if args.out.is_dir():
        raise ValueError(f"out: {args.out} is a directory; name the .gguf file to write")
    writable_folder(args.out.parent, "out")
    try:
        path = export_gguf(args.model, args.out, args.dtype, with_mtp=args.with_mtp)
    except ImportError as e:
        raise ValueError(str(e)) from None
    what = "target model and MTP layers" if args.with_mtp else "target model (no MTP layer)"
    print(f"wrote {path} ({_size(path.stat().st_size)}): {args.model}'s {what} for llama.cpp")


DEMO_PROMPT = 'def read_config(path):\n    """Return the parsed configuration file at *path*."""\n'


def cmd_demo(args: argparse.Namespace) -> None:
    profile = load_profile(PROFILES / "default-cpu.toml")
    options = _engine_options(args, profile) | {"mtp_depths": (0, 3)}
    assert profile.model is not None, "default-cpu.toml names the shipped model"
    rt = Runtime.from_pretrained(profile.model, **options)
    print(
        f"model: {profile.model} (DeepSeek-V3 architecture, {rt.model.cfg.num_hidden_layers} layers + 1 MTP layer)"
    )
    if rt.graphs.cache:
        print(
            f"capture cache: {rt.graphs.cache.root} (the first run builds the graphs, later runs load them)"
        )
    start = time.perf_counter()
    keys = [key for key in rt.graphs.keys if key.batch == 1]  # the demo's one request at a time
    with parallel.helpers(rt, profile.model, options, keys) as started:
        parallel.ready(rt, keys)
    beside = (
        f", with {started} helper process{'es' * (started > 1)} building beside this one" if started else ""
    )
    print(
        f"graphs ready in {time.perf_counter() - start:.1f} s ({rt.graphs.compiles} "
        f"built here, {rt.graphs.loads} loaded from the cache{beside})"
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for depth in (0, 3, "auto"):  # auto chooses between the other two's graphs, step by step
        rt.mtp_depth = depth
        start, compiles, loads = time.perf_counter(), rt.graphs.compiles, rt.graphs.loads
        # Long enough for depth 0 to reach a catch-up, so that its graph too is ready before the timing.
        rt.generate([DEMO_PROMPT], SamplingParams(max_new_tokens=LAG_WINDOW + 4, ignore_eos=True))
        print(
            f"  K={depth}: graphs ready in {time.perf_counter() - start:.1f} s "
            f"({rt.graphs.compiles - compiles} compiled, {rt.graphs.loads - loads} loaded from the cache)"
        )
        rt.reset_stats()
        start = time.perf_counter()
        outs = rt.generate([DEMO_PROMPT], params)
        _report(rt, outs, time.perf_counter() - start)
    print("generated (auto, greedy):\n" + DEMO_PROMPT + (outs[0].text or ""))


def cmd_calibrate(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.find(args.model)
    if tokenizer is None:
        raise ValueError(f"model: {args.model} has no tokenizer.json to count tokens with")
    vocab = read_config(args.model / "config.json")[1].vocab_size
    streams = []
    for path in args.text:
        try:
            streams.append(tokenizer.encode(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"text: cannot read {path} ({e.__class__.__name__}: {e})") from None
    ranking = token_ranking(streams, vocab)
    tokens = sum(len(s) for s in streams)
    out = write_ranking(args.model, ranking, f"{len(streams)} files, {tokens} tokens")
    top = set(ranking[: vocab // 4])
    covered = sum(t in top for s in streams for t in s) / max(tokens, 1)
    print(
        f"wrote {out}: {tokens} tokens counted; the top {vocab // 4} of {vocab} ids cover {100 * covered:.1f}% of them"
    )


def cmd_capture(args: argparse.Namespace) -> None:
    profile = load_profile(args.profile)
    model = args.model or profile.model
    if model is None:
        raise ValueError(f"model: {args.profile} names no model; pass --model DIR")
    why = GraphCache(args.cache_dir).unwritable()
    if why:
        raise ValueError(f"cache_dir: {why}; capture stores graphs there")
    if args.processes < 1:
        raise ValueError(f"processes: must be at least 1, got {args.processes}")
    options = _engine_options(args, profile)
    rt = Runtime.from_pretrained(model, **options)
    keys = list(rt.graphs.keys)  # the profile's buckets and depths: every graph its runtime may call
    cache = rt.graphs.cache
    assert cache is not None  # cache_dir was checked writable above
    print(
        f"capturing {len(keys)} graphs of {model} into {cache.root}\n"
        f"profile {args.profile}: {options['dtype']} on {options['device']}, "
        f"batch buckets {list(profile.batch_sizes)}, MTP depths {list(profile.mtp_depths)}, "
        f"max_seq_len {options['max_seq_len']}, prefill chunk {profile.prefill_chunk}"
    )
    start = time.perf_counter()
    with parallel.helpers(rt, model, options, keys, args.processes) as started:
        _ready_with_bar(rt, keys)
    built, held = rt.graphs.compiles, GraphCache(cache.root).artifacts(environment)
    beside = f" ({started} helper process{'es' * (started > 1)} built beside this one)" if started else ""
    print(
        f"done in {time.perf_counter() - start:.1f} s: {built} built here, {len(keys) - built} loaded{beside}; "
        f"it holds {len(held)} graphs, {_size(sum(a.size for a in held))} "
        f"(list them: compiled-mtp inspect --cache-dir {cache.root})"
    )


def _ready_with_bar(rt: Runtime, keys: list) -> None:
    """Load or build each graph of `keys`, a progress-bar line each."""
    for i, key in enumerate(keys, 1):
        bar = "#" * (20 * i // len(keys))
        print(f"[{bar:<20}] {i}/{len(keys)} {key.name:<22}", end=" ", flush=True)
        graph_start, compiles = time.perf_counter(), rt.graphs.compiles
        rt.graphs.prepare(key, example_inputs(key, rt.model, rt.prefill_chunk))
        how = "built" if rt.graphs.compiles > compiles else "loaded"
        print(f"{how} in {time.perf_counter() - graph_start:.1f} s", flush=True)


def _listening_socket(host: str, port: int) -> socket.socket:
    """host:port bound at once, so that a taken port fails before any graph is built; it accepts
    connections once the server starts."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in [0, 65535], got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        raise ValueError(f"host/port: cannot listen on {host}:{port} ({e})") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> None:
    try:  # the serve extra; the engine alone does not need it
        from .server.app import create_app, http_server
        from .server.chat import ChatTemplate
    except ImportError as e:
        raise ValueError(f"serve: {e.name} is not installed; pip install 'compiled_mtp[serve]'") from None
    if args.max_queue < 0:
        raise ValueError(f"max_queue: must be >= 0, got {args.max_queue}")
    sock = _listening_socket(args.host, args.port)
    options = _runtime_options(args)
    if args.batch_sizes is not None:
        options["batch_sizes"] = args.batch_sizes
    rt = Runtime.from_pretrained(args.model, **options)
    if rt.tokenizer is None:
        raise ValueError(f"model: {args.model} has no tokenizer.json; the server needs one to return text")
    keys = list(rt.graphs.keys)
    if rt.graphs.cache:
        missing = len(parallel.missing(rt, keys))
        what = f"building {missing} of {len(keys)} graphs" if missing else f"loading {len(keys)} graphs"
        print(f"{what} ({rt.graphs.cache.root}) before serving", flush=True)
        progress.disabled = True  # the bar reports each graph
        with parallel.helpers(rt, args.model, options, keys):
            _ready_with_bar(rt, keys)
    name = args.model.resolve().name
    app = create_app(rt, name, ChatTemplate.of_checkpoint(args.model), args.api_key, args.max_queue)
    sock.listen()  # connections wait in the backlog until the server's loop accepts them
    host, port = sock.getsockname()[:2]
    print(
        f"serving {name} on http://{host}:{port}/v1 ({rt.num_slots} slots, K={rt.mtp_depth}, "
        f"queue {args.max_queue}); SIGTERM or Ctrl-C drains and exits",
        flush=True,
    )
    http_server(app).run(sockets=[sock])


def cmd_inspect(args: argparse.Namespace) -> None:
    root = Path(args.cache_dir).expanduser()
    if not root.is_dir():
        raise ValueError(not_a_folder(root, "cache_dir") or f"cache_dir: {root} does not exist")
    artifacts = GraphCache(root).artifacts(environment)
    if not artifacts:
        print(f"{root}: no captured graphs")
        return
    print(f"{root}: {len(artifacts)} graphs, {_size(sum(a.size for a in artifacts))}")
    rows = [("key", "model", "settings", "size", "created", "torch", "status")]
    rows += [
        (a.name, a.model, a.settings, _size(a.size), a.created[:16].replace("T", " "), a.torch, a.status)
        for a in artifacts
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def _add_engine_options(p: argparse.ArgumentParser, backend: bool = True) -> None:
    p.add_argument(
        "--max-seq-len",
        type=int,
        help="longest prompt + output, at most the checkpoint's max_position_embeddings (default: the "
        "profile's, else max_position_embeddings or 2048, the fewer)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help=f"weights and activations (default: the profile's, else {ENGINE_DEFAULTS['dtype']})",
    )
    p.add_argument(
        "--device", help=f"cpu or cuda[:N] (default: the profile's, else {ENGINE_DEFAULTS['device']})"
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="draft among the model's N most frequent tokens (its draft_vocab.json, see calibrate) "
        "(default: the profile's, else every token)",
    )
    if backend:
        p.add_argument(
            "--backend",
            default="inductor",
            choices=("inductor", "eager"),
            help="eager runs uncompiled (default: %(default)s)",
        )
        p.add_argument(
            "--no-progress",
            action="store_true",
            help="do not report graph builds on stderr (default: report them)",
        )
        add_bfloat16_option(p)  # how graphs run, not which are built: capture has no use for it
    add_pass_switch(p)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --profile and --mtp-depth, as generate and serve take them."""
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped model)"
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="take buckets, depths and engine settings from a capture profile (default: none)",
    )
    p.add_argument(
        "--mtp-depth",
        type=depth_arg,
        help="draft tokens per step, or 'auto' to choose each step's depth among 0..3 (or the profile's) "
        "from measured speed and acceptance (default: 3, or the profile's largest depth)",
    )


def _int_list(text: str) -> tuple[int, ...]:
    """A command line's list of integers, e.g. 1,4."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _add_cache_option(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """--cache-dir, defaulting to the per-user cache; `optional`: also --no-cache."""
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=_graph_cache(),
        help="capture cache directory (default: %(default)s)",
    )
    if optional:
        p.add_argument(
            "--no-cache",
            action="store_true",
            help="build every graph in this process, store none (default: use the cache)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The `compiled-mtp` argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(
        prog="compiled-mtp", description="MTP speculative decoding on captured torch.compile graphs"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _generate_parser,
        _random_checkpoint_parser,
        _demo_parser,
        _calibrate_parser,
        _capture_parser,
        _serve_parser,
        _inspect_parser,
        _export_gguf_parser,
        _bench_parser,
    ):
        add(sub)
    return parser


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from a prompt, or from each line of a file")
    p.add_argument(
        "prompt",
        nargs="?",
        help="text (when the model has a tokenizer) or token ids, e.g. '1 2 3' with --ids",
    )
    p.add_argument(
        "--prompts-file",
        type=Path,
        metavar="FILE",
        help="one prompt per line, all queued at once (default: none)",
    )
    p.add_argument(
        "--ids",
        action="store_true",
        help="prompts are token ids (default: text, when the model has a tokenizer)",
    )
    _add_model_options(p)
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the k most likely tokens; 0 = all (default: %(default)s)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sample within this probability mass (default: %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, help="seed of the sampled tokens, in [0, 2**63 - 1] (default: the runtime's)"
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the output before this text (repeatable; matched on the decoded text) (default: none)",
    )
    p.add_argument(
        "--stream", action="store_true", help="write tokens as they are committed (default: when done)"
    )
    _add_engine_options(p)
    _add_cache_option(p, optional=True)
    p.set_defaults(func=cmd_generate)


def _random_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "random-checkpoint",
        help="write a random checkpoint of a preset's shape (DeepSeek-V3, GLM-4 MoE or DeepSeek-V4)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="model family and size: glm-* are GLM-4 MoE, the others DeepSeek-V3 (default: %(default)s)",
    )
    p.add_argument("--out", required=True, type=Path, help="directory to write")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, in [0, 2**63 - 1] (default: %(default)s)"
    )
    p.set_defaults(func=cmd_random_checkpoint)


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with and without MTP on the shipped model")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens per timed run (default: %(default)s)"
    )
    _add_engine_options(p)
    _add_cache_option(p, optional=True)
    p.set_defaults(func=cmd_demo)


def _calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="rank the model's tokens by frequency in text, for --draft-vocab")
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped model)"
    )
    p.add_argument(
        "--text", type=Path, nargs="+", required=True, help="UTF-8 text files like those the model will serve"
    )
    p.set_defaults(func=cmd_calibrate)


def _capture_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="pre-build every graph of a capture profile into a cache")
    p.add_argument("--profile", required=True, type=Path, help="e.g. profiles/default-cpu.toml")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the profile's model)")
    p.add_argument(
        "--processes",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="build in up to N processes at once, each a graph at a time (default: %(default)s, one per core)",
    )
    _add_engine_options(p, backend=False)
    _add_cache_option(p)
    p.set_defaults(func=cmd_capture)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    _add_model_options(p)
    p.add_argument(
        "--batch-sizes",
        type=_int_list,
        metavar="B,B",
        help="batch buckets to capture; the largest is the number of slots (default: the profile's, else 1)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on every path but /health (default: none)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests that may wait for a slot; more are answered 429 (default: %(default)s)",
    )
    _add_engine_options(p)
    _add_cache_option(p, optional=True)
    p.set_defaults(func=cmd_serve)


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="list the graphs a capture cache holds")
    _add_cache_option(p)
    p.set_defaults(func=cmd_inspect)


def _export_gguf_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-gguf",
        help="write the model for llama.cpp (GGUF: deepseek2 for DeepSeek-V3, glm4moe for GLM-4 MoE)",
    )
    p.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped model)"
    )
    p.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    p.add_argument(
        "--dtype",
        choices=sorted(GGUF_DTYPES),
        default="f32",
        help="storage type of the weight matrices (default: f32)",
    )
    p.add_argument(
        "--with-mtp",
        action="store_true",
        help="also write the MTP layers as llama.cpp's NextN blocks, for its MTP drafting "
        "(default: the target model only)",
    )
    p.set_defaults(func=cmd_export_gguf)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="acceptance and tokens/s against HF transformers and the bandwidth bound"
    )
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # capture draws its own progress bar
    progress.disabled = getattr(args, "no_progress", False) or args.command == "capture"
    try:
        apply_bfloat16_option(args)
        args.func(args)
    except (ArtifactError, CheckpointError, ProfileError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # a file the command could not check for before its work: disk full, say
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
