"""The printed report and the plot."""

from __future__ import annotations

from pathlib import Path

from .bound import first_depth_bytes
from .results import Acceptance, BenchResult, Bound, Goal, Meta, engine_row


def precision(m: Meta) -> str:
    """The run's dtype, and the dense MLPs' products where they were bfloat16, for people."""
    return f"{m.dtype} (dense MLPs multiply in bfloat16)" if m.bfloat16_mlps else m.dtype


def print_report(r: BenchResult) -> None:
    """The tables and the goals, for people."""
    _print_header(r.meta)
    _print_acceptance(r.meta, r.acceptance)
    _print_systems(r)
    _print_bound(r.meta, r.bound)
    print(f"compiles {r.meta.compiles}, recompiles {r.meta.recompiles}")
    _print_goals(r.goals)


def _print_header(m: Meta) -> None:
    print(f"\ncompiled_mtp bench: {m.model}")
    drafts = f"; drafts among the {m.draft_vocab} most frequent tokens" if m.draft_vocab else ""
    print(
        f"device: {m.device} ({m.device_name}); {precision(m)}; backend {m.backend}"
        f"; {m.new_tokens} new tokens, greedy; best of {m.runs}{drafts}"
    )
    print(f"prompts: {m.prompts}")


def _print_acceptance(m: Meta, acceptance: list[Acceptance]) -> None:
    print(f"\nacceptance on {m.accept_prompts} prompts")
    print(f"{'K':>3}{'acc len':>9}{'rate':>7}  per position")
    for a in acceptance:
        print(
            f"{a.k:>3}{a.acceptance_length:>9.2f}{a.acceptance_rate:>7.2f}  "
            + " ".join(f"{p:.2f}" for p in a.per_position)
        )


def _print_systems(r: BenchResult) -> None:
    """The engine's rows, then HF's and the peers'."""
    print(
        f"\n{'system':<30}{'B':>3}{'tok/s':>10}{'decode':>9}{'bound':>8}{'ms/iter':>9}{'host ms':>9}{'host %':>8}"
        f"{'acc len':>9}"
        f"{'vs K=0':>8}{'bound':>7}{'of it':>7}{'roof':>7}"
    )
    for e in r.engine:
        print(
            f"{'compiled_mtp K=' + str(e.k):<30}{e.batch:>3}{e.tokens_per_s:>10.1f}{e.decode_tokens_per_s:>9.1f}"
            f"{e.bound_tokens_per_s:>8.0f}{e.iteration_ms:>9.2f}"
            f"{e.host_ms:>9.3f}{100 * e.host_share:>8.1f}{e.acceptance_length:>9.2f}"
            f"{e.speedup:>7.2f}x{e.bound_speedup:>6.2f}x{100 * e.bound_fraction:>6.0f}%{e.roofline_speedup:>6.2f}x"
        )
    for h in r.hf:
        acc = f"{'':>36}{h.acceptance_length:>9.2f}" if h.acceptance_length is not None else ""
        print(f"{'HF ' + h.system:<30}{h.batch:>3}{h.tokens_per_s:>10.1f}{acc}")
    for p in r.peers:
        same = (
            "greedy tokens equal the engine's"
            if p.same_tokens
            else f"greedy tokens DIFFER from the engine's at token {p.first_difference}"
        )
        drafts = f"; accepted {p.accepted} of {p.drafted} drafts" if p.drafted is not None else ""
        print(f"{p.system:<30}{p.batch:>3}{p.tokens_per_s:>10.1f}  {same}{drafts}")


