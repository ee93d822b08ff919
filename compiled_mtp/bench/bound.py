"""The memory-bandwidth bound and the roofline: the bytes and multiply-adds a step must spend."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from ..capture import weight_copies
from ..expert_reads import Reader, Routing, experts_read, is_stacked_experts
from ..models.family import CausalLM
from ..ops import library
from .results import Bound, EngineRun, engine_row
from .timing import best_of, sync


def _layer_size(layer: torch.nn.Module, num_experts_per_tok: int, size: Callable[[torch.Tensor], int]) -> int:
    """`size` summed over the weights one token reads from a decoder layer: all of them except the
    routed experts, of which it reads only the `num_experts_per_tok` it is routed to."""
    total = 0
    for module in layer.modules():
        amount = sum(size(p) for p in module.parameters(recurse=False))
        stacked = is_stacked_experts(module)
        total += amount * num_experts_per_tok // next(module.parameters()).shape[0] if stacked else amount
    return total


def step_sizes(model: CausalLM, size: Callable[[torch.Tensor], int], row: int) -> tuple[int, list[int]]:
    """`size` summed over what one target forward reads, and one draft step per MTP layer: `row` for its
    embedding row, its layers, the final norm and the LM head (a draft step: the draft head of a
    restricted draft vocabulary)."""
    cfg, layers = model.cfg, model.model.layers
    mtp_layers = [model.mtp_layer(i) for i in range(model.num_mtp_layers)]
    head = size(model.lm_head.weight)
    k = cfg.num_experts_per_tok or 0
    target = row + sum(_layer_size(layer, k, size) for layer in layers[: cfg.num_hidden_layers])
    target += size(model.model.norm.weight) + head
    draft_head = head if model.draft_head is None else size(model.draft_head.weight)
    return target, [row + _layer_size(layer, k, size) + draft_head for layer in mtp_layers]


def routed_bytes(
    routing: Routing, depths: list[int], batch_sizes: list[int], extend_every_row: bool = False
) -> dict[str, int]:
    """By "K/B": the bytes of routed experts a K-step at B reads beyond one row's (as the engine's
    kernels read them): every target MoE layer's union over the verify's B (K + 1) rows, and B rows'
    at each draft step, the draft extend's too, unless its MTP layer runs its experts on every row of
    the extend's block (`extend_every_row`): then B (K + 1) rows' (expert_reads.py)."""

    def beyond_one_row(reader: Reader | None, batch: int, rows: int) -> float:
        if reader is None:
            return 0.0
        each = sum(_read_bytes(p) for p in reader.experts.parameters(recurse=False)) / reader.expert_count()
        return each * (experts_read(reader.chosen, batch, rows) - experts_read(reader.chosen, 1, 1))

    out = {}
    for k in depths:
        for b in batch_sizes:
            extra = sum(beyond_one_row(r, b, k + 1) for r in routing.target)
            if k:
                extra += beyond_one_row(routing.drafts[0], b, k + 1 if extend_every_row else 1)
                extra += sum(beyond_one_row(routing.drafts[j], b, 1) for j in range(1, k))
            out[f"{k}/{b}"] = round(extra)
    return out


def verify_experts(routing: Routing, depths: list[int], batch_sizes: list[int]) -> dict[str, float]:
    """By "K/B": the routed experts a K-step's verify at B reads per target MoE layer, on the mean."""
    if not routing.target:
        return {}
    return {
        f"{k}/{b}": statistics.mean(experts_read(r.chosen, b, k + 1) for r in routing.target)
        for k in depths
        for b in batch_sizes
    }


def weight_bytes(model: CausalLM) -> tuple[int, list[int]]:
    """(bytes one target forward reads, bytes one draft step reads per MTP layer), as the engine's
    kernels read them (after the runs, which made the ops' panels and the graphs' bfloat16 copies):
    a weight's bfloat16 copy's (weight_copies.py), else `library.read_bytes`."""
    return step_sizes(model, _read_bytes, model.model.embed_tokens.weight[0].nbytes)


