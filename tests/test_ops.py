"""The ops the passes put into graphs, called directly: each C++ kernel (compiled_mtp/ops/csrc)
against the PyTorch function it replaces, its argument checks, and the library not building."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._inductor import cpu_vec_isa

from compiled_mtp.capture.compiler import CompiledGraphs
from compiled_mtp.capture.post_grad import post_grad_graphs
from compiled_mtp.graphs.plan import GraphKey, GraphKind, example_inputs
from compiled_mtp.graphs.state import StaticState
from compiled_mtp.models.checkpoint import load_model
from compiled_mtp.models.deepseek_v3 import latent_attention
from compiled_mtp.models.layers import dense_mlp, gathered_experts
from compiled_mtp.ops import library
from compiled_mtp.passes import narrow_linear
from compiled_mtp.passes.manager import PassManager, available
from tests.precision import BFLOAT16_DOT, bfloat16_mlps, needs_bfloat16_dot

ops = torch.ops.compiled_mtp
aten = torch.ops.aten


@pytest.mark.parametrize("rows", [2, 4, 16])
def test_panel_linear_matches_f_linear_on_a_large_weight(rows):
    """A weight the size of an LM head, whose panels are longer than the prefetch's reach, with a
    partial last panel."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 768, generator=gen), torch.randn(4099, 768, generator=gen)
    expected = torch.nn.functional.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(ops.panel_linear(x, weight), expected, rtol=1e-5, atol=1e-4)


