"""`compiled_mtp::routed_experts`: the routed experts of a MoE layer on CPU float32, each chosen
expert's weights read once for every row routed to it.

The model's fixed-shape MoE gathers each row's k experts and runs one product per (row, expert), so a
verify of 4 rows reads an expert once for each row that chose it, and the four rows of a verify
often share experts. Here the rows are grouped by expert first: each chosen expert's gate and up
weights are read once, in blocks that every row routed to it multiplies while the block is in cache,
and then each block of the down projection is read once for all of its rows. A product has its own
accumulators (independent chains of fused multiply-adds, as in few_row_linear.py).

The kernel is built with Inductor's C++ toolchain (cpp_build.py); where that fails, the op warns
once and runs the model's own gathered products.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ...models.deepseek_v3 import gathered_experts
from . import cpp_build

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t MAX_ROWS = 4;  // rows multiplied together: 4 x 2 accumulators fit the registers
constexpr int64_t GATE_BLOCK = 64;  // rows of an expert's gate and up weights per work item
constexpr int64_t DOWN_BLOCK = 64;  // rows of the down weights (outputs) per work item
constexpr int64_t PREFETCH = 2048;  // floats ahead in the weight rows being read

// Dot products of R input rows with 2 weight rows, length k: sums[r][o].
template <int R>
static inline void dots(const float* const* xr, const float* const* w, int64_t k, float sums[][2]) {
    const int64_t vk = k - k % Vec::size();
    Vec acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t c = 0; c < vk; c += Vec::size()) {
        __builtin_prefetch(w[0] + c + PREFETCH, 0, 1);  // never faults, also past the end
        const Vec a = Vec::loadu(w[0] + c);
        __builtin_prefetch(w[1] + c + PREFETCH, 0, 1);
        const Vec b = Vec::loadu(w[1] + c);
        for (int r = 0; r < R; r++) {
            const Vec xs = Vec::loadu(xr[r] + c);
            acc[r][0] = at::vec::fmadd(xs, a, acc[r][0]);
            acc[r][1] = at::vec::fmadd(xs, b, acc[r][1]);
        }
    }
    auto add = [](Vec& p, Vec& q) { return p + q; };
    for (int r = 0; r < R; r++) {
        float s0 = at::vec::vec_reduce_all<float>(add, acc[r][0]), s1 = at::vec::vec_reduce_all<float>(add, acc[r][1]);
        for (int64_t c = vk; c < k; c++) { s0 += xr[r][c] * w[0][c]; s1 += xr[r][c] * w[1][c]; }
        sums[r][0] = s0; sums[r][1] = s1;
    }
}

template <int R>
static void dots_any(int64_t rows, const float* const* xr, const float* const* w, int64_t k, float sums[][2]) {
    if (rows == R) dots<R>(xr, w, k, sums);
    else if constexpr (R > 1) dots_any<R - 1>(rows, xr, w, k, sums);
}

// x [n, h], idx / weight [n, k], gate / up [e, inter, h], down [e, h, inter] -> out [n, h]
extern "C" void kernel(const float* x, const int64_t* idx, const float* weight, const float* gate, const float* up,
                       const float* down, float* out, int64_t n, int64_t k, int64_t e, int64_t h, int64_t inter,
                       int64_t threads) {
    // The (row, slot) pairs routed to each expert, grouped by expert.
    std::vector<std::vector<int64_t>> pairs(e);
    for (int64_t p = 0; p < n * k; p++) pairs[idx[p]].push_back(p);
    std::vector<int64_t> used;
    for (int64_t j = 0; j < e; j++) if (!pairs[j].empty()) used.push_back(j);
    std::vector<float> act(n * k * inter);  // silu(x gate^T) * (x up^T) per (row, slot)
    const int64_t gate_blocks = (inter + GATE_BLOCK - 1) / GATE_BLOCK;
    const int64_t items = static_cast<int64_t>(used.size()) * gate_blocks;
    // Static schedules: each thread reads one contiguous run of the chosen experts' weights; handing
    // out blocks in turn (dynamic) made both threads read interleaved blocks, 5.1 ms instead of 4.0 for
    // the 250m preset's 7 layers at 4 rows when the memory was fast.
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t ex = used[item / gate_blocks], i0 = (item % gate_blocks) * GATE_BLOCK;
            const std::vector<int64_t>& ps = pairs[ex];
            for (size_t p0 = 0; p0 < ps.size(); p0 += MAX_ROWS) {
                const int64_t rows = std::min<int64_t>(MAX_ROWS, ps.size() - p0);
                const float* xr[MAX_ROWS];
                for (int64_t r = 0; r < rows; r++) xr[r] = x + ps[p0 + r] / k * h;
                for (int64_t i = i0; i < std::min(i0 + GATE_BLOCK, inter); i++) {
                    const float* w[2] = {gate + (ex * inter + i) * h, up + (ex * inter + i) * h};
                    float s[MAX_ROWS][2];
                    dots_any<MAX_ROWS>(rows, xr, w, h, s);
                    for (int64_t r = 0; r < rows; r++) act[ps[p0 + r] * inter + i] = s[r][0] / (1.f + std::exp(-s[r][0])) * s[r][1];
                }
            }
        }
        #pragma omp for schedule(static)
        for (int64_t j0 = 0; j0 < h; j0 += DOWN_BLOCK) {
            const int64_t j1 = std::min(j0 + DOWN_BLOCK, h);
            for (int64_t t = 0; t < n; t++) std::fill(out + t * h + j0, out + t * h + j1, 0.f);
            for (int64_t ex : used) {
                const std::vector<int64_t>& ps = pairs[ex];
                for (size_t p0 = 0; p0 < ps.size(); p0 += MAX_ROWS) {
                    const int64_t rows = std::min<int64_t>(MAX_ROWS, ps.size() - p0);
                    const float* ar[MAX_ROWS];
                    for (int64_t r = 0; r < rows; r++) ar[r] = act.data() + ps[p0 + r] * inter;
                    for (int64_t j = j0; j < j1; j += 2) {
                        const int64_t j2 = std::min(j + 1, j1 - 1);  // an odd last row is computed twice, stored once
                        const float* w[2] = {down + (ex * h + j) * inter, down + (ex * h + j2) * inter};
                        float s[MAX_ROWS][2];
                        dots_any<MAX_ROWS>(rows, ar, w, inter, s);
                        for (int64_t r = 0; r < rows; r++) {
                            const int64_t p = ps[p0 + r];
                            out[p / k * h + j] += weight[p] * s[r][0];
                            if (j2 != j) out[p / k * h + j2] += weight[p] * s[r][1];
                        }
                    }
                }
            }
        }
    }
}
"""

