"""The goals the bench judges: ratios of two systems' speeds, and rates, each with its per-round spread."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .results import BenchResult, EngineRun, Goal, engine_row


def paired_ratio(a: EngineRun, b: EngineRun) -> str:
    """a's decode tok/s over b's round by round: the two ran one after the other in each round, so a
    change in memory speed between rounds, which moves the best runs of each apart, cancels."""
    return round_ratios(a.decode_runs, b.decode_runs)  # --runs >= 1


def round_ratios(a: Sequence[float], b: Sequence[float], digits: int = 2) -> str:
    """Rates a over rates b taken in the same rounds, each round's ratio on its own: median and range."""
    ratios = sorted(x / y for x, y in zip(a, b))
    median, low, high = statistics.median(ratios), ratios[0], ratios[-1]
    return f"per round {median:.{digits}f}x, {low:.{digits}f}-{high:.{digits}f}x over {len(ratios)}"


def _speedup_goal(runs: list[EngineRun], b: int, goal: float) -> list[Goal]:
    """Best configuration (auto included) over K=0 at B, and the fraction of its bound's speedup that
    the fastest configuration that speculates reaches (where K=0 is the fastest, its own 100% would
    say nothing of speculation)."""
    name = f"best K vs K=0 at B={b}"
    base = engine_row(runs, 0, b)
    rows = [r for r in runs if r.batch == b]
    drafting = [r for r in rows if r.k != 0]
    if base is None or not drafting:
        return [Goal(f"speedup_b{b}", name, None, goal, None, f"not measured (needs K=0, K > 0 and B={b})")]
    best = max(rows, key=lambda r: r.decode_tokens_per_s)
    spec = max(drafting, key=lambda r: r.decode_tokens_per_s)
    # What the machine allows at all: a goal above every depth's roofline is met, if at all, through
    # the K=0 step's fixed costs, which a deeper step spreads over more tokens.
    roof = max((r for r in rows if r.k != "auto"), key=lambda r: r.roofline_speedup)
    detail = (
        f"K={best.k}: {best.decode_tokens_per_s:.1f} vs {base.decode_tokens_per_s:.1f} decode tok/s"
        f" ({best.tokens_per_s / base.tokens_per_s:.2f}x with the prefill; {paired_ratio(best, base)});"
        f" the roofline allows at most {roof.roofline_speedup:.2f}x (K={roof.k})"
    )
    fraction = (
        f"K={spec.k}: {spec.speedup:.2f}x of a bound of {spec.bound_speedup:.2f}x"
        f" (the roofline, arithmetic counted too, {spec.roofline_speedup:.2f}x)"
    )
    return [
        Goal(f"speedup_b{b}", name, best.speedup, goal, best.speedup >= goal, detail),
        Goal(
            f"bound_fraction_b{b}",
            f"{name}, share of its bound",
            spec.bound_fraction,
            0.8,
            spec.bound_fraction >= 0.8,
            fraction,
        ),
    ]


def _auto_goals(runs: list[EngineRun]) -> list[Goal]:
    """Auto against the best fixed depth at every B (>= 0.97x), and against K=0 where no K > 0 beats
    it (>= 0.98x)."""
    out = []
    for auto in (r for r in runs if r.k == "auto"):
        fixed = [r for r in runs if r.batch == auto.batch and r.k != "auto"]
        best = max(fixed, key=lambda r: r.decode_tokens_per_s)
        goal = 0.98 if best.k == 0 else 0.97
        value = auto.decode_tokens_per_s / best.decode_tokens_per_s
        detail = (
            f"{auto.decode_tokens_per_s:.1f} vs K={best.k} {best.decode_tokens_per_s:.1f} decode tok/s"
            f" ({paired_ratio(auto, best)}); steps per depth {auto.depth_histogram}"
        )
        out.append(
            Goal(
                f"auto_b{auto.batch}",
                f"auto vs best fixed K at B={auto.batch}",
                value,
                goal,
                value >= goal,
                detail,
            )
        )
    return out


