// compiled_mtp::panel_linear(x [rows, in], weight [out, in]) -> x W^T [rows, out], rows 1..16, float32,
// from the weight's panels (panels.h), and the panels' copies and product that dense_mlp shares.
#include <c10/core/StorageImpl.h>

#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>

#include "huge_pages.h"
#include "panels.h"

namespace compiled_mtp {
namespace {
constexpr int64_t LANES = PANEL_LANES;
constexpr int64_t PANELS = 3;  // panels a thread works on at once: a row block x 3 accumulators, 3 weight vectors
// Up to 3 rows take 6 panels at once with AVX-512, so each panel vector widened from bfloat16 and each
// broadcast input serve twice the multiply-adds (benchmarks/README.md, "Six panels"). 4 rows (a verify
// of K = 3 at B = 1) take 4: with 6, both columns of every panel no longer fit beside the 24 sums and
// were loaded a panel at a time, and one MLP took 1.06-1.11x the time of 4 panels cold; with 5, 1.04x
// (the MLP's runs of 32 and 8 panels a thread are whole groups of 4; "Four panels at 4 rows").
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t FEW_ROWS = 3, FEW_ROW_PANELS = 6, FOUR_ROW_PANELS = 4;
constexpr int VECTOR_REGISTERS = 32;
#else
constexpr int VECTOR_REGISTERS = 16;
constexpr int64_t FEW_ROWS = 0, FEW_ROW_PANELS = PANELS, FOUR_ROW_PANELS = PANELS;
#endif
// Bytes of each panel prefetched ahead (96 steps along `in` of float32): with the hardware's prefetch
// alone, a cold MLP at 4-16 rows took 1.05-1.2x the time, in turns (benchmarks/README.md).
constexpr int64_t AHEAD_BYTES = 96 * LANES * sizeof(float);
// Prefetches panel p of a group of P, whose columns lie `stride` apart, `ahead` columns after column
// c. From 2 rows on, past the panel's end at the same place in the next group's panel p, which the
// thread reads after this group (a thread's last group prefetches the next thread's first; a
// prefetch never faults): straight on, the address fell in the group's next panel, already being
// read, and each group began cold, so that a cold MLP at 4-16 rows took 1.1-1.3x the time. One row
// prefetches straight on, as before: wrapped, its MLP took 1.09x the time with the weights in cache,
// and with no prefetch a K=0 step at B=1 took 1.04-1.07x (benchmarks/README.md, "Prefetches that
// wrap into the next group").
template <int R, int P, typename W>
inline void prefetch_ahead(const W* group, int64_t p, int64_t stride, int64_t c, int64_t ahead) {
    const int64_t at = c + ahead;
    const int64_t skip = R >= 2 && at >= stride ? (P - 1) * stride : 0;
    __builtin_prefetch(group + (p * stride + at + skip) * LANES, 0, 1);
}
// Panels of at most this many bytes are multiplied on the calling thread alone: on the shipped model's
// kv_a and q_b projections (40 and 48 KB of bfloat16 panels) opening a parallel region cost more than
// the second core saved, at 4 to 16 rows (benchmarks/README.md, "Small products on one thread").
constexpr int64_t SERIAL_BYTES = 48 << 10;

struct Panels {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // the weight's: a freed weight never matches
    int64_t offset;
    uint32_t version;  // its version counter when copied: an in-place update makes a new copy
    at::Tensor packed;
};

std::mutex lock;
std::unordered_map<const void*, Panels> copies;  // the weight's address -> its panels

uint32_t version_of(const at::Tensor& w) {
    return w.is_inference() ? 0 : w.unsafeGetTensorImpl()->version_counter().current_version();
}

bool matches(const Panels& p, const at::Tensor& w) {
    const auto storage = p.storage.lock();
    return storage.get() == w.storage().unsafeGetStorageImpl() && p.offset == w.storage_offset() &&
           p.version == version_of(w) && p.packed.size(0) == (w.size(0) + LANES - 1) / LANES &&
           p.packed.size(1) == (p.packed.scalar_type() == at::kFloat ? w.size(1) : panel_columns(w.size(1)));
}

// Whether every element of `w` is a bfloat16 value: its low 16 bits are all zero.
bool bfloat16_exact(const at::Tensor& w) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(w.data_ptr<float>());
    for (int64_t i = 0; i < w.numel(); i++) {
        if (bits[i] & 0xffffu) return false;
    }
    return true;
}

// float32 panels: [panels][k][LANES]. bfloat16 panels: [panels][k padded][LANES][2], each lane's pair
// of columns side by side (the layout AMX's tile products read, panels.h), the padding zeros.
template <typename W>
void pack_into(const float* src, W* dst, int64_t n, int64_t k) {
    const int64_t stride = std::is_same_v<W, float> ? k : panel_columns(k);
    at::parallel_for(0, (n + LANES - 1) / LANES, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; p++) {
            for (int64_t c = 0; c < k; c++) {
                for (int64_t lane = 0; lane < LANES && p * LANES + lane < n; lane++) {
                    const float v = src[(p * LANES + lane) * k + c];
                    if constexpr (std::is_same_v<W, float>) {
                        dst[(p * k + c) * LANES + lane] = v;
                    } else {
                        dst[(p * stride + (c & ~int64_t{1})) * LANES + 2 * lane + (c & 1)] = static_cast<W>(c10::bit_cast<uint32_t>(v) >> 16);
                    }
                }
            }
        }
    });
}

