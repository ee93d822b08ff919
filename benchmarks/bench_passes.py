"""The custom FX passes, on against off, in one run.

    python benchmarks/bench_passes.py                          # both parts, the issue's matrix
    python benchmarks/bench_passes.py --part sampling --batch-sizes 1 8 --depths 1 3
    python benchmarks/bench_passes.py --part e2e --depths 0 1 2 3
    python benchmarks/bench_passes.py --part e2e --preset dsv3-proportions --pass-sets on --depths 0 3 \
        --steps-only --cache-dir /tmp/dsv3-cache      # run twice: the first builds, the second times
    python benchmarks/bench_passes.py --device cuda --dtype bfloat16   # on a GPU (CUDA graphs, Triton)

1. sampling: the sampling half of target_verify alone (`graphs.sampling.verify_sample`, compiled by
   Inductor) at DeepSeek-V3's vocabulary of 129280, for B x K, with every request greedy, at
   temperature 1.0, or at temperature 1.0 with top-p 0.9. Off: the traced subgraph. On: the
   fuse_verify_sampling pass (one `compiled_mtp::verify_sample` op).
2. e2e: a random DeepSeek-V3-shaped checkpoint (`--preset`: "250m", ~250M parameters, vocab 129280, 8
   layers, 16 experts, whose LM head is as large as the rest of a step; or "dsv3-proportions", whose
   draft step reads 0.057 of a target forward, as DeepSeek-V3's reads about 0.04), the real decode
   loop at B=1 for each K, every graph compiled by Inductor, all passes against none (`--pass-sets`).
   A random model's drafts are never accepted, so tokens/s are SIMULATED: each step's time is
   measured (graphs have static shapes, so it does not depend on acceptance) and multiplied by the
   tokens per step the shipped model commits at that K on held-out text (1 + its accepted drafts per
   step, from its train_log.json), as SGLang's SIMULATE_ACC_LEN does with a typed-in figure. Beside
   each depth's speedup over K=0, its bandwidth bound's: the same tokens a step, were each step as
   fast as its weight bytes allow (a K-step's verify reads each layer's routed experts once over its
   K + 1 rows, which route to more experts than one row, plus K draft steps). Also,
   timed in turns: one draft step (draft_decode at K=3, per step) drafting from the whole vocabulary
   against drafting from its most frequent quarter (draft_vocab), and
   turns: one target_verify at K=3 (4 rows) against one at K=0 (a plain decode step), as routed
   and with every token routed to the same experts (which separates the extra expert weights 4
   rows read), the weight bytes each of the two reads, as routed (each layer's chosen experts once:
   the floor of their ratio, and what the group_experts pass reads) and as gathered (each row's
   experts once per row: the model's own products, without that pass), and
   the LM head alone at 4 rows against 1 (compiled by Inductor without and with the passes), and
   target_verify at K=3, B = 1 and 8, in a cache of 2048 positions (the Runtime's default
   max_seq_len) with all passes against all but live_attention, and in one as long as the rows need.
Results are printed and written to benchmarks/passes-<device>.json, with the commit each part
measured; a run of one part keeps the file's other part.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compiled_mtp import Runtime  # noqa: E402
from compiled_mtp.bench import step_sizes, timed_generate  # noqa: E402
from compiled_mtp.capture.compiler import own_code  # noqa: E402
from compiled_mtp.graphs import steps  # noqa: E402
from compiled_mtp.graphs.plan import GraphKey, GraphKind, step_plan  # noqa: E402
from compiled_mtp.graphs.sampling import verify_sample  # noqa: E402
from compiled_mtp.models.checkpoint import load_model  # noqa: E402
from compiled_mtp.models.deepseek_v3 import Experts, Router  # noqa: E402
from compiled_mtp.models.family import CausalLM  # noqa: E402
from compiled_mtp.models.synthetic import preset_config, write_random_checkpoint  # noqa: E402
from compiled_mtp.passes.manager import available, inductor_options, without  # noqa: E402
from compiled_mtp.runtime import DTYPES, SamplingParams  # noqa: E402

VOCAB = 129280
SETTINGS = {"greedy": (0.0, 1.0), "T=1": (1.0, 1.0), "T=1 top-p 0.9": (1.0, 0.9)}
SHIPPED_LOG = ROOT / "compiled_mtp" / "default_model" / "train_log.json"
CAPACITY = 2048  # Runtime's default max_seq_len


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call, GPU work included."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def best_ms(fn, runs: int) -> float:
    fn()
    return 1e3 * min(seconds(fn) for _ in range(runs))


def sampling_inputs(
    b: int, k: int, temperature: float, top_p: float, device: str
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(b * 10 + k)
    logits = 3 * torch.randn(b, k + 1, VOCAB, generator=gen)
    q = torch.softmax(3 * torch.randn(b, k, VOCAB, generator=gen), dim=-1)
    drafts = torch.where(
        torch.rand(b, k, generator=gen) < 0.7,
        logits[:, :k].argmax(-1),
        torch.randint(0, VOCAB, (b, k), generator=gen),
    )
    inputs = (
        logits,
        torch.full((b,), temperature),
        torch.zeros(b, dtype=torch.long),
        torch.full((b,), top_p),
        drafts,
        q,
        torch.rand(b, k + 1, generator=gen),
    )
    return tuple(t.to(device) for t in inputs)


def _sample(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each compiled graph runs; a copy of this code per (B, K, passes) keeps their Dynamo caches
    apart, while verify_sample keeps its own name (the fusion pass looks for its frame)."""
    return verify_sample(*inputs)