def _peer_goals(result: BenchResult) -> list[Goal]:
    """K=0 (>= 1.0x) and the best configuration (>= 1.5x) against llama.cpp's plain decoding at B = 1,
    then, for context, the best configuration against llama.cpp's fastest where its MTP drafting won."""
    peer = next((p for p in result.peers if p.system == "llama.cpp"), None)
    base = engine_row(result.engine, 0, 1)
    best = max((r for r in result.engine if r.batch == 1), key=lambda r: r.tokens_per_s, default=None)
    out = []
    for gid, name, row, goal in (
        ("vs_llama_cpp_k0", "K=0 vs llama.cpp at B=1", base, 1.0),
        ("vs_llama_cpp_best", "best K vs llama.cpp at B=1", best, 1.5),
    ):
        if peer is None or row is None:
            out.append(
                Goal(gid, name, None, goal, None, "not measured (needs B=1, K=0 and llama-cpp-python)")
            )
            continue
        value = row.tokens_per_s / peer.tokens_per_s
        out.append(
            Goal(
                gid,
                name,
                value,
                goal,
                value >= goal,
                f"K={row.k}: {row.tokens_per_s:.1f} vs {peer.tokens_per_s:.1f} tok/s",
            )
        )
    fastest = max(result.peers, key=lambda p: p.tokens_per_s, default=None)
    if fastest is not None and best is not None and fastest.system != "llama.cpp":
        value = best.tokens_per_s / fastest.tokens_per_s
        detail = f"K={best.k}: {best.tokens_per_s:.1f} vs {fastest.system} {fastest.tokens_per_s:.1f} tok/s"
        out.append(
            Goal("vs_llama_cpp_fastest", "best K vs llama.cpp's fastest at B=1", value, None, None, detail)
        )
    return out


def goals(result: BenchResult) -> list[Goal]:
    """The ratios the issue's goals are about, then best K against HF generate at each B for context."""
    out = (
        _speedup_goal(result.engine, 1, 1.8)
        + _speedup_goal(result.engine, 4, 1.3)
        + _auto_goals(result.engine)
    )
    hf_mtp = next((h for h in result.hf if h.k > 0), None)
    best1 = max((r for r in result.engine if r.batch == 1), key=lambda r: r.tokens_per_s, default=None)
    name = "best K at B=1 vs HF generate(use_mtp=True)"
    if hf_mtp and best1:
        value = best1.tokens_per_s / hf_mtp.tokens_per_s
        out.append(
            Goal(
                "vs_hf_mtp_b1",
                name,
                value,
                5.0,
                value >= 5.0,
                f"K={best1.k}: {best1.tokens_per_s:.1f} vs {hf_mtp.tokens_per_s:.1f} tok/s",
            )
        )
    else:
        out.append(Goal("vs_hf_mtp_b1", name, None, 5.0, None, "not measured (needs B=1 and a depth > 0)"))
    out += _peer_goals(result)
    k1 = next((a for a in result.acceptance if a.k == 1), None)
    if k1:
        out.append(
            Goal(
                "k1_acceptance",
                "K=1 acceptance",
                k1.acceptance_rate,
                0.7,
                k1.acceptance_rate >= 0.7,
                f"{k1.accepted_tokens} of {k1.draft_tokens} drafts",
            )
        )
    else:
        out.append(Goal("k1_acceptance", "K=1 acceptance", None, 0.7, None, "not measured (needs K=1)"))
    for h in result.hf:
        best = max(
            (r for r in result.engine if r.batch == h.batch), key=lambda r: r.tokens_per_s, default=None
        )
        if h.k == 0 and best:
            value = best.tokens_per_s / h.tokens_per_s
            out.append(
                Goal(
                    f"vs_hf_generate_b{h.batch}",
                    f"best K vs HF generate at B={h.batch}",
                    value,
                    None,
                    None,
                    f"K={best.k}: {best.tokens_per_s:.1f} vs {h.tokens_per_s:.1f} tok/s",
                )
            )
    return out