at::Tensor pack(const at::Tensor& w) {
    const int64_t n = w.size(0), k = w.size(1), panels = (n + LANES - 1) / LANES;
    const bool half = bfloat16_exact(w);
    const at::ScalarType type = half ? at::kBFloat16 : at::kFloat;
    const int64_t columns = half ? panel_columns(k) : k;
    at::Tensor packed = huge_page_bytes(panels * columns * LANES * at::elementSize(type)).view(type).view({panels, columns, LANES}).zero_();
    if (half) {
        pack_into(w.data_ptr<float>(), reinterpret_cast<uint16_t*>(packed.data_ptr()), n, k);
    } else {
        pack_into(w.data_ptr<float>(), packed.data_ptr<float>(), n, k);
    }
    return packed;
}

// Elements between one row and the next: float32 rows are packed, bfloat16 ones padded as the panels.
inline int64_t row_stride(const float*, int64_t k) { return k; }
inline int64_t row_stride(const uint16_t*, int64_t k) { return panel_columns(k); }

// One vector of a float32 panel.
inline Vec load_lanes(const float* p) { return Vec::loadu(p); }

// Two vectors of a bfloat16 panel, columns c and c + 1 (pairs[0] and pairs[1]), widened to float32 by
// a shift and a mask, which is exact.
inline void load_pairs(const uint16_t* p, Vec* pairs) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i bits = _mm512_loadu_si512(p);
    pairs[0] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    pairs[1] = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0xffff0000u)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    pairs[0] = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    pairs[1] = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xffff0000u)));
#else
    float lanes[2][LANES];
    for (int64_t i = 0; i < LANES; i++) {
        for (int j = 0; j < 2; j++) lanes[j][i] = c10::detail::f32_from_bits(p[2 * i + j]);
    }
    pairs[0] = Vec::loadu(lanes[0]);
    pairs[1] = Vec::loadu(lanes[1]);
#endif
}

template <int R, int P>
void store_block(Vec (&acc)[R][P], float* out, int64_t n, int64_t col) {
    for (int r = 0; r < R; r++) {
        for (int p = 0; p < P; p++) {
            const int64_t j = col + p * LANES;
            acc[r][p].store(out + r * n + j, static_cast<int>(std::min(LANES, n - j)));
        }
    }
}

// R rows against P float32 panels from output `col` on: R x P sums stay in registers.
template <int R, int P>
void block(const float* x, const float* panels, float* out, int64_t k, int64_t n, int64_t col) {
    constexpr int64_t ahead = AHEAD_BYTES / (LANES * sizeof(float));
    Vec acc[R][P];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = Vec(0.f);
    for (int64_t c = 0; c < k; c++) {
        Vec w[P];
        for (int p = 0; p < P; p++) {
            prefetch_ahead<R, P>(panels, p, k, c, ahead);
            w[p] = load_lanes(panels + (p * k + c) * LANES);
        }
        for (int r = 0; r < R; r++) {
            const Vec xr(x[r * k + c]);
            for (int p = 0; p < P; p++) acc[r][p] = at::vec::fmadd(xr, w[p], acc[r][p]);
        }
    }
    store_block(acc, out, n, col);
}