def _read_bytes(weight: torch.Tensor) -> int:
    return weight_copies.copy_bytes(weight) or library.read_bytes(weight)


def _matrix_flops(weight: torch.Tensor) -> int:
    return 2 * weight.numel() if weight.dim() >= 2 else 0  # a vector (a norm's) only scales


def weight_flops(model: CausalLM) -> tuple[int, list[int], int]:
    """(float operations of one target forward's weights, of one draft step's per MTP layer (its head
    included), of MTP layer 0's parts that a draft extend runs on every row of its block), per row: a
    multiply and an add per matrix element. The embedding row is read, not multiplied."""
    k = model.cfg.num_experts_per_tok or 0
    extend_row = sum(_layer_size(m, k, _matrix_flops) for m in _extend_every_row(model))
    return *step_sizes(model, _matrix_flops, 0), extend_row


def extend_experts_every_row(model: CausalLM) -> bool:
    """Whether a draft extend runs MTP layer 0's routed experts on every row of its block."""
    return any(is_stacked_experts(m) for part in _extend_every_row(model) for m in part.modules())


def _extend_every_row(model: CausalLM) -> list[torch.nn.Module]:
    """MTP layer 0's modules that a draft extend runs on every row of its block (none without MTP)."""
    return model.mtp_every_row_modules(0) if model.num_mtp_layers else []


def copy_bandwidth(device: str, megabytes: int, runs: int = 5) -> float:
    """Bytes per second of the fastest of `runs` copies of a `megabytes` tensor, counting each byte read
    and written (as STREAM's Copy does): what streaming the weights can hope for at best."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def gemm_rate(device: str, dtype: torch.dtype, n: int = 1024, runs: int = 5) -> float:
    """Float operations per second of the fastest of `runs` [n, n] x [n, n] products: what the cores
    reach on arithmetic that reuses every weight n times."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / best_of(runs, device, partial(torch.mm, a, b))


def first_depth_bytes(target: int, mtp: list[int]) -> int:
    """The weight bytes a K=1 step reads: the target's and one draft step's (the warm read's size)."""
    return target + (mtp[0] if mtp else 0)


