"""`compiled-mtp bench` end to end on a tiny checkpoint: every section of the JSON, sane values, the plot.

Uncompiled graphs and a few tokens keep it fast; the figures themselves mean nothing here.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compiled_mtp import bench, llama_cpp_peer
from compiled_mtp.bench import engine
from compiled_mtp.bench.goals import _speedup_goal
from compiled_mtp.capture.profile import DEFAULT_MODEL
from compiled_mtp.cli import main
from compiled_mtp.models.gguf_export import LAYOUTS
from compiled_mtp.runtime import Runtime
from tests.checkpoints import write_echo_checkpoint
from tests.precision import bfloat16_mlps, needs_bfloat16_dot

DEPTHS, BATCHES = (0, 1, 2), (1, 2)
NEW_TOKENS = 8
TIMED_PROMPTS = 3


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One bench run on a 2-layer echo checkpoint (no tokenizer: seeded random prompts)."""
    model = write_echo_checkpoint(tmp_path_factory.mktemp("echo"), num_layers=2, mtp_noise=0.3)
    out = tmp_path_factory.mktemp("bench")
    bench.run(_args(
        "--model", str(model), "--backend", "eager", "--new-tokens", str(NEW_TOKENS), "--runs", "1",
        "--prompt-len", "8",
        "--accept-prompts", "3", "--timed-prompts", str(TIMED_PROMPTS), "--copy-mb", "16", "--out", str(out),
        "--depths", *map(str, DEPTHS), "--batch-sizes", *map(str, BATCHES),
    ))  # fmt: skip
    return json.loads((out / "bench-cpu.json").read_text()), out


@given(count=st.integers(1, 64), b=st.integers(1, 32))
def test_a_round_times_the_prompts_asked_for_rounded_up_to_whole_batches(count, b):
    timed = bench.timed_prompts(count, b)
    assert timed % b == 0 and count <= timed < count + b
    prompts = [[i] for i in range(timed)]
    batches = bench.timed_batches(prompts, count, b)
    assert all(len(batch) == b for batch in batches) and [p for batch in batches for p in batch] == prompts


@given(systems=st.integers(1, 6), groups=st.integers(1, 8), rounds=st.integers(1, 4))
def test_systems_take_turns_at_every_group_each_leading_as_often(systems, groups, rounds):
    order = list(bench.turns(list(range(systems)), list(range(groups)), rounds))
    # Every system runs every group once a round, and a group's turns all come before the next one's.
    expected = [(r, g) for r in range(rounds) for g in range(groups) for _ in range(systems)]
    assert [(r, g) for r, g, _ in order] == expected
    turns = [[s for _, _, s in order[i : i + systems]] for i in range(0, len(order), systems)]
    # The order shifts by one a turn, so the system that leads cycles through all of them.
    assert turns == [[(i + j) % systems for j in range(systems)] for i in range(len(turns))]


def test_json_has_every_section(result):
    data, _ = result
    assert set(data) == {"meta", "acceptance", "engine", "hf", "bound", "peers", "goals"}
    meta = data["meta"]
    assert meta["device"] == "cpu" and meta["device_name"].startswith("CPU")
    assert meta["prompt_source"] == "random" and meta["recompiles"] == 0
    assert [a["k"] for a in data["acceptance"]] == [k for k in DEPTHS if k > 0]
    assert {(e["k"], e["batch"]) for e in data["engine"]} == {
        (k, b) for k in (*DEPTHS, "auto") for b in BATCHES
    }
    assert {(h["system"], h["batch"]) for h in data["hf"]} == {("generate", b) for b in BATCHES} | {
        ("generate(use_mtp=True)", 1)
    }
    assert {g["id"] for g in data["goals"]} >= {
        "speedup_b1",
        "bound_fraction_b1",
        "speedup_b4",
        "vs_hf_mtp_b1",
        "k1_acceptance",
        "auto_b1",
        "auto_b2",
        "vs_llama_cpp_k0",
        "vs_llama_cpp_best",
    }