// One step of the block below: columns c and, if BOTH, c + 1 of P bfloat16 panels into R x P sums.
// Where the sums and both columns of every panel fit the registers, each broadcast input serves all P
// panels; else (AVX2's 16 registers at 4 rows x 3 panels) one panel's columns at a time.
template <int R, int P, bool BOTH>
inline void pair_step(const float* x, const uint16_t* panels, int64_t k, int64_t stride, int64_t c, Vec (&acc)[R][P]) {
    constexpr int64_t ahead = AHEAD_BYTES / (LANES * sizeof(uint16_t));
    constexpr int held = R * P + 2 * P + 1 <= VECTOR_REGISTERS ? P : 1;  // panels whose columns are loaded together
    for (int p0 = 0; p0 < P; p0 += held) {
        Vec w[held][2];
        for (int p = 0; p < held; p++) {
            prefetch_ahead<R, P>(panels, p0 + p, stride, c, ahead);
            load_pairs(panels + ((p0 + p) * stride + c) * LANES, w[p]);
        }
        for (int r = 0; r < R; r++) {
            const Vec even(x[r * k + c]);
            for (int p = 0; p < held; p++) acc[r][p0 + p] = at::vec::fmadd(even, w[p][0], acc[r][p0 + p]);
            if constexpr (BOTH) {
                const Vec odd(x[r * k + c + 1]);
                for (int p = 0; p < held; p++) acc[r][p0 + p] = at::vec::fmadd(odd, w[p][1], acc[r][p0 + p]);
            }
        }
    }
}

// The same against bfloat16 panels, two columns a load: each sum adds column c, then c + 1, as above.
template <int R, int P>
void block(const float* x, const uint16_t* panels, float* out, int64_t k, int64_t n, int64_t col) {
    const int64_t stride = panel_columns(k);
    Vec acc[R][P];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = Vec(0.f);
    for (int64_t c = 0; c + 1 < k; c += 2) pair_step<R, P, true>(x, panels, k, stride, c, acc);
    if (k % 2) pair_step<R, P, false>(x, panels, k, stride, k - 1, acc);
    store_block(acc, out, n, col);
}

#if defined(COMPILED_MTP_HAS_BF16_DOT)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// The same with rows rounded to bfloat16 (round_rows), on AVX-512's bfloat16 dot products: one
// instruction multiplies a lane's pair of columns by the row's pair and adds both products to the sum,
// where the float32 path widens the pair and runs two multiply-adds. Each sum adds the pairs in order
// whatever the rows and panels around it, so a row's outputs do not depend on the rows beside it.
template <int R, int P>
void block(const uint16_t* x, const uint16_t* panels, float* out, int64_t k, int64_t n, int64_t col) {
    constexpr int64_t ahead = AHEAD_BYTES / (LANES * sizeof(uint16_t));
    const int64_t stride = panel_columns(k);
    Vec acc[R][P];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = Vec(0.f);
    for (int64_t c = 0; c < k; c += 2) {
        __m512bh w[P];
        for (int p = 0; p < P; p++) {
            prefetch_ahead<R, P>(panels, p, stride, c, ahead);
            w[p] = (__m512bh)_mm512_loadu_si512(panels + (p * stride + c) * LANES);
        }
        for (int r = 0; r < R; r++) {
            int32_t both;
            std::memcpy(&both, x + r * stride + c, sizeof(both));
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(both);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], w[p], xr);
        }
    }
    store_block(acc, out, n, col);
}

// from[c0, c1) rounded to the nearest even bfloat16 into to[c0, c1), 16 at a time: where it stopped.
int64_t round_vectors(const float* from, uint16_t* to, int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(from + c)));
    }
    return c;
}
#pragma GCC pop_options
#endif