def resident_bandwidth(device: str, nbytes: int, runs: int = 5) -> float:
    """Bytes per second of the fastest of `runs` reads (a sum) of an `nbytes` tensor read just before:
    what a step that reads `nbytes` of weights at every step can hope for where they fit the cache and
    stay there between steps. Where they do not fit, memory's speed."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    return data.nbytes / best_of(runs, device, data.sum)


def bandwidth_bound(
    target: int,
    mtp: list[int],
    bandwidth: float,
    copy_bytes: int,
    resident: float,
    depths: list[int],
    batch_sizes: list[int],
    routed: dict[str, int] | None = None,
) -> Bound:
    """Depth j drafts with MTP layer j % (number of layers), as the engine does; a K-step at B also reads
    `routed["K/B"]` bytes of routed experts beyond one row's (none where absent). The faster of the
    copy's `bandwidth` and the warm read's (`resident`) bounds every step."""
    routed = routed or {}
    fastest = max(bandwidth, resident)
    steps = {}
    for k in depths:
        read = target + sum(mtp[j % len(mtp)] for j in range(k))
        for b in batch_sizes:
            steps[f"{k}/{b}"] = fastest / (read + routed.get(f"{k}/{b}", 0))
    return Bound(
        copy_bytes, bandwidth, target, mtp, steps, resident_bytes_per_s=resident, routed_bytes=routed
    )


def tile_rate(device: str, dtype: torch.dtype, runs: int = 5) -> tuple[int, float]:
    """(rows from which the C++ ops multiply faster than torch.mm in float32, the float operations per
    second of the fastest of `runs` such products of 16 rows by weights of bfloat16 values, which stay
    in cache): with bfloat16_products on, 1 row and a dense MLP of [512, 1024] weights on the bfloat16
    dot products; else AMX's first row count (panel_amx) and a [512, 1024] weight on the tiles; (0, 0.0)
    where neither runs (no AMX, another device or dtype)."""
    if device != "cpu" or dtype != torch.float32 or not library.load():
        return 0, 0.0
    x, weight = torch.randn(16, 1024), torch.randn(512, 1024).bfloat16().float()
    if library.bfloat16_products():  # as they are: a bench times the engine as it runs
        down = torch.randn(1024, 512).bfloat16().float()
        mlp = partial(torch.ops.compiled_mtp.dense_mlp, x, weight, weight, down)
        return 1, 2 * x.shape[0] * 3 * weight.numel() / best_of(runs, device, mlp)
    rows = torch.ops.compiled_mtp.panel_amx()
    if not rows:
        return 0, 0.0
    product = partial(torch.ops.compiled_mtp.panel_linear, x, weight)
    return rows, 2 * x.shape[0] * weight.numel() / best_of(runs, device, product)


def add_roofline(
    bound: Bound,
    flops: tuple[int, list[int], int],
    rate: float,
    tiles: tuple[int, float],
) -> None:
    """The roofline's steps per second at every (K, B) of the bound: a step reads its bytes (`steps_per_s`) and does
    its weights' multiply-adds at `rate`, or at the tiles' rate for products of `tiles[0]` rows or more,
    so it takes at least the longer of the two. A K-step runs B (K + 1) rows through the target's verify
    and the parts of MTP layer 0 that the draft extend runs on every row (`flops[2]` a row), one row of
    each request through the rest of the extend's layer and its head, then B rows through each of its
    K - 1 draft steps."""
    target, mtp, extend_row = flops
    bound.flops_per_s, bound.target_flops, bound.mtp_step_flops = rate, target, mtp
    bound.extend_row_flops = extend_row
    bound.tile_rows, bound.tile_flops_per_s = tiles

    def seconds(rows: int, operations: int) -> float:
        return operations / (bound.tile_flops_per_s if bound.tile_rows and rows >= bound.tile_rows else rate)

    for key, steps in bound.steps_per_s.items():
        k, b = map(int, key.split("/"))
        rows = b * (k + 1)
        arithmetic = seconds(rows, rows * (target + (extend_row if k else 0)))
        if k:
            arithmetic += seconds(b, b * (mtp[0] - extend_row + sum(mtp[j % len(mtp)] for j in range(1, k))))
        bound.roofline_steps_per_s[key] = min(steps, 1 / arithmetic) if arithmetic else steps


def add_bounds(engine: list[EngineRun], bound: Bound) -> None:
    """Each row's bandwidth bound and roofline, and its speedup over K=0 at its B beside theirs. Auto's
    are the best fixed depth's at its B."""
    for e in engine:
        if isinstance(e.k, int):  # not "auto"
            e.bound_tokens_per_s = e.batch * e.acceptance_length * bound.steps_per_s[f"{e.k}/{e.batch}"]
            e.roofline_tokens_per_s = (
                e.batch * e.acceptance_length * bound.roofline_steps_per_s.get(f"{e.k}/{e.batch}", 0.0)
            )
    for e in engine:
        fixed = [r for r in engine if r.batch == e.batch and r.k != "auto"]
        if e.k == "auto":
            e.bound_tokens_per_s = max(r.bound_tokens_per_s for r in fixed)
            e.roofline_tokens_per_s = max(r.roofline_tokens_per_s for r in fixed)
        base = engine_row(engine, 0, e.batch)
        if base is not None:
            e.speedup = e.decode_tokens_per_s / base.decode_tokens_per_s
            e.bound_speedup = e.bound_tokens_per_s / base.bound_tokens_per_s
            e.bound_fraction = e.speedup / e.bound_speedup
            if base.roofline_tokens_per_s:
                e.roofline_speedup = e.roofline_tokens_per_s / base.roofline_tokens_per_s