_ARGTYPES = ["const float*", "const int64_t*", "const float*", "const float*", "const float*", "const float*", "float*"] + ["int64_t"] * 6


@functools.cache
def build() -> Callable[..., None] | None:
    """The compiled kernel (built on the first call in a process), or None where it does not build."""
    return cpp_build.load("routed_experts", _ARGTYPES, _SOURCE, fallback="the gathered products")


def supports(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> bool:
    """Whether the kernel takes this call (else the op runs the gathered products)."""
    floats = (x, weights, gate, up, down)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in floats) and idx.device.type == "cpu"
        and idx.dtype == torch.int64 and all(t.is_contiguous() for t in (gate, up, down))
        and x.dim() == idx.dim() == weights.dim() == 2 and idx.shape == weights.shape and idx.shape[0] == x.shape[0]
    )


# Defined and implemented directly rather than as a torch.library.custom_op, whose wrapper costs about
# 25 us a call (5 us here): the op runs once per MoE layer of every step.
torch.library.define(
    "compiled_mtp::routed_experts", "(Tensor x, Tensor idx, Tensor weights, Tensor gate, Tensor up, Tensor down) -> Tensor"
)


def routed_experts(x: Tensor, idx: Tensor, weights: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """x [N, H], experts idx [N, k] with weights [N, k], gate / up [E, I, H], down [E, H, I] -> [N, H]."""
    kernel = build() if supports(x, idx, weights, gate, up, down) else None
    if kernel is None:
        return gathered_experts(x, idx, weights, gate, up, down)
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.contiguous()
    out = x.new_empty(x.shape)
    n, k = idx.shape
    kernel(x, idx, weights, gate, up, down, out, n, k, gate.shape[0], x.shape[1], gate.shape[1], torch.get_num_threads())
    return out


torch.library.impl("compiled_mtp::routed_experts", "CompositeExplicitAutograd", routed_experts)


@torch.library.register_fake("compiled_mtp::routed_experts")
def _(x, idx, weights, gate, up, down):
    return x.new_empty(x.shape)