// Rows [0, count) of a block, count <= R, against P panels.
template <int R, int P, typename X, typename W>
void block_of(int64_t count, const X* x, const W* panels, float* out, int64_t k, int64_t n, int64_t col) {
    if (count == R) block<R, P>(x, panels, out, k, n, col);
    else if constexpr (R > 1) block_of<R - 1, P>(count, x, panels, out, k, n, col);
}

// Every row, BLOCK at a time, against P panels.
template <int P, int BLOCK, typename X, typename W>
void rows_against(const X* x, int64_t rows, const W* panels, float* out, int64_t k, int64_t n, int64_t col) {
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        block_of<BLOCK, P>(std::min<int64_t>(BLOCK, rows - r0), x + r0 * row_stride(x, k), panels, out + r0 * n, k, n, col);
    }
}

// `count` panels (count <= P) from output `col` on, against every row.
template <int P, int BLOCK, typename X, typename W>
void group_against(int64_t count, const X* x, int64_t rows, const W* group, float* out, int64_t k, int64_t n, int64_t col) {
    if (count == P) rows_against<P, BLOCK>(x, rows, group, out, k, n, col);
    else if constexpr (P > 1) group_against<P - 1, BLOCK>(count, x, rows, group, out, k, n, col);
}

template <int P, int BLOCK, typename X, typename W>
void run_groups(const X* x, int64_t rows, int64_t k, const W* panels, int64_t n, float* out, int64_t q0, int64_t q1) {
    const int64_t stride = std::is_same_v<W, float> ? k : panel_columns(k);
    for (int64_t p0 = q0; p0 < q1; p0 += P) {
        group_against<P, BLOCK>(std::min<int64_t>(P, q1 - p0), x, rows, panels + p0 * stride * LANES, out, k, n, p0 * LANES);
    }
}

template <typename X, typename W>
void run_panels(const X* x, int64_t rows, int64_t k, const W* panels, int64_t n, float* out, int64_t q0, int64_t q1) {
    if constexpr (FEW_ROWS > 0) {
        if (rows <= FEW_ROWS) return run_groups<FEW_ROW_PANELS, FEW_ROWS>(x, rows, k, panels, n, out, q0, q1);
        if (rows == 4) return run_groups<FOUR_ROW_PANELS, 4>(x, rows, k, panels, n, out, q0, q1);
    }
    run_groups<PANELS, PANEL_ROW_BLOCK>(x, rows, k, panels, n, out, q0, q1);
}

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& weight) {
    check(x_in, "panel_linear", "x", at::kFloat, 2);
    check(weight, "panel_linear", "weight", at::kFloat, 2, true);
    const int64_t rows = x_in.size(0), n = weight.size(0), k = weight.size(1);
    TORCH_CHECK(rows >= 1 && rows <= PANEL_MAX_ROWS, "panel_linear: x must have 1 to ", PANEL_MAX_ROWS, " rows, got ", rows);
    TORCH_CHECK(x_in.size(1) == k, "panel_linear: x has ", x_in.size(1), " columns, weight ", k);
    const at::Tensor x = x_in.contiguous(), panels = panels_of(weight);
    at::Tensor out = at::empty({rows, n}, x.options());
    panel_product(x.data_ptr<float>(), rows, k, panels, n, out.data_ptr<float>());
    return out;
}

at::Tensor panel_linear_meta(const at::Tensor& x, const at::Tensor& weight) {
    return at::empty({x.size(0), weight.size(0)}, x.options());
}

}  // namespace

at::Tensor panels_of(const at::Tensor& w) {
    std::lock_guard<std::mutex> guard(lock);
    const auto found = copies.find(w.data_ptr());
    if (found != copies.end() && matches(found->second, w)) return found->second.packed;
    for (auto it = copies.begin(); it != copies.end();) it = it->second.storage.expired() ? copies.erase(it) : std::next(it);
    Panels entry{w.storage().getWeakStorageImpl(), w.storage_offset(), version_of(w), pack(w)};
    return copies.insert_or_assign(w.data_ptr(), std::move(entry)).first->second.packed;
}

#if defined(COMPILED_MTP_HAS_BF16_DOT)
namespace {
const bool bf16_dot_available = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
std::atomic<bool> bf16_on{false};
}  // namespace

bool bfloat16_products() { return bf16_on.load(std::memory_order_relaxed); }