def test_values_are_sane(result):
    data, _ = result
    for a in data["acceptance"]:
        assert len(a["per_position"]) == a["k"]
        assert all(0 <= p <= 1 for p in a["per_position"]) and 0 <= a["acceptance_rate"] <= 1
        assert 1 <= a["acceptance_length"] <= a["k"] + 1
    for e in data["engine"]:
        assert e["tokens_per_s"] > 0 and e["iteration_ms"] > 0 and 0 <= e["host_share"] <= 1
        # the decode phase leaves out the prefill, and its tokens the one each prefill samples
        assert e["decode_tokens_per_s"] > e["tokens_per_s"] * (NEW_TOKENS - 1) / NEW_TOKENS
        assert 1 <= e["acceptance_length"] <= (max(DEPTHS) if e["k"] == "auto" else e["k"]) + 1
        assert e["bound_tokens_per_s"] > 0 and e["bound_speedup"] > 0
        assert len(e["decode_runs"]) == 1 and e["decode_runs"][0] == pytest.approx(e["decode_tokens_per_s"])
        base = next(r for r in data["engine"] if r["k"] == 0 and r["batch"] == e["batch"])
        assert e["speedup"] == pytest.approx(e["decode_tokens_per_s"] / base["decode_tokens_per_s"])
        assert e["bound_fraction"] == pytest.approx(e["speedup"] / e["bound_speedup"])
        if e["k"] == 0:
            # Each batch of the timed prompts (3, rounded up to whole batches) gets its first token from
            # its prefill and its second from the step that prefilled it; the other steps decode.
            timed = bench.timed_prompts(TIMED_PROMPTS, e["batch"])
            assert e["decode_steps"] == timed // e["batch"] * (NEW_TOKENS - 2)
        if e["k"] == "auto":  # every timed decode step is counted at some depth
            assert (
                set(e["depth_histogram"]) <= {str(k) for k in DEPTHS}
                and sum(e["depth_histogram"].values()) > 0
            )
    assert all(h["tokens_per_s"] > 0 for h in data["hf"])
    bound = data["bound"]
    assert (
        bound["bandwidth_bytes_per_s"] > 0
        and bound["resident_bytes_per_s"] > 0
        and bound["target_bytes"] > 0
        and len(bound["mtp_step_bytes"]) == 1
    )
    for b in BATCHES:  # each draft step reads more weights, and rows routed apart more experts
        steps = [bound["steps_per_s"][f"{k}/{b}"] for k in DEPTHS]
        assert steps == sorted(steps, reverse=True)
    for k in DEPTHS:
        assert bound["routed_bytes"][f"{k}/{min(BATCHES)}"] <= bound["routed_bytes"][f"{k}/{max(BATCHES)}"]
        assert bound["verify_experts"][f"{k}/1"] <= bound["expert_count"]
    assert bound["routed_bytes"]["0/1"] == 0 and bound["routed_bytes"]["1/2"] > 0  # a row reads its own k
    assert bound["flops_per_s"] > 0 and bound["target_flops"] > 0 and len(bound["mtp_step_flops"]) == 1
    assert set(bound["roofline_steps_per_s"]) == {f"{k}/{b}" for k in DEPTHS for b in BATCHES}
    for e in data["engine"]:
        assert 0 < e["roofline_tokens_per_s"] <= e["bound_tokens_per_s"]
        assert 0 < e["roofline_speedup"] <= e["bound_speedup"] * (1 + 1e-9)
    goals = {g["id"]: g for g in data["goals"]}
    assert goals["speedup_b1"]["value"] >= 1  # best K includes K=0
    assert goals["speedup_b4"]["value"] is None  # B=4 was not run


def test_llama_cpp_row_when_installed(result):
    """llama.cpp joins the B=1 turns where llama-cpp-python is installed (the bench extra), plainly
    and with its MTP drafting at each depth above 0, and its greedy tokens equal the engine's on
    this checkpoint."""
    data, _ = result
    goals = {g["id"]: g for g in data["goals"]}
    if not llama_cpp_peer.available():
        assert data["peers"] == [] and goals["vs_llama_cpp_k0"]["value"] is None
        return
    mtp_rows = [f"llama.cpp MTP K={k}" for k in DEPTHS if k > 0] if llama_cpp_peer.mtp_available() else []
    assert [p["system"] for p in data["peers"]] == ["llama.cpp", *mtp_rows]
    for peer in data["peers"]:
        assert peer["batch"] == 1 and peer["tokens_per_s"] > 0
        assert peer["same_tokens"] and peer["first_difference"] is None
        if peer["system"] != "llama.cpp":  # drafts of one generation; its echo MTP layer drafts well
            assert 0 < peer["accepted"] <= peer["drafted"]
    assert goals["vs_llama_cpp_k0"]["value"] > 0
    fastest = max(data["peers"], key=lambda p: p["tokens_per_s"])
    assert ("vs_llama_cpp_fastest" in goals) == (fastest["system"] != "llama.cpp")