def bench_sampling(args: argparse.Namespace) -> list[dict]:
    rows = []
    for b in args.batch_sizes:
        for k in [k for k in args.depths if k > 0]:
            graphs = {
                name: torch.compile(
                    own_code(_sample, f"sample_{name}_{b}_{k}"),
                    fullgraph=True,
                    dynamic=False,
                    options=inductor_options(passes),
                )
                for name, passes in (("off", ()), ("on", ("fuse_verify_sampling",)))
            }
            for setting, (temperature, top_p) in SETTINGS.items():
                inputs = sampling_inputs(b, k, temperature, top_p, args.device)
                (acc_off, tok_off), (acc_on, tok_on) = (graphs[name](*inputs) for name in ("off", "on"))
                differ = int(((acc_off != acc_on) | (tok_off != tok_on).any(-1)).sum())
                ms = {
                    name: best_ms(lambda g=graph, x=inputs: g(*x), args.runs)
                    for name, graph in graphs.items()
                }
                rows.append(
                    {
                        "B": b,
                        "K": k,
                        "setting": setting,
                        "off_ms": ms["off"],
                        "on_ms": ms["on"],
                        "speedup": ms["off"] / ms["on"],
                        "requests_differing": differ,
                    }
                )
                print(
                    f"  B={b:2d} K={k} {setting:14s} off {ms['off']:8.2f} ms  on {ms['on']:7.2f} ms  "
                    f"{ms['off'] / ms['on']:6.1f}x  requests with other tokens: {differ}/{b}",
                    flush=True,
                )
    return rows


def simulated_tokens_per_step() -> dict[int, float]:
    """Tokens per decode step of the shipped model at each K it was measured at (greedy, held-out)."""
    acceptance = json.loads(SHIPPED_LOG.read_text())["acceptance"]
    return {
        0: 1.0,
        **{
            int(key[1:]): 1 + value["accepted_per_step"]
            for key, value in acceptance.items()
            if key.startswith("K")
        },
    }


