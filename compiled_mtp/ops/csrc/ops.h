// What every kernel here shares: ATen's vector type, the op library's name, and argument checks that
// name the op and the argument.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace compiled_mtp {

using Vec = at::vec::Vectorized<float>;

inline float sum_lanes(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }

// A CPU tensor of `dtype` with `dims` dimensions (contiguous if asked), else an error naming it.
inline void check(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dims, bool contiguous = false) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == dims, op, ": ", name, " must have ", dims, " dimensions, got ", t.sizes());
    TORCH_CHECK(!contiguous || t.is_contiguous(), op, ": ", name, " must be contiguous");
}

}  // namespace compiled_mtp
