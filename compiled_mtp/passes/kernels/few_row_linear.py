"""`compiled_mtp::few_row_linear`: y = x W^T for 1-4 rows of x on CPU float32, in hand-vectorized C++.

A linear on a few rows should run at the speed of reading its weight. Inductor's multiply-and-sum
(the narrow_linear pass) reads each weight row once, but sums each output of each row in one chain
of dependent vector adds and then across the lanes, so it runs at about half of what the cores can
do. With a 4096 x 768 weight held in cache (2 cores), 1 / 2 / 3 / 4 rows took 0.16 / 0.20 / 0.26 /
0.33 ms as Inductor's code and 0.08 / 0.13 / 0.15 / 0.16 ms here. Read from memory, the 129280 x 768
LM head at 4 rows is compute-bound in Inductor's code whenever the memory is fast; here each vector
of x meets several weight rows, each product has its own accumulator (at least 4 independent chains
of fused multiply-adds), and the weight is prefetched 16 KB ahead into L2, so the memory stays busy
while the cores multiply.

The kernel is compiled once (cpp_build.py: Inductor's C++ toolchain and disk cache); where that
fails, the op warns once and runs `F.linear`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpp_build

MAX_ROWS = 4

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t PREFETCH = 4096;  // floats ahead in the weight row being read

// R rows of x against O weight rows at a time: R * O independent chains of fused multiply-adds, and
// each vector of x loaded once for O weight rows. O is what measured best for each R (at 4 rows
// more accumulators spill).
template <int R, int O>
static void few_rows(const float* x, const float* w, float* out, int64_t n, int64_t k, int64_t threads) {
    const int64_t vk = k - k % Vec::size();
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += O) {
        const float* wo[O];
        for (int o = 0; o < O; o++) wo[o] = w + std::min(j0 + o, n - 1) * k;  // a last partial block rereads row n - 1
        Vec acc[R][O];
        for (int r = 0; r < R; r++) for (int o = 0; o < O; o++) acc[r][o] = Vec(0.f);
        for (int64_t c = 0; c < vk; c += Vec::size()) {
            Vec xs[R];
            for (int r = 0; r < R; r++) xs[r] = Vec::loadu(x + r * k + c);
            for (int o = 0; o < O; o++) {
                __builtin_prefetch(wo[o] + c + PREFETCH, 0, 1);  // never faults, also past the end
                const Vec wv = Vec::loadu(wo[o] + c);
                for (int r = 0; r < R; r++) acc[r][o] = at::vec::fmadd(xs[r], wv, acc[r][o]);
            }
        }
        for (int o = 0; o < O && j0 + o < n; o++) {
            for (int r = 0; r < R; r++) {
                float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][o]);
                for (int64_t c = vk; c < k; c++) sum += x[r * k + c] * wo[o][c];
                out[r * n + j0 + o] = sum;
            }
        }
    }
}

extern "C" void kernel(const float* x, const float* w, float* out, int64_t rows, int64_t n, int64_t k, int64_t threads) {
    switch (rows) {
        case 1: few_rows<1, 4>(x, w, out, n, k, threads); break;
        case 2: few_rows<2, 2>(x, w, out, n, k, threads); break;
        case 3: few_rows<3, 2>(x, w, out, n, k, threads); break;
        case 4: few_rows<4, 1>(x, w, out, n, k, threads); break;
    }
}
"""


@functools.cache
def build() -> Callable[..., None] | None:
    """The compiled kernel (built on the first call in a process, from Inductor's disk cache after the
    first anywhere), or None where it does not build."""
    argtypes = ["const float*", "const float*", "float*", "int64_t", "int64_t", "int64_t", "int64_t"]
    return cpp_build.load("few_row_linear", argtypes, _SOURCE, fallback="F.linear")


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes this call (else the op runs F.linear)."""
    return (
        x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
        and x.dim() == weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and weight.is_contiguous()
    )


# Defined and implemented directly, like routed_experts: a torch.library.custom_op's wrapper costs
# about 25 us a call, this 5 us.
torch.library.define("compiled_mtp::few_row_linear", "(Tensor x, Tensor weight) -> Tensor")


def few_row_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [rows, in] -> x W^T [rows, out]."""
    kernel = build() if supports(x, weight) else None
    if kernel is None:
        return F.linear(x, weight)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    kernel(x, weight, out, x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


torch.library.impl("compiled_mtp::few_row_linear", "CompositeExplicitAutograd", few_row_linear)


@torch.library.register_fake("compiled_mtp::few_row_linear")
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])