@pytest.mark.parametrize(
    "tokens,expected,differ",
    [([1, 2, 3], [1, 2, 3], None), ([1, 5, 3], [1, 2, 3], 1), ([1, 2], [1, 2, 3], 2)],
)
def test_a_peer_that_differs_is_reported(tokens, expected, differ):
    run = bench.peer_run(tokens, expected, [0.5, 0.25])
    assert (run.same_tokens, run.first_difference) == (differ is None, differ)
    assert run.tokens_per_s == len(expected) / 0.25


@given(rates=st.lists(st.tuples(st.floats(1, 1e4), st.floats(1, 1e4)), min_size=1, max_size=9))
def test_paired_ratio_is_the_median_and_range_of_each_rounds_ratio(rates):
    """The ratio is taken within each round, never across: a and b of round i against each other."""
    a, b = (bench.EngineRun(k, 1, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1) for k in (1, 0))
    a.decode_runs, b.decode_runs = [x for x, _ in rates], [y for _, y in rates]
    ratios = sorted(x / y for x, y in rates)
    assert bench.paired_ratio(a, b) == (
        f"per round {statistics.median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)}"
    )


def test_plot_is_written(result):
    _, out = result
    assert (out / "bench-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_weight_bytes_count_only_the_routed_experts_a_token_uses(echo_checkpoint):
    from compiled_mtp.models.checkpoint import load_model

    model = load_model(echo_checkpoint)
    cfg = model.cfg
    target, (mtp,) = bench.weight_bytes(model)
    everything = sum(p.nbytes for p in model.parameters())
    experts = sum(layer.mlp.experts.gate_proj.nbytes * 3 for layer in model.model.layers)
    unused = experts * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    embed_unread = model.model.embed_tokens.weight.nbytes - model.model.embed_tokens.weight[0].nbytes
    # Every parameter once, less unused experts and embedding rows; the draft step reads the head again.
    assert (
        target + mtp
        == everything
        - unused
        - embed_unread
        + model.model.embed_tokens.weight[0].nbytes
        + model.lm_head.weight.nbytes
    )


def test_every_graph_is_ready_before_any_generation(echo_checkpoint, monkeypatch):
    """A graph first met in a timed round would be timed while it builds: every runtime holds all of
    its graphs before it generates anything."""
    from compiled_mtp.models.checkpoint import load_model

    def ready_first(generate):
        def checked(rt, *args):
            assert set(rt.graphs._graphs) == set(rt.graphs.keys)
            return generate(rt, *args)

        return checked

    monkeypatch.setattr(engine, "timed_generate", ready_first(engine.timed_generate))
    monkeypatch.setattr(Runtime, "generate", ready_first(Runtime.generate))
    args = _args("--backend", "eager", "--new-tokens", str(NEW_TOKENS), "--runs", "1", "--accept-prompts", "1",
                 "--timed-prompts", "2", "--depths", "0", "2", "--batch-sizes", "2")  # fmt: skip
    prompts = bench.Prompts([[1, 2, 3, 4]] * 2, "random", "2 random prompts")
    bench.bench_engine(load_model(echo_checkpoint), prompts, args)


def test_weight_flops_count_every_matrix_a_token_multiplies_by(echo_checkpoint):
    """Two operations per element of every matrix a token multiplies by: not the embedding (a row is
    gathered), not the routed experts it is not routed to, the LM head again for a draft step; of those,
    the MTP layer's input projection and cache-entry projection on every row of a draft extend."""
    from compiled_mtp.models.checkpoint import load_model

    model = load_model(echo_checkpoint)
    cfg = model.cfg
    target, (mtp,), extend_row = bench.weight_flops(model)
    layer = model.mtp_layer(0)
    assert extend_row == 2 * (
        layer.eh_proj.weight.numel() + layer.self_attn.kv_a_proj_with_mqa.weight.numel()
    )
    assert not bench.extend_experts_every_row(model)
    matrices = sum(2 * p.numel() for p in model.parameters() if p.dim() >= 2)
    experts = sum(2 * layer.mlp.experts.gate_proj.numel() * 3 for layer in model.model.layers)
    unused = experts * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    assert model.draft_head is None  # the draft step's head is the shared LM head, counted again
    head = 2 * model.lm_head.weight.numel()
    assert target + mtp == matrices - unused - 2 * model.model.embed_tokens.weight.numel() + head


def test_a_draft_extend_reads_the_experts_of_the_rows_its_layer_routes():
    """Positions that each choose their own expert: a K=2 step at B=1 reads none beyond one row's in MTP
    layer 0 where the extend routes one row a request, and those of its other 2 rows where it routes
    every row (DeepSeek-V4's block)."""
    from compiled_mtp.expert_reads import Reader, Routing

    experts = torch.nn.Module()
    experts.gate_proj = torch.nn.Parameter(torch.zeros(4, 3, 2))  # 4 experts of 24 bytes
    routing = Routing([], [Reader(experts, torch.eye(4, dtype=torch.bool)[None])] * 2)  # draft depths 0, 1
    assert bench.routed_bytes(routing, [0, 2], [1]) == {"0/1": 0, "2/1": 0}
    assert bench.routed_bytes(routing, [0, 2], [1], extend_every_row=True) == {"0/1": 0, "2/1": 2 * 24}


ROOFLINE_DRAWS = dict(
    target=st.integers(1, 10**9),
    draft=st.lists(st.integers(1, 10**8), min_size=1, max_size=3),
    rate=st.floats(1e6, 1e15),
    depths=st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
    batches=st.lists(st.integers(1, 64), min_size=1, max_size=4, unique=True),
)


@given(
    **ROOFLINE_DRAWS,
    head=st.integers(0, 10**7),
    every_row=st.floats(0.0, 1.0),
    bandwidth=st.floats(1e6, 1e12),
)
def test_the_roofline_never_allows_more_than_the_bandwidth_bound(
    target, draft, head, every_row, rate, bandwidth, depths, batches
):
    """At most the bandwidth bound's steps; no more as rows are added (a deeper K, a larger B); and
    the bandwidth bound itself where arithmetic costs nothing."""
    extend_row = int(every_row * draft[0])  # the part of MTP layer 0 an extend runs on every row
    draft = [d + head for d in draft]  # a draft step's multiply-adds include its head's
    bytes_bound = bench.bandwidth_bound(target, draft, bandwidth, 1, 0.0, depths, batches)
    bench.add_roofline(bytes_bound, (target, draft, extend_row), rate, (0, 0.0))
    roof = bytes_bound.roofline_steps_per_s
    for k in depths:
        assert all(roof[f"{k}/{b}"] <= bytes_bound.steps_per_s[f"{k}/{b}"] for b in batches)
        by_batch = [roof[f"{k}/{b}"] for b in sorted(batches)]
        assert by_batch == sorted(by_batch, reverse=True)
    for b in batches:
        by_depth = [roof[f"{k}/{b}"] for k in sorted(depths)]
        assert by_depth == sorted(by_depth, reverse=True)
    free = bench.bandwidth_bound(target, draft, bandwidth, 1, 0.0, depths, batches)
    bench.add_roofline(free, (target, draft, extend_row), float("inf"), (0, 0.0))
    assert free.roofline_steps_per_s == free.steps_per_s


@given(
    target=ROOFLINE_DRAWS["target"],
    draft=ROOFLINE_DRAWS["draft"],
    depths=ROOFLINE_DRAWS["depths"],
    bandwidth=st.floats(1e6, 1e12),
    resident=st.one_of(st.just(0.0), st.floats(1e6, 1e12)),
    routed=st.integers(0, 10**8),
)
def test_the_bound_reads_at_the_faster_of_the_copy_and_the_warm_read(
    target, draft, depths, bandwidth, resident, routed
):
    """Every depth's steps are the faster bandwidth over its bytes, the routed experts its rows read
    beyond one row's among them: a warm read slower than the copy (a step's weights larger than the
    cache) leaves the copy's bound as it was, a faster one raises it."""
    extra = {f"{k}/2": routed for k in depths}
    copy_only = bench.bandwidth_bound(target, draft, bandwidth, 1, 0.0, depths, [1, 2], extra)
    bound = bench.bandwidth_bound(target, draft, bandwidth, 1, resident, depths, [1, 2], extra)
    for k in depths:
        read = target + sum(draft[j % len(draft)] for j in range(k))
        for b, more in ((1, 0), (2, routed)):
            steps = bound.steps_per_s[f"{k}/{b}"]
            assert steps == pytest.approx(max(bandwidth, resident) / (read + more), rel=1e-12)
            assert steps >= copy_only.steps_per_s[f"{k}/{b}"]
    assert bound.bandwidth_bytes_per_s == bandwidth and bound.resident_bytes_per_s == resident


@given(**ROOFLINE_DRAWS, faster=st.floats(1.0, 100.0), tile_rows=st.integers(1, 16))
def test_faster_tile_products_never_lower_the_roofline(
    target, draft, rate, faster, tile_rows, depths, batches
):
    """Products of tile_rows rows or more at a faster rate: never fewer steps than without them, never
    more than the bandwidth bound's."""
    bounds = [bench.bandwidth_bound(target, draft, 1e9, 1, 0.0, depths, batches) for _ in range(2)]
    bench.add_roofline(bounds[0], (target, draft, draft[0]), rate, (0, 0.0))
    bench.add_roofline(bounds[1], (target, draft, draft[0]), rate, (tile_rows, rate * faster))
    for key, steps in bounds[1].roofline_steps_per_s.items():
        assert bounds[0].roofline_steps_per_s[key] <= steps * (1 + 1e-12)
        assert steps <= bounds[1].steps_per_s[key]


def test_a_roofline_step_counts_every_row_of_its_graphs():
    """K=2, B=3: 9 rows through the target and the parts of the extend's layer that run on every row,
    3 through the rest of it (with its head) and through the draft step that follows."""
    bound = bench.bandwidth_bound(10**6, [10**5], 1e12, 1, 0.0, [0, 2], [3])
    bench.add_roofline(bound, (100, [40], 30), 1320.0, (0, 0.0))  # all but the head on every row
    assert bound.roofline_steps_per_s == {
        "0/3": 1320.0 / 300,
        "2/3": 1.0,
    }  # 9 * 100 + 9 * 30 + 3 * 10 + 3 * 40
    bench.add_roofline(bound, (100, [40], 12), 1212.0, (0, 0.0))  # 9 * (100 + 12) + 3 * 28 + 3 * 40
    assert bound.roofline_steps_per_s["2/3"] == pytest.approx(1.0)
    # From 9 rows on (the verify and the extend's every-row parts), the products at 1170 a second: 3
    # rows still at 1320.
    bench.add_roofline(bound, (100, [40], 30), 1320.0, (9, 1170.0))
    assert bound.roofline_steps_per_s["2/3"] == pytest.approx(1 / (1170 / 1170 + 150 / 1320))


@needs_bfloat16_dot
def test_the_roofline_takes_the_bfloat16_mlps_rate_from_one_row_while_they_are_on():
    """With --bfloat16-mlps every row count multiplies at the dense MLP's bfloat16 rate, which beats
    torch.mm's float32 one on these cores; off, AMX's tiles (or nothing) as before."""
    rows_off = bench.tile_rate("cpu", torch.float32)[0]
    with bfloat16_mlps():
        rows, rate = bench.tile_rate("cpu", torch.float32)
    assert rows == 1 and rate > bench.gemm_rate("cpu", torch.float32)
    assert bench.tile_rate("cpu", torch.float32)[0] == rows_off == torch.ops.compiled_mtp.panel_amx()


def test_weight_bytes_count_the_panels_an_op_reads_in_place_of_a_weight(echo_checkpoint):
    """A weight of bfloat16 values that an op has read from panels counts its panels' bytes, half its
    own (the LM head here); the others count their own."""
    from compiled_mtp.models.checkpoint import load_model
    from compiled_mtp.ops import library

    model = load_model(echo_checkpoint)
    head = model.lm_head.weight
    assert library.load()
    with torch.no_grad():
        head.copy_(head.bfloat16().float())
    before, _ = bench.weight_bytes(model)
    torch.ops.compiled_mtp.panel_linear(torch.ones(1, head.shape[1]), head)
    after, _ = bench.weight_bytes(model)
    panels = torch.ops.compiled_mtp.panel_bytes(head)
    assert before - after == head.nbytes - panels and head.nbytes // 2 <= panels < head.nbytes


@pytest.mark.skipif(
    not (DEFAULT_MODEL / "tokenizer.json").exists(), reason="the default model is not shipped yet"
)
def test_default_model_prompts_are_held_out_text():
    prompts = bench.bench_prompts(DEFAULT_MODEL, 0, 16, 32)
    assert prompts.source == "held-out"
    assert len(prompts.token_ids) == 16 and {len(p) for p in prompts.token_ids} == {32}


@pytest.mark.parametrize(
    "preset,model_type,name,hf_systems",
    [
        ("glm-tiny", "glm4_moe", "GLM-4 MoE", {"generate", "generate(use_mtp=True)"}),
        ("v4-tiny", "deepseek_v4", "DeepSeek-V4", {"generate"}),
    ],
)
def test_random_checkpoint_of_another_family_then_bench(
    tmp_path, capsys, preset, model_type, name, hf_systems
):
    """`random-checkpoint --preset`, then `bench --model` on it: the engine's rows, HF's generate, and
    generate(use_mtp=True) where HF runs the family's MTP layer (not DeepSeek-V4's, which HF drops);
    llama.cpp's rows, plain and MTP, on GLM-4 MoE (its glm4moe GGUF) where llama-cpp-python is
    installed, with the engine's greedy tokens, and none on DeepSeek-V4 (no GGUF architecture)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "bench"
    main(["random-checkpoint", "--preset", preset, "--out", str(ckpt), "--seed", "1"])
    assert capsys.readouterr().out == f"wrote a random {preset!r} {name} checkpoint to {ckpt}\n"
    main([
        "bench", "--model", str(ckpt), "--backend", "eager", "--new-tokens", "4", "--runs", "1", "--prompt-len", "8",
        "--accept-prompts", "2", "--timed-prompts", "2", "--copy-mb", "16", "--out", str(out), "--depths", "0", "1",
        "--batch-sizes", "1",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    exported = model_type in LAYOUTS
    no_gguf_row = (
        f"no llama.cpp row: llama.cpp's GGUF has no architecture for {model_type} in this gguf package"
    )
    assert (no_gguf_row in printed) == (not exported)
    no_mtp_row = f"no HF generate(use_mtp=True) row: HF transformers does not run {name}'s MTP layer"
    assert (no_mtp_row in printed) == ("generate(use_mtp=True)" not in hf_systems)
    data = json.loads((out / "bench-cpu.json").read_text())
    assert {(e["k"], e["batch"]) for e in data["engine"]} == {(0, 1), (1, 1), ("auto", 1)}
    assert {(h["system"], h["batch"]) for h in data["hf"]} == {(system, 1) for system in hf_systems}
    assert all(row["tokens_per_s"] > 0 for row in data["engine"] + data["hf"] + data["peers"])
    llama = exported and llama_cpp_peer.available()
    mtp_rows = ["llama.cpp MTP K=1"] if llama and llama_cpp_peer.mtp_available() else []
    assert [p["system"] for p in data["peers"]] == (["llama.cpp", *mtp_rows] if llama else [])
    assert all(p["same_tokens"] for p in data["peers"])


def test_the_speedup_goal_names_the_most_the_roofline_allows():
    """The goal's detail gives the best roofline speedup among the fixed depths at its B, so a run says
    when its goal is beyond what the machine's bytes and arithmetic allow any depth."""
    rows = []
    for k, rate, roof in ((0, 1000.0, 1.0), (1, 1270.0, 1.54), (2, 1440.0, 1.43), ("auto", 1400.0, 1.9)):
        row = bench.EngineRun(k, 1, rate, rate, 1.0, 1.0, 0.0, 0.0, 1.0, 1, decode_runs=[rate])
        row.speedup, row.roofline_speedup = rate / 1000.0, roof
        rows.append(row)
    speedup = _speedup_goal(rows, 1, 1.8)[0]
    assert speedup.value == pytest.approx(1.44) and speedup.met is False
    assert speedup.detail.startswith("K=2: 1440.0 vs 1000.0 decode tok/s")
    # Auto's 1.9x is left out: its roofline is its best fixed depth's.
    assert speedup.detail.endswith("the roofline allows at most 1.54x (K=1)")


def test_the_bound_goal_judges_the_fastest_drafting_configuration():
    """Where K=0 decodes fastest, the share-of-bound goal still reports the fastest configuration that
    drafts: K=0's own share is 100% by definition and would read as met."""
    rows = []
    for k, rate, fraction in ((0, 1000.0, 1.0), (1, 980.0, 0.57), (3, 900.0, 0.33), ("auto", 960.0, 0.35)):
        row = bench.EngineRun(k, 4, rate, rate, 1.0, 1.0, 0.0, 0.0, 1.0, 1, decode_runs=[rate])
        row.speedup, row.bound_speedup, row.bound_fraction = rate / 1000.0, 1.7, fraction
        rows.append(row)
    speedup, share = _speedup_goal(rows, 4, 1.3)
    assert speedup.detail.startswith("K=0:") and speedup.met is False
    assert share.value == pytest.approx(0.57) and share.met is False
    assert share.detail.startswith("K=1: 0.98x of a bound of 1.70x")
    assert _speedup_goal(rows[:1], 4, 1.3)[0].value is None  # K=0 alone: nothing drafted