def _print_bound(m: Meta, bound: Bound) -> None:
    """The bandwidth bound's inputs, the experts a verify reads, and the roofline's."""
    per_draft_step = ", ".join(f"{x / 1e6:.2f}" for x in bound.mtp_step_bytes) or "-"
    read = first_depth_bytes(bound.target_bytes, bound.mtp_step_bytes)
    used = (
        "the read's: a step's weights stay in the cache"
        if bound.resident_bytes_per_s > bound.bandwidth_bytes_per_s
        else "the copy's"
    )
    print(
        f"\nbound: copy bandwidth {bound.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({bound.copy_bytes >> 20} MB), "
        f"a step's {read / 1e6:.2f} MB read warm {bound.resident_bytes_per_s / 1e9:.1f} GB/s; the bound takes "
        f"{used}; weights read per target forward "
        f"{bound.target_bytes / 1e6:.2f} MB, per draft step {per_draft_step} MB (a row's); "
        + ", ".join(f"K/B={kb}: {s:.0f} steps/s" for kb, s in bound.steps_per_s.items())
    )
    if bound.verify_experts:
        print(
            f"routed experts a verify reads per MoE layer, of {bound.expert_count} (measured on the prompts), "
            "and the MB of routed experts a step reads beyond one row's: "
            + ", ".join(
                f"K/B={kb}: {n:.2f}, {bound.routed_bytes[kb] / 1e6:.2f} MB"
                for kb, n in bound.verify_experts.items()
            )
        )
    if bound.flops_per_s:
        per_draft_row = ", ".join(f"{x / 1e6:.2f}" for x in bound.mtp_step_flops) or "-"
        unit = "the bfloat16 dot products, every product counted" if m.bfloat16_mlps else "AMX's tiles"
        tiles = (
            f" (products of {bound.tile_rows}+ rows on {unit}: {bound.tile_flops_per_s / 1e9:.0f} GFLOP/s)"
            if bound.tile_rows
            else ""
        )
        print(
            f"roofline: torch.mm {bound.flops_per_s / 1e9:.0f} GFLOP/s{tiles}; weights' multiply-adds per row "
            f"{bound.target_flops / 1e6:.2f} MFLOP per target forward, {per_draft_row} per draft step "
            f"({bound.extend_row_flops / 1e6:.2f} of them on every row of a draft extend); "
            + ", ".join(f"K/B={kb}: {s:.0f} steps/s" for kb, s in bound.roofline_steps_per_s.items())
        )


def _print_goals(goals: list[Goal]) -> None:
    print("\ngoals:")
    for g in goals:
        percent = g.id == "k1_acceptance" or g.id.startswith("bound_fraction")
        value = "n/a" if g.value is None else f"{100 * g.value:.0f}%" if percent else f"{g.value:.2f}x"
        target = (
            "" if g.goal is None else f"goal >= {100 * g.goal:.0f}%" if percent else f"goal >= {g.goal:g}x"
        )
        verdict = "" if g.met is None else "met" if g.met else "NOT met"
        print(f"  {g.name:<48}{value:>8}  {target:<15}{verdict:<8}{g.detail}")


def plot(r: BenchResult, path: Path) -> None:
    """tokens/s against K, one colour per batch size: the engine (solid), its bandwidth bound (dotted),
    its roofline where lower (dotted, crosses), HF generate (dashed, flat in K) and HF
    generate(use_mtp=True) (a star at its draft count)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, b in enumerate(r.meta.batch_sizes):
        rows = [e for e in r.engine if e.batch == b and e.k != "auto"]
        ks = [e.k for e in rows]
        color = f"C{i}"
        ax.plot(ks, [e.tokens_per_s for e in rows], "o-", color=color, label=f"compiled_mtp B={b}")
        ax.plot(ks, [e.bound_tokens_per_s for e in rows], ":", color=color, label=f"bandwidth bound B={b}")
        if any(e.roofline_tokens_per_s < e.bound_tokens_per_s for e in rows):  # else the same line
            ax.plot(ks, [e.roofline_tokens_per_s for e in rows], "x:", color=color, label=f"roofline B={b}")
        auto = engine_row(r.engine, "auto", b)
        if auto is not None:
            ax.axhline(auto.tokens_per_s, ls="-.", color=color, label=f"compiled_mtp auto B={b}")
        for h in r.hf:
            if h.batch == b and h.k == 0:
                ax.axhline(h.tokens_per_s, ls="--", color=color, label=f"HF generate B={b}")
            elif h.batch == b:
                ax.plot(
                    [h.k],
                    [h.tokens_per_s],
                    "*",
                    color=color,
                    markersize=12,
                    label=f"HF generate(use_mtp=True) B={b}",
                )
    ax.set_yscale("log")
    ax.set_xticks(r.meta.depths)
    ax.set_xlabel("MTP depth K (draft tokens per step)")
    ax.set_ylabel("tokens/s (greedy)")
    ax.set_title(
        f"{Path(r.meta.model).name}: {r.meta.device_name}, {precision(r.meta)}, {r.meta.new_tokens} new tokens",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
