// What every kernel here shares: ATen's vector type, the op library's name, and argument checks that
// name the op and the argument.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace compiled_mtp {

using Vec = at::vec::Vectorized<float>;

inline float sum_lanes(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }

// out[i] = the sum of v[i]'s lanes, for each of N vectors: with AVX-512, four of them are added across
// together, in about a third of the instructions that four separate reductions take.
template <int N>
inline void sum_each(const Vec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (N == 4) {
        const __m512 a = v[0], b = v[1], c = v[2], d = v[3];
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                          _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d
        const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
        return;
    }
#endif
    for (int i = 0; i < N; i++) out[i] = sum_lanes(v[i]);
}

// A CPU tensor of `dtype` with `dims` dimensions (contiguous if asked), else an error naming it.
inline void check(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dims, bool contiguous = false) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on CPU, got ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == dims, op, ": ", name, " must have ", dims, " dimensions, got ", t.sizes());
    TORCH_CHECK(!contiguous || t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Every op's registration: its schema (the arguments and results that follow its name), its CPU kernel
// `name` and its Meta shape function `name##_meta`, which Inductor and AOTInductor trace with.
#define COMPILED_MTP_OP(name, signature)                                  \
    TORCH_LIBRARY_FRAGMENT(compiled_mtp, m) { m.def(#name signature); }   \
    TORCH_LIBRARY_IMPL(compiled_mtp, CPU, m) { m.impl(#name, name); }     \
    TORCH_LIBRARY_IMPL(compiled_mtp, Meta, m) { m.impl(#name, name##_meta); }

}  // namespace compiled_mtp