PANEL_DRAWS = dict(rows=st.integers(1, 16), out_features=st.integers(1, 70), seed=st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(**PANEL_DRAWS, in_features=st.integers(1, 40))
def test_panel_linear_matches_f_linear(rows, out_features, in_features, seed):
    """Any row count it takes (blocks of 8 rows and their remainders), and output counts that leave a
    partial last panel and a partial group of panels."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = (
        torch.randn(rows, in_features, generator=gen),
        torch.randn(out_features, in_features, generator=gen),
    )
    expected = torch.nn.functional.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(ops.panel_linear(x, weight), expected, rtol=1e-5, atol=1e-4)


def test_panel_linear_follows_its_weight():
    """The copy in panels is made again after the weight changes in place, and a weight that is a
    slice of a larger tensor at another offset gets its own."""
    gen = torch.Generator().manual_seed(7)
    storage = torch.randn(96, 24, generator=gen)
    weight, other = storage[:48], storage[48:]
    x = torch.randn(12, 24, generator=gen)
    first = ops.panel_linear(x, weight)
    torch.testing.assert_close(first, x @ weight.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.panel_linear(x, other), x @ other.T, rtol=1e-5, atol=1e-4)
    weight.mul_(-2.0)
    torch.testing.assert_close(ops.panel_linear(x, weight), -2.0 * first, rtol=1e-5, atol=1e-4)


def _bfloat16_valued(*shapes, generator):
    return [torch.randn(shape, generator=generator).bfloat16().float() for shape in shapes]


def _off_bfloat16(weight: torch.Tensor, index: tuple) -> torch.Tensor:
    """`weight` with one element moved off the bfloat16 values (its lowest bit set), as a copy."""
    moved = weight.clone()
    moved.view(torch.int32)[index] |= 1
    return moved


@contextlib.contextmanager
def vector_products():
    """AMX's tile products off (where the machine has them) inside: the vector path alone; after, as
    they were."""
    rows = ops.panel_amx()
    ops.panel_amx(False)
    try:
        yield
    finally:
        ops.panel_amx(rows > 0)


def _padded(in_features: int) -> int:
    """bfloat16 panels' columns: `in` padded to whole blocks of 32 (panels.h)."""
    return -(-in_features // 32) * 32


@settings(max_examples=40, deadline=None)
@given(**PANEL_DRAWS, in_features=st.integers(2, 40))
def test_bfloat16_panels_give_the_float32_panels_products_bit_for_bit(rows, out_features, in_features, seed):
    """A weight of bfloat16 values is read from panels of half the bytes (and the padding of its
    columns), and every product of the vector path is bit for bit the one from float32 panels: the
    same weight with one element off the bfloat16 values, in a column the rows multiply by zero (which
    adds exactly nothing to any sum). Odd column counts take the last column alone."""
    gen = torch.Generator().manual_seed(seed)
    (weight,) = _bfloat16_valued((out_features, in_features), generator=gen)
    column = int(torch.randint(0, in_features, (1,), generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    x[:, column] = 0.0
    moved = _off_bfloat16(weight, (out_features - 1, column))
    with vector_products():
        got, reference = ops.panel_linear(x, weight), ops.panel_linear(x, moved)
    assert torch.equal(got, reference)
    assert 2 * ops.panel_bytes(weight) * in_features == ops.panel_bytes(moved) * _padded(in_features) > 0


@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_dense_mlp_on_bfloat16_weights_gives_the_float32_products_bit_for_bit(rows):
    """The MLP's three weights from bfloat16 panels against float32 ones: each moved off the bfloat16
    values where it multiplies zero (a column x leaves at zero; down's column of an intermediate whose
    up row is zero), and against the model function."""
    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 40, 83
    gate, up, down = _bfloat16_valued((inter, hidden), (inter, hidden), (hidden, inter), generator=gen)
    up[5] = 0.0
    x = torch.randn(rows, hidden, generator=gen)
    x[:, 3] = 0.0
    moved = (_off_bfloat16(gate, (7, 3)), _off_bfloat16(up, (9, 3)), _off_bfloat16(down, (11, 5)))
    with vector_products():
        got = ops.dense_mlp(x, gate, up, down)
        assert torch.equal(got, ops.dense_mlp(x, *moved))
    assert [2 * ops.panel_bytes(w) * w.shape[1] for w in (gate, up, down)] == [
        ops.panel_bytes(w) * _padded(w.shape[1]) for w in moved
    ]
    expected = dense_mlp(x.double(), gate.double(), up.double(), down.double()).float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


AMX_ROWS = ops.panel_amx()  # 0 where the machine or the build has no AMX, or COMPILED_MTP_AMX=0
needs_amx = pytest.mark.skipif(not AMX_ROWS, reason="no AMX on this machine")


def _float32_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` is x W^T to float32 rounding: within a few units in the last place of the sum of the
    products' magnitudes."""
    expected = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    assert ((got.double() - expected).abs() <= 4 * 2**-24 * (scale + 1e-30) * x.shape[1] ** 0.5).all()


@needs_amx
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 16),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 80),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e6]),
)
def test_amx_products_are_the_float32_products(rows, out_features, in_features, seed, scale):
    """From AMX_MIN_ROWS rows on, a weight of bfloat16 values is multiplied on AMX's tiles, the rows
    split into three bfloat16 parts: exactly the float32 products, added in another order. Below, the
    vector path. Column counts that leave a partial block of 32, and small and large rows."""
    gen = torch.Generator().manual_seed(seed)
    (weight,) = _bfloat16_valued((out_features, in_features), generator=gen)
    x = torch.randn(rows, in_features, generator=gen) * scale
    assert ops.panel_amx() == AMX_ROWS  # the tiles on, whatever the tests before switched
    _float32_rounding(ops.panel_linear(x, weight), x, weight)


@needs_amx
def test_amx_products_switch_off_and_on():
    """panel_amx(False) leaves every row count on the vector path, bit for bit the float32 panels';
    panel_amx(True) takes AMX_MIN_ROWS rows and more back to the tiles; panel_amx() only reads which."""
    gen = torch.Generator().manual_seed(5)
    (weight,) = _bfloat16_valued((96, 256), generator=gen)
    moved = _off_bfloat16(weight, (0, 0))
    x = torch.randn(16, 256, generator=gen)
    x[:, 0] = 0.0
    with vector_products():
        assert ops.panel_amx(False) == 0 and ops.panel_amx() == 0
        assert torch.equal(ops.panel_linear(x, weight), ops.panel_linear(x, moved))
    assert ops.panel_amx() == AMX_ROWS  # vector_products leaves them as they were
    assert ops.panel_amx(True) == AMX_ROWS
    tiles = ops.panel_linear(x, weight)
    _float32_rounding(tiles, x, weight)
    assert not torch.equal(tiles, ops.panel_linear(x, moved))  # the sums added in another order


@needs_amx
@pytest.mark.parametrize("rows", [8, 16])
def test_dense_mlp_on_amx_is_the_model_function(rows):
    """The MLP of bfloat16 weights on AMX's tiles, as close to the model function in float64 as the
    vector path's float32 sums are."""
    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 72, 200
    gate, up, down = _bfloat16_valued((inter, hidden), (inter, hidden), (hidden, inter), generator=gen)
    x = torch.randn(rows, hidden, generator=gen)
    expected = dense_mlp(x.double(), gate.double(), up.double(), down.double())
    with vector_products():
        vector = (ops.dense_mlp(x, gate, up, down).double() - expected).abs().max().item()
    tiles = (ops.dense_mlp(x, gate, up, down).double() - expected).abs().max().item()
    assert tiles <= 2 * vector


@pytest.mark.skipif(bool(AMX_ROWS), reason="AMX's own tiles run the tests above")
@pytest.mark.skipif(
    not str(cpu_vec_isa.pick_vec_isa()).startswith("avx512"), reason="the tile path needs AVX-512"
)
def test_amx_tests_on_the_tile_model():
    """On a machine without AMX, the AMX tests above run in a build whose tile instructions are a
    model of them in C++ (csrc/amx_tiles.h): the tile path's splits, loads, strides, products and
    stores, checked against the float32 products, where nothing else would run them."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-n", "0", "-p", "no:cacheprovider"]
        + ["-k", "amx and not tile_model"],
        env={**os.environ, "COMPILED_MTP_AMX_MODEL": "1"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = re.findall(r"^.*\bpassed\b.*$", run.stdout, re.M)[-1]
    assert re.search(r"\b4 passed", summary) and "skipped" not in summary, summary


def test_bfloat16_products_switch_on_only_where_the_machine_has_them():
    """Off in a new process; on where AVX512-BF16 is, and off again."""
    assert not ops.bfloat16_products()
    assert ops.bfloat16_products(True) == BFLOAT16_DOT == ops.bfloat16_products()
    assert not ops.bfloat16_products(False) and not ops.bfloat16_products()


@needs_bfloat16_dot
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40), hidden=st.integers(1, 70), inter=st.integers(1, 90), seed=st.integers(0, 2**16)
)
def test_dense_mlp_in_bfloat16_gives_each_row_its_own_products(rows, hidden, inter, seed):
    """With bfloat16_products on, the MLP of bfloat16 weights rounds its rows and its activation to bfloat16 and
    adds the products in float32: each row's output is bit for bit the one it gets alone (a verify's
    row, the depth-0 step's), also past 16 rows (a verify of B=8 at K=2, a prefill chunk), and the
    model function's on the rounded rows within a bfloat16 step of the activation. panel_linear still
    multiplies in float32. Odd widths take the padding's zeros."""
    gen = torch.Generator().manual_seed(seed)
    gate, up, down = _bfloat16_valued((inter, hidden), (inter, hidden), (hidden, inter), generator=gen)
    x = torch.randn(rows, hidden, generator=gen)
    with vector_products():
        exact = ops.panel_linear(x[:16], gate), ops.dense_mlp(x, gate, up, down)  # panel_linear: 1-16 rows
        with bfloat16_mlps():
            got = ops.dense_mlp(x, gate, up, down)
            alone = torch.cat([ops.dense_mlp(x[r : r + 1], gate, up, down) for r in range(rows)])
            assert torch.equal(ops.panel_linear(x[:16], gate), exact[0])
    assert torch.equal(got, alone) and not torch.equal(got, exact[1])
    rounded = x.bfloat16().double()
    act = dense_mlp(rounded, gate.double(), up.double(), torch.eye(inter, dtype=torch.float64))
    expected = act.bfloat16().double() @ down.double().T
    # The op's float32 activation and this float64 one may round to neighbouring bfloat16 values.
    spread = act.abs() @ down.double().abs().T
    assert ((got.double() - expected).abs() <= 2**-7 * spread + 1e-30).all()


def test_panel_bytes_is_zero_until_an_op_reads_the_weight():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 16, generator=gen)
    assert ops.panel_bytes(weight) == 0
    ops.panel_linear(torch.randn(2, 16, generator=gen), weight)
    assert ops.panel_bytes(weight) == weight.nbytes  # 32 outputs fill whole panels at 8 or 16 lanes


@given(sizes=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=6))
def test_huge_page_memory_is_aligned_and_each_piece_its_own(sizes):
    """Pieces carved from the slabs start on cache lines and never overlap: writing one leaves the
    others as they were."""
    pieces = [ops.huge_page_bytes(n) for n in sizes]
    assert [p.numel() for p in pieces] == sizes and all(p.data_ptr() % 64 == 0 for p in pieces)
    for i, piece in enumerate(pieces):
        piece.fill_(i)
    assert all(bool((piece == i).all()) for i, piece in enumerate(pieces))


def test_a_storage_moved_to_huge_pages_keeps_its_values_and_every_tensor_on_it():
    """A view and a second tensor on the same storage read the moved memory; a second move keeps it."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(300, 70, generator=gen)
    view, expected, address = base[10:20, 3:], base.clone(), base.data_ptr()
    ops.move_to_huge_pages(view)
    assert base.data_ptr() != address and torch.equal(base, expected)
    assert view.data_ptr() == base.data_ptr() + (10 * 70 + 3) * 4
    view.fill_(7.0)
    assert bool((base[10:20, 3:] == 7.0).all())
    moved = base.data_ptr()
    ops.move_to_huge_pages(base)
    assert base.data_ptr() == moved


def test_a_model_moves_onto_huge_pages_before_its_first_graphs_and_never_after(tiny_checkpoint):
    """The first graphs hold the weights' addresses (capture/aot.py): a model whose first graphs call
    the ops moves then; a model first served by graphs without them never moves later."""

    def addresses(model):
        return [p.data_ptr() for p in model.parameters()]

    for first, then in (((), None), (None, ())):
        model = load_model(tiny_checkpoint)
        state = StaticState(model, num_slots=2, max_seq_len=16, max_depth=2)
        before = addresses(model)
        CompiledGraphs(model, state, "inductor", passes=first)
        settled = addresses(model)
        assert (settled == before) == (first == ())
        CompiledGraphs(model, state, "inductor", passes=then)
        assert addresses(model) == settled


@settings(max_examples=40)
@given(
    rows=st.integers(1, 11),
    k=st.integers(1, 4),
    extra=st.integers(0, 5),
    inter=st.integers(1, 40),
    hidden=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_routed_experts_matches_the_gathered_products(rows, k, extra, inter, hidden, seed):
    """Any row count, chunks of 1-4 rows per expert, lengths that leave vector tails, and an expert
    chosen twice by one row (the kernel takes what it is given). The bfloat16 copies of experts of
    bfloat16 values (passes/bfloat16_reads.py), widened as loaded, give the float32 products bit for
    bit."""
    gen = torch.Generator().manual_seed(seed)
    n_experts = k + extra
    x = torch.randn(rows, hidden, generator=gen)
    idx = torch.randint(0, n_experts, (rows, k), generator=gen)
    weights = torch.rand(rows, k, generator=gen)
    gate, up, down = (
        torch.randn(shape, generator=gen)
        for shape in ((n_experts, inter, hidden), (n_experts, inter, hidden), (n_experts, hidden, inter))
    )
    expected = gathered_experts(x, idx, weights, gate, up, down)
    got = ops.routed_experts(x, idx, weights, gate, up, down)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * max(1.0, expected.abs().max().item()))
    copies = [w.bfloat16() for w in (gate, up, down)]
    widened = ops.routed_experts(x, idx, weights, *(w.float() for w in copies))
    assert torch.equal(ops.routed_experts(x, idx, weights, *copies), widened)


@pytest.mark.parametrize("shape", [(1, 40), (3, 40), (2, 2, 17), (5, 3), (9, 17), (16, 40), (20, 17)])
def test_dense_mlp_matches_the_model_function(shape):
    """Any leading shape, lengths that leave vector tails and partial panels (17, 3), up to 16 rows
    from the weights' panels (a block of 8 rows and a remainder: 9), and more rows (20, a prefill
    chunk) through the dot-block kernel, an odd last down row (17) included."""
    gen = torch.Generator().manual_seed(sum(shape))
    hidden, inter = shape[-1], 2 * shape[-1] + 1
    x = torch.randn(shape, generator=gen)
    gate, up, down = (
        torch.randn(inter, hidden, generator=gen),
        torch.randn(inter, hidden, generator=gen),
        torch.randn(hidden, inter, generator=gen),
    )
    expected = dense_mlp(x.double(), gate.double(), up.double(), down.double()).float()
    torch.testing.assert_close(
        ops.dense_mlp(x, gate, up, down),
        expected,
        rtol=1e-4,
        atol=1e-4 * max(1.0, expected.abs().max().item()),
    )


def _attention_case(
    gen: torch.Generator,
    batch: int,
    rows: int,
    capacity: int,
    heads: int,
    rank: int,
    rope: int,
    slots: int,
    blind: bool,
    holes: bool = False,
    dn: int = 8,
    dv: int = 8,
):
    """Random queries, kv_b_proj weight and cache; each row sees its cache up to a random position
    (none at all, with `blind`, for some rows), and with `holes` only about two thirds of the entries
    before it. The weight's values are bfloat16's, so that its bfloat16 copy holds the same ones."""
    q_nope, q_pe = (
        torch.randn(batch, rows, heads, dn, generator=gen),
        torch.randn(batch, rows, heads, rope, generator=gen),
    )
    kv_b = (torch.randn(heads * (dn + dv), rank, generator=gen) / dn**0.5).bfloat16().float()
    cache = 10 * torch.randn(slots, capacity, rank + rope, generator=gen)
    slot_ids = (
        torch.randperm(slots, generator=gen)[:batch]
        if batch <= slots
        else torch.randint(0, slots, (batch,), generator=gen)
    )
    positions = torch.randint(-1 if blind else 0, capacity, (batch, rows), generator=gen)
    visible = torch.arange(capacity) <= positions[..., None]
    if holes:
        visible &= torch.rand(batch, rows, capacity, generator=gen) < 0.7
    return q_nope, q_pe, kv_b, cache, slot_ids, visible


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 5),
    capacity=st.integers(1, 150),
    heads=st.integers(1, 4),
    rank=st.integers(1, 40),
    rope=st.integers(1, 20),
    dn=st.integers(1, 40),
    dv=st.integers(1, 40),
    slots=st.integers(3, 5),
    blind=st.booleans(),
    holes=st.booleans(),
    strided=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    batch=2,
    rows=5,
    capacity=150,
    heads=4,
    rank=36,
    rope=16,
    dn=32,
    dv=7,
    slots=3,
    blind=True,
    holes=True,
    strided=True,
    bfloat16=True,
    seed=1,
)
def test_live_attention_equals_attention_over_the_whole_cache(
    batch, rows, capacity, heads, rank, rope, dn, dv, slots, blind, holes, strided, bfloat16, seed
):
    """The op reads only up to the last entry a request's rows see; entries past it, whatever they
    hold, have no weight in the traced attention. Widths with and without tails past the columns a
    row's lanes take together, and past the vectors of the absorbed products; caches over several of
    the kernel's entry blocks, rows that see nothing (NaN, as traced) and masks with holes; queries
    read in place by their strides (slices of a wider row, as q_b_proj's output gives them, or
    head-major); kv_b_proj's weight as float32 or as its bfloat16 copy; and from 1 to 20 query rows a
    request, so that a thread scores groups of every size up to 16 rows, each row on 16 lanes down to
    1, and takes each head's rows into the latent space and out of it up to 4 at a time (the example:
    20 rows a request, groups of 16 and 4 on one thread, 3 blocks of entries, the last of 22)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = (batch, rows, capacity, heads, rank, rope, slots)
    q_nope, q_pe, kv_b, cache, slot_ids, visible = _attention_case(gen, *shapes, blind, holes, dn, dv)
    if strided:
        q_nope = torch.cat([q_nope, q_pe], dim=-1)[..., :dn]
        q_pe = q_pe.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    expected = latent_attention(q_nope, q_pe, kv_b, cache[slot_ids], visible, 0.3)
    weight = kv_b.bfloat16() if bfloat16 else kv_b
    got = ops.live_attention(q_nope, q_pe, weight, cache, slot_ids, visible, 0.3)
    # Scores reach ~100 here and exp turns their rounding (summed in another order) into relative
    # differences of ~1e-5 in the weights of entries of size ~10; a wrong entry or mask is off by ~1.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3, equal_nan=True)


def _refusals():
    """(op call, the message it must raise): a dtype, a shape, a layout or an index each kernel does not take."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(48, 40, generator=gen)
    e_x, idx, e_w = (
        torch.randn(3, 24, generator=gen),
        torch.randint(0, 6, (3, 2), generator=gen),
        torch.rand(3, 2, generator=gen),
    )
    gate, up, down = (
        torch.randn(6, 8, 24, generator=gen),
        torch.randn(6, 8, 24, generator=gen),
        torch.randn(6, 24, 8, generator=gen),
    )
    q_nope, q_pe, kv_b, cache, slots, visible = _attention_case(gen, 2, 3, 70, 2, 20, 6, 3, blind=False)
    logits, drafts, q, noise = (
        torch.randn(2, 3, 50, generator=gen),
        torch.randint(0, 50, (2, 2), generator=gen),
        torch.rand(2, 2, 50, generator=gen),
        torch.rand(2, 3, generator=gen),
    )
    return [
        (
            lambda: ops.panel_linear(x.bfloat16(), w.bfloat16()),
            "panel_linear: x must be Float, got BFloat16",
        ),
        (lambda: ops.panel_linear(torch.randn(17, 40), w), "panel_linear: x must have 1 to 16 rows, got 17"),
        (lambda: ops.panel_linear(x, w[:, :39].contiguous()), "panel_linear: x has 40 columns, weight 39"),
        (lambda: ops.panel_linear(x, w.t().contiguous().t()), "panel_linear: weight must be contiguous"),
        (
            lambda: ops.routed_experts(e_x, idx, e_w, gate, up, down[:, :, :7].contiguous()),
            "routed_experts: down must be [6, 24, 8], got [6, 24, 7]",
        ),
        (
            lambda: ops.dense_mlp(e_x, gate[0], up[0], down[0, :8].contiguous()),
            "dense_mlp: down must be [24, 8], got [8, 8]",
        ),
        (
            lambda: ops.routed_experts(e_x, idx.clamp(max=0) + 6, e_w, gate, up, down),
            "routed_experts: expert id 6 outside [0, 6)",
        ),
        (
            lambda: ops.routed_experts(e_x, idx, e_w, gate.bfloat16(), up, down.bfloat16()),
            "routed_experts: up must be BFloat16, got Float",
        ),
        (
            lambda: ops.live_attention(q_nope, q_pe, kv_b, cache, slots, visible[:, :, :69], 0.3),
            "live_attention: visible must be [2, 3, 70], got [2, 3, 69]",
        ),
        (
            lambda: ops.live_attention(q_nope, q_pe, kv_b, cache, slots.int(), visible, 0.3),
            "live_attention: slots must be Long, got Int",
        ),
        (
            lambda: ops.live_attention(q_nope, q_pe, kv_b[:, :19].contiguous(), cache, slots, visible, 0.3),
            "live_attention: kv_b must be [2 x (8 + v), 20], got [32, 19]",
        ),
        (
            lambda: ops.greedy_sample(logits, torch.zeros(2), drafts[:, :1], q, noise),
            "greedy_sample: drafts must be [2, 2], got [2, 1]",
        ),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())))
def test_ops_refuse_what_their_kernels_do_not_take(case):
    """Checked at the op boundary with a message naming the op and the argument: the kernels read raw
    pointers by these shapes, so nothing may reach them unchecked."""
    call, message = _refusals()[case]
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}"):
        call()


@pytest.fixture
def unbuilt(monkeypatch):
    """The library as where no compiler builds it: one warning, and load() says False."""

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    library.load.cache_clear()
    with pytest.warns(
        UserWarning,
        match=r"^compiled_mtp: the C\+\+ ops did not build \(g\+\+: not found\); their regions stay as traced$",
    ):
        assert library.load() is False
    yield
    monkeypatch.undo()
    library.load.cache_clear()
    assert library.load()


def test_a_build_killed_midway_leaves_no_lock_that_blocks_the_next_load():
    """torch's build lock is a file, which a process killed while it built the library leaves behind:
    load() removes it under a lock of its own and returns, where torch's tooling alone waits forever."""
    build = library.build_dir()
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()
    library.load.cache_clear()
    loaded: list[bool] = []
    thread = threading.Thread(target=lambda: loaded.append(library.load()), daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert loaded == [True]
    assert not (build / "lock").exists()


def test_another_compiler_builds_into_a_folder_of_its_own(monkeypatch):
    """torch's tooling builds with `CXX`: a process run with another compiler would otherwise
    rebuild the library in place, under every other process that loads it."""
    monkeypatch.setenv("CXX", "c++")
    default = library.build_dir()
    monkeypatch.setenv("CXX", "g++-with-static-libstdc++")
    other = library.build_dir()
    assert other.parent == default.parent and other.name != default.name
    assert other.name.startswith(f"compiled_mtp_ops_{library.version()}_")


def test_without_the_library_every_region_stays_as_traced(tiny_checkpoint, unbuilt, monkeypatch, caplog):
    """No op of the library enters a graph (each region pass logs why), and greedy batches take the
    sampling ops' Python path."""
    model = load_model(tiny_checkpoint)
    state = StaticState(model, num_slots=2, max_seq_len=16, max_depth=2)
    monkeypatch.setattr(narrow_linear, "KERNEL_WEIGHT", 0)
    with caplog.at_level("INFO", logger="compiled_mtp.passes"):
        key = GraphKey(GraphKind.target_verify, 2, 2)
        _, after = post_grad_graphs(
            key.kind, model, state, example_inputs(key, model, prefill_chunk=8), available()
        )
    native = {
        ops.panel_linear.default,
        ops.live_attention.default,
        ops.routed_experts.default,
        ops.dense_mlp.default,
        ops.greedy_verify_sample.default,
    }
    assert not [n for n in after.graph.nodes if n.target in native]
    for name in ("live_attention", "group_experts", "fuse_dense_mlp"):
        assert f"{name}: left as traced: the C++ ops did not build" in caplog.text
    assert [n for n in after.graph.nodes if n.target == ops.verify_sample.default]


def test_graphs_build_the_library_before_any_step_for_float32_cpu_models(tiny_checkpoint, monkeypatch):
    """Not on the first step served: its compiler run would stall it. A bfloat16 model, or one with
    no pass on, does not build it."""
    model = load_model(tiny_checkpoint)
    state = StaticState(model, num_slots=2, max_seq_len=16, max_depth=2)
    library.load.cache_clear()
    CompiledGraphs(model.bfloat16(), StaticState(model, num_slots=2, max_seq_len=16, max_depth=2), "inductor")
    CompiledGraphs(load_model(tiny_checkpoint), state, "inductor", passes=())
    assert library.load.cache_info().misses == 0
    CompiledGraphs(load_model(tiny_checkpoint), state, "inductor")
    assert library.load.cache_info().misses == 1 and library.load()


def test_graphs_the_library_does_not_serve_never_build_it(tiny_checkpoint):
    """A model whose graphs call none of the C++ ops (bfloat16 here; CUDA alike) compiles without
    building the library: the passes look for regions they take first, and the uuid asks whether it
    built only for CPU models."""
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    state = StaticState(model, num_slots=2, max_seq_len=16, max_depth=2)
    key = GraphKey(GraphKind.target_verify, 2, 2)
    sampling = {"fuse_verify_sampling", "fuse_draft_sampling"}  # their Python ops serve any dtype on CPU
    library.load.cache_clear()
    post_grad_graphs(
        key.kind, model, state, example_inputs(key, model, 8), tuple(set(available()) - sampling)
    )
    manager = PassManager(available())
    manager.on_cpu = False
    manager.uuid()
    assert library.load.cache_info().misses == 0
    assert manager.uuid() != PassManager(available()).uuid()
