// Weights read as float32 or widened from bfloat16, and the dot products of a few rows with a few
// weight rows that routed_experts and live_attention's output product share.
#pragma once

#include <c10/util/BFloat16.h>

#include "ops.h"

namespace compiled_mtp {

constexpr int DOT_ROWS = 4;  // input rows multiplied together: 4 rows x 4 weight rows of accumulators
constexpr int O = 4;         // weight rows per dot block
constexpr int64_t DOT_PREFETCH = 2048;  // floats ahead in the weight rows being read

// A vector of weights, from float32 or widened from bfloat16 (its 16 bits are a float32's upper half).
inline Vec load_weights(const float* p) { return Vec::loadu(p); }
inline Vec load_weights(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    float lanes[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); i++) lanes[i] = c10::detail::f32_from_bits(p[i]);
    return Vec::loadu(lanes);
#endif
}
inline float weight_at(const float* p, int64_t c) { return p[c]; }
inline float weight_at(const uint16_t* p, int64_t c) { return c10::detail::f32_from_bits(p[c]); }

// Dot products of R input rows with O = 4 weight rows, length k: sums[r][o]. Each vector of a weight
// row meets all R inputs, so at 4 rows the multiply-adds, not the loads, set the pace; the 4 sums of
// a row are reduced together (sum_each), which costs a third of reducing each on its own.
template <int R, typename W>
inline void dots(const float* const* xr, const W* const* w, int64_t k, float sums[][O]) {
    const int64_t vk = k - k % Vec::size();
    Vec acc[R][O];
    for (int r = 0; r < R; r++) for (int o = 0; o < O; o++) acc[r][o] = Vec(0.f);
    for (int64_t c = 0; c < vk; c += Vec::size()) {
        Vec ws[O];
        for (int o = 0; o < O; o++) {
            __builtin_prefetch(w[o] + c + DOT_PREFETCH, 0, 1);  // never faults, also past the end
            ws[o] = load_weights(w[o] + c);
        }
        for (int r = 0; r < R; r++) {
            const Vec xs = Vec::loadu(xr[r] + c);
            for (int o = 0; o < O; o++) acc[r][o] = at::vec::fmadd(xs, ws[o], acc[r][o]);
        }
    }
    for (int r = 0; r < R; r++) {
        sum_each<O>(acc[r], sums[r]);
        for (int64_t c = vk; c < k; c++) for (int o = 0; o < O; o++) sums[r][o] += xr[r][c] * weight_at(w[o], c);
    }
}

// dots of `rows` <= R rows.
template <int R, typename W>
inline void dots_any(int64_t rows, const float* const* xr, const W* const* w, int64_t k, float sums[][O]) {
    if (rows == R) dots<R>(xr, w, k, sums);
    else if constexpr (R > 1) dots_any<R - 1>(rows, xr, w, k, sums);
}

}  // namespace compiled_mtp