// compiled_mtp::bfloat16_products(bool? enabled=None) -> bool: turns the rounding on or off when given
// `enabled` (on only where the machine has the dot products), and returns whether it is on.
bool bfloat16_products_switch(std::optional<bool> enabled) {
    if (enabled.has_value()) bf16_on = *enabled && bf16_dot_available;
    return bfloat16_products();
}
#else
bool bfloat16_products() { return false; }
bool bfloat16_products_switch(std::optional<bool>) { return false; }
#endif

void round_rows(const float* x, int64_t rows, int64_t k, int64_t c0, int64_t c1, uint16_t* out) {
    const int64_t stride = panel_columns(k);
    for (int64_t r = 0; r < rows; r++) {
        const float* from = x + r * k;
        uint16_t* to = out + r * stride;
        int64_t c = c0;
#if defined(COMPILED_MTP_HAS_BF16_DOT)
        c = round_vectors(from, to, c0, c1);
#endif
        for (; c < c1; c++) to[c] = c10::BFloat16(from[c]).x;  // to nearest even
        if (c1 == k) std::fill(to + k, to + stride, uint16_t{0});
    }
}

at::Tensor rounded_rows(const float* x, int64_t rows, int64_t k, const at::Tensor& panels) {
    if (panels.scalar_type() != at::kBFloat16 || !bfloat16_products()) return {};
    at::Tensor out = at::empty({rows, panel_columns(k)}, at::kBFloat16);
    round_rows(x, rows, k, 0, k, reinterpret_cast<uint16_t*>(out.data_ptr()));
    return out;
}

void panel_run(const float* x, const uint16_t* rounded, int64_t rows, int64_t k, const at::Tensor& panels, int64_t n, float* out, int64_t q0, int64_t q1) {
    if (panels.scalar_type() == at::kBFloat16) {
        const uint16_t* half = reinterpret_cast<const uint16_t*>(panels.data_ptr());
#if defined(COMPILED_MTP_HAS_BF16_DOT)
        // Rounded rows never go to the tiles, whose exact products would give 8 rows other sums than 4.
        if (rounded != nullptr) return run_panels(rounded, rows, k, half, n, out, q0, q1);
#endif
        if (rows >= AMX_MIN_ROWS && amx_enabled()) return amx_run(x, rows, k, half, n, out, q0, q1);
        run_panels(x, rows, k, half, n, out, q0, q1);
    } else {
        run_panels(x, rows, k, panels.data_ptr<float>(), n, out, q0, q1);
    }
}

void panel_product(const float* x, int64_t rows, int64_t k, const at::Tensor& panels, int64_t n, float* out) {
    const int64_t count = (n + LANES - 1) / LANES;
    if (panels.nbytes() <= SERIAL_BYTES) return panel_run(x, nullptr, rows, k, panels, n, out, 0, count);
    // Each thread takes an equal run of panels and works through it PANELS at a time: handing out
    // whole groups of PANELS left a thread idle for a third of a 128-output linear (8 panels).
    at::parallel_for(0, count, 1, [&](int64_t q0, int64_t q1) { panel_run(x, nullptr, rows, k, panels, n, out, q0, q1); });
}

// compiled_mtp::panel_bytes(weight): the bytes of the panels the ops read in place of `weight`, or 0 if
// none has read it yet; what a step reads for the weight (the bandwidth bound counts them).
int64_t panel_bytes(const at::Tensor& w) {
    std::lock_guard<std::mutex> guard(lock);
    const auto found = copies.find(w.data_ptr());
    return found != copies.end() && matches(found->second, w) ? static_cast<int64_t>(found->second.packed.nbytes()) : 0;
}

COMPILED_MTP_OP(panel_linear, "(Tensor x, Tensor weight) -> Tensor")
TORCH_LIBRARY_FRAGMENT(compiled_mtp, m) {
    m.def("panel_bytes(Tensor weight) -> int");
    m.def("bfloat16_products(bool? enabled=None) -> bool", bfloat16_products_switch);
}
TORCH_LIBRARY_IMPL(compiled_mtp, CPU, m) { m.impl("panel_bytes", panel_bytes); }

}  // namespace compiled_mtp