def bench_e2e(args: argparse.Namespace) -> dict:
    config = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing the random {args.preset} checkpoint ...", flush=True)
        model = load_model(
            write_random_checkpoint(Path(tmp) / args.preset, config),
            dtype=DTYPES[args.dtype],
            device=args.device,
        )
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    prompt = torch.randint(
        0, config["vocab_size"], (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    per_step = simulated_tokens_per_step()
    if missing := sorted(set(args.depths) - set(per_step)):
        raise SystemExit(
            f"error: depths: the shipped model's acceptance was measured at K = {sorted(per_step)}, not at {missing}"
        )
    result = {
        "preset": args.preset,
        "parameters_m": params_m,
        "simulated_tokens_per_step": per_step,
        "rows": [],
        "verify_ms": {},
        "verify_weight_mb": {},
        "lm_head_ms": {},
    }
    for name, passes in (("off", ()), ("on", available())):
        if name not in args.pass_sets:
            continue
        runtimes, compile_s = {}, {}
        for k in args.depths:
            start = time.perf_counter()
            runtimes[k] = Runtime(
                model,
                mtp_depth=k,
                batch_sizes=(1,),
                max_seq_len=short_capacity(args),
                prefill_chunk=args.prompt_len,
                passes=passes,
                cache_dir=args.cache_dir,
            )
            timed_generate(runtimes[k], [prompt], sampling)  # compiles or loads
            compile_s[k] = time.perf_counter() - start
        # The depths take turns, so that all of them see the same state of a shared machine.
        step_ms = {k: float("inf") for k in args.depths}
        for _ in range(args.runs):
            for k, rt in runtimes.items():
                t = timed_generate(rt, [prompt], sampling)
                step_ms[k] = min(step_ms[k], 1e3 * t.decode_seconds / t.decode_steps)
        for k in runtimes.keys() - result["verify_weight_mb"].keys():  # same routing with or without passes
            result["verify_weight_mb"][k] = {
                how: n / 1e6 for how, n in verify_weight_bytes(runtimes[k], k, args).items()
            }
        bound = bandwidth_speedups(result["verify_weight_mb"], draft_step_mb(model), per_step)
        for k, ms in step_ms.items():
            tokens = per_step[k]
            speedup = tokens / ms * step_ms[0] if 0 in step_ms else None
            result["rows"].append(
                {
                    "passes": name,
                    "K": k,
                    "step_ms": ms,
                    "simulated_tokens_per_step": tokens,
                    "simulated_tok_s": 1e3 * tokens / ms,
                    "bound_speedup": bound.get(k),
                    "compile_s": compile_s[k],
                }
            )
            versus = (
                f", {speedup:.2f}x K=0 of a bound of {bound[k]:.2f}x ({speedup / bound[k]:.0%})"
                if speedup is not None and k in bound
                else ""
            )
            print(
                f"  passes {name:3s} K={k}: {ms:7.1f} ms/step, simulated {1e3 * tokens / ms:6.1f} "
                f"tok/s{versus} (compile {compile_s[k]:.0f} s)",
                flush=True,
            )
        if args.steps_only:
            continue
        if name == "on" and 3 in runtimes:
            d = result["draft_step_ms"] = draft_step_ms(model, runtimes[3], args)
            print(
                f"  draft step, vocabulary {d['full_vocab']} / its top {d['draft_vocab']}: {d['full']:.2f}"
                f" / {d['restricted']:.2f} ms: {d['restricted'] / d['full']:.2f}x",
                flush=True,
            )
        verify = {k: verify_call(runtimes[k], k, args) for k in (0, 3) if k in runtimes}
        if set(verify) == {0, 3}:
            result["verify_ms"][name] = paired_best_ms(verify, args.runs * 3)
            with same_experts(model):
                result["verify_ms"][f"{name}, same experts"] = paired_best_ms(verify, args.runs * 3)
            for label in (name, f"{name}, same experts"):
                v = result["verify_ms"][label]
                print(
                    f"  passes {label}: target_verify 4 rows {v[3]:.1f} ms vs 1 row {v[0]:.1f} ms: {v[3] / v[0]:.2f}x",
                    flush=True,
                )
        h = result["lm_head_ms"][name] = lm_head_ms(model, passes, args.runs * 3)
        print(
            f"  passes {name}: the LM head alone, 4 rows {h[4]:.1f} ms vs 1 row {h[1]:.1f} ms: {h[4] / h[1]:.2f}x",
            flush=True,
        )
    cap = {} if args.steps_only else capacity_ms(model, args)
    if cap:
        result["capacity_verify_ms"] = cap
    for batch, ms in cap.items():
        print(
            f"  target_verify K=3 B={batch}, max_seq_len {CAPACITY}: "
            f"attention traced {ms['traced']:.1f} ms, live_attention {ms['live']:.1f} ms:"
            f" {ms['traced'] / ms['live']:.2f}x (max_seq_len {short_capacity(args)}: {ms['short']:.1f} ms)",
            flush=True,
        )
    mb, ms = result["verify_weight_mb"], result["verify_ms"].get("on", {})
    for how in ("routed", "gathered") if set(mb) >= {0, 3} else ():
        speed = (
            f" (with passes: {mb[3][how] / ms[3]:.0f} / {mb[0][how] / ms[0]:.0f} GB/s)"
            if set(ms) >= {0, 3}
            else ""
        )
        print(
            f"  weights read {how}: target_verify 4 rows {mb[3][how]:.0f} MB "
            f"vs 1 row {mb[0][how]:.0f} MB: {mb[3][how] / mb[0][how]:.2f}x{speed}",
            flush=True,
        )
    return result


def draft_step_ms(model: torch.nn.Module, full: Runtime, args: argparse.Namespace) -> dict:
    """One draft step (draft_decode at K=3 runs two) drafting from the whole vocabulary, against one
    drafting from a quarter of it, timed in turns. A random model has no token frequencies: the first
    quarter of the ids stands for the most frequent, which costs the same. The model's drafts stay
    restricted afterwards (`full`'s graphs were traced before, and the later parts time no draft)."""
    vocab = model.cfg.vocab_size
    model.restrict_drafts(torch.arange(vocab // 4))
    restricted = Runtime(
        model, mtp_depth=3, batch_sizes=(1,), max_seq_len=short_capacity(args), prefill_chunk=args.prompt_len
    )
    drafted = torch.zeros(1, dtype=torch.long, device=args.device)  # every row drafts
    inputs = verify_inputs(3, args)[:2] + (drafted, step_noise(3, 1, args.device)[0])
    ms = paired_best_ms(
        {
            name: (lambda rt=rt: rt.graphs(GraphKey(GraphKind.draft_decode, 1, 3), *inputs))
            for name, rt in (("full", full), ("restricted", restricted))
        },
        args.runs * 3,
    )
    return {
        "full_vocab": vocab,
        "draft_vocab": vocab // 4,
        "full": ms["full"] / 2,
        "restricted": ms["restricted"] / 2,
    }


def step_noise(k: int, batch: int, device: str) -> tuple[torch.Tensor, ...]:
    """A depth-k step's uniforms for draft_decode, target_verify and draft_extend, split as
    Runtime._decode splits them (the graphs guard their strides)."""
    plan = step_plan(batch, k, (k,))
    noise = torch.zeros(batch, plan.uniforms, device=device)
    return tuple(noise[:, columns] for columns in plan.columns)


def verify_inputs(k: int, args: argparse.Namespace, batch: int = 1) -> tuple[torch.Tensor, ...]:
    """target_verify's step tensors at depth k for requests in slots 0..batch-1, each prompt_len long."""
    return (
        torch.arange(batch, device=args.device),
        torch.full((batch,), args.prompt_len, device=args.device),
        step_noise(k, batch, args.device)[1],
    )


def verify_call(rt: Runtime, k: int, args: argparse.Namespace, batch: int = 1) -> Callable[[], object]:
    """One target_verify call at depth k."""
    inputs = verify_inputs(k, args, batch)
    return lambda: rt.graphs(GraphKey(GraphKind.target_verify, batch, k), *inputs)


def paired_best_ms(calls: dict[object, Callable[[], object]], runs: int) -> dict[object, float]:
    """Best time of each call, taking turns, so that both see the same state of a shared machine."""
    for call in calls.values():
        call()
    times: dict[object, list[float]] = {key: [] for key in calls}
    for _ in range(runs):
        for key, call in calls.items():
            times[key].append(seconds(call))
    return {key: 1e3 * min(t) for key, t in times.items()}


def short_capacity(args: argparse.Namespace) -> int:
    """The e2e runs' max_seq_len: what their rows need."""
    return args.prompt_len + args.new_tokens + 8


def capacity_ms(model: torch.nn.Module, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """target_verify at K=3, B = 1 and 8, timed in turns: in a cache of the Runtime's default
    max_seq_len with all passes ("live") and with all but live_attention ("traced"), and in one of the
    e2e runs' length ("short", all passes)."""
    calls = {}
    for batch in (1, 8):
        for name, capacity, passes in (
            ("short", short_capacity(args), available()),
            ("traced", CAPACITY, without(["live_attention"])),
            ("live", CAPACITY, available()),
        ):
            rt = Runtime(
                model,
                mtp_depth=3,
                batch_sizes=(batch,),
                max_seq_len=capacity,
                prefill_chunk=args.prompt_len,
                passes=passes,
            )
            calls[batch, name] = verify_call(rt, 3, args, batch)
    ms = paired_best_ms(calls, args.runs * 3)
    return {batch: {name: ms[batch, name] for name in ("short", "traced", "live")} for batch in (1, 8)}


def verify_weight_bytes(rt: Runtime, k: int, args: argparse.Namespace) -> dict[str, int]:
    """Weight bytes the target_verify of `verify_call` reads: every target weight once, except that
    of each layer's routed experts only those its rows are routed to ("routed", as group_experts runs
    them), or those of each row's experts once per row when rows gather their experts ("gathered",
    the model's own products; a repeated read may come from the CPU's cache), and of the embedding
    only the rows' own. The routing is the eager step's on a copy of the state, recorded at each
    router."""
    model, routed = rt.model, []
    hooks = [
        m.register_forward_hook(lambda _m, _x, out: routed.append(out[0]))
        for m in model.modules()
        if isinstance(m, Router)
    ]
    try:
        steps.target_verify(model, copy.deepcopy(rt.state), *verify_inputs(k, args))
    finally:
        for hook in hooks:
            hook.remove()
    experts = [m for m in model.modules() if isinstance(m, Experts)][
        : len(routed)
    ]  # the target's, in layer order
    mtp = {id(p) for layer in model.model.layers[model.cfg.num_hidden_layers :] for p in layer.parameters()}
    embed = model.model.embed_tokens.weight
    dense = (
        sum(p.nbytes for p in model.parameters() if id(p) not in mtp)
        - embed.nbytes
        + (k + 1) * embed[0].nbytes
    )
    dense -= sum(p.nbytes for layer_experts in experts for p in layer_experts.parameters())
    read = {"routed": dense, "gathered": dense}
    for layer_experts, idx in zip(experts, routed):
        n_experts = layer_experts.gate_proj.shape[0]
        each = sum(p.nbytes for p in layer_experts.parameters()) // n_experts
        read["routed"] += each * idx.unique().numel()
        read["gathered"] += each * (
            idx.numel() if layer_experts.gathers(*idx.shape, idx.device) else n_experts
        )
    return read


def draft_step_mb(model: CausalLM) -> list[float]:
    """MB one draft step reads per MTP layer (its layer with a row's routed experts, and the head),
    each weight counted by its own bytes, as verify_weight_bytes counts the target's."""
    _, drafts = step_sizes(model, lambda w: w.nbytes, model.model.embed_tokens.weight[0].nbytes)
    return [n / 1e6 for n in drafts]


def bandwidth_speedups(
    verify_mb: dict[int, dict[str, float]], draft_mb: list[float], tokens: dict[int, float]
) -> dict[int, float]:
    """Each depth's speedup over K=0 were every step bound by its weight bytes: a K=0 step reads its
    verify's, a K-step its verify's over K + 1 rows (each layer's routed experts once) and K draft
    steps' (depth j drafting with MTP layer j % layers), and commits `tokens[K]`."""
    if 0 not in verify_mb:
        return {}
    base = verify_mb[0]["routed"]
    return {
        k: tokens[k] * base / (mb["routed"] + sum(draft_mb[j % len(draft_mb)] for j in range(k)))
        for k, mb in verify_mb.items()
    }


def lm_head_ms(model: torch.nn.Module, passes: tuple[str, ...], runs: int) -> dict[int, float]:
    """The LM head alone on 1 and 4 rows, compiled by Inductor with `passes`."""
    weight = model.lm_head.weight

    def head(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    calls = {}
    for rows in (1, 4):
        compiled = torch.compile(
            own_code(head, f"lm_head_{rows}_{len(passes)}"),
            fullgraph=True,
            dynamic=False,
            options=inductor_options(passes),
        )
        calls[rows] = partial(
            compiled, torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        )
    return paired_best_ms(calls, runs)


@contextmanager
def same_experts(model: torch.nn.Module):
    """Every token routed to the same experts (router weights zero, a fixed bias order), so 4 verify rows
    need no more distinct expert weights than 1: what the ratio is without MoE's extra reads. Graphs read the
    router's parameters at each call, so compiled graphs follow without a rebuild."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    saved = [(r.weight.clone(), r.e_score_correction_bias.clone()) for r in routers]
    with torch.no_grad():
        for r in routers:
            r.weight.zero_()
            r.e_score_correction_bias.copy_(torch.linspace(1, 0, r.e_score_correction_bias.numel()))
    try:
        yield
    finally:
        with torch.no_grad():
            for r, (weight, bias) in zip(routers, saved):
                r.weight.copy_(weight)
                r.e_score_correction_bias.copy_(bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sampling", "e2e", "both"), default="both")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument(
        "--depths", type=int, nargs="+", default=None, help="default: 1 2 3 (sampling), 0 1 2 3 (e2e)"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the e2e model's")
    parser.add_argument(
        "--preset", choices=("250m", "dsv3-proportions"), default="250m", help="the e2e model"
    )
    parser.add_argument(
        "--pass-sets",
        nargs="+",
        choices=("off", "on"),
        default=["off", "on"],
        help="e2e: which pass sets to time",
    )
    parser.add_argument(
        "--steps-only",
        action="store_true",
        help="e2e: time the decode steps per depth and count the weight bytes a verify reads, but not the "
        "draft-step, verify, LM-head and capacity timings (whose many graphs take long to compile for the "
        "dsv3-proportions preset)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="e2e: a capture cache the step graphs load from and are built into, so that one run can build "
        "them and a later one, on a quiet machine, time them (weight values are not part of a graph's key)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/passes-<device>.json")
    args = parser.parse_args()
    args.out = args.out or ROOT / "benchmarks" / f"passes-{args.device}.json"
    torch.manual_seed(0)
    device = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    )
    result = {
        **_other_parts(args.out, args.part),
        "torch": torch.__version__,
        "device": device,
        "dtype": args.dtype,
    }
    if args.part in ("sampling", "both"):
        print(f"verify sampling at vocab {VOCAB} (best of {args.runs}):", flush=True)
        result["sampling"] = bench_sampling(
            argparse.Namespace(**{**vars(args), "depths": args.depths or [1, 2, 3]})
        )
    if args.part in ("e2e", "both"):
        print(
            f"end to end, random {args.preset} checkpoint, B=1 "
            "(tokens/s SIMULATED with the shipped model's acceptance):",
            flush=True,
        )
        result["e2e"] = bench_e2e(argparse.Namespace(**{**vars(args), "depths": args.depths or [0, 1, 2, 3]}))
    result["runs"] = {
        **result.get("runs", {}),
        **{part: _commit() for part in ("sampling", "e2e") if args.part in (part, "both")},
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def _other_parts(path: Path, part: str) -> dict:
    """What an earlier result file holds of the part this run leaves out, so that a one-part run
    updates its own part only."""
    if part == "both" or not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    other = "e2e" if part == "sampling" else "sampling"
    return {key: earlier[key] for key in (other, "runs") if key in earlier}


def _commit() -> str:
    """The commit measured (with `+` when the engine's code or this script has changes), or `unknown`
    outside a checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "compiled_mtp", __file__],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty.strip() else "")


if __name__ == "__main__":
    main()
