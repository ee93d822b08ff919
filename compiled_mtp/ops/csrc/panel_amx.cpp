// Products of bfloat16 panels (panels.h) on AMX's tile unit, for AMX_MIN_ROWS to 16 rows, and
// compiled_mtp::panel_amx(bool? enabled=None) -> int, which turns them on or off when given `enabled`
// (benchmarks, tests) and returns the fewest rows that run on AMX from then on, 0 where none do.
//
// A tile product multiplies bfloat16 values and adds in float32. The rows are float32, so each is
// split into three bfloat16 parts, x = hi + mid + lo, each the top 16 bits of what the parts before
// left: exact, as every float32 value holds 24 significant bits and each part takes the leading 8 of
// the rest. Each part times a weight is exact in float32, and the three tile products add into the
// same float32 sums: the products are the float32 ones, and only the order of the additions differs
// from the vector path's (the sums agree to float32 rounding; tests/test_ops.py). At 16 rows the
// vector units do 16 multiply-adds for every weight element loaded, more than the machine reads
// weights at; the tile unit does them in a few cycles a tile (benchmarks/README.md, "AMX's tile products").
#include <atomic>
#include <optional>
#include <utility>
#include <cstdlib>
#include <cstring>

#include <ATen/cpu/Utils.h>

#include "panels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define COMPILED_MTP_HAS_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

namespace compiled_mtp {
namespace {

bool amx_usable() {
#if defined(COMPILED_MTP_HAS_AMX)
    const char* env = std::getenv("COMPILED_MTP_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
#if defined(COMPILED_MTP_AMX_MODEL)
    return true;  // the tile instructions in software (amx_tiles.h)
#else
    __builtin_cpu_init();
    // init_amx asks the kernel for the tile state (arch_prctl); it fails where AMX is absent.
    return __builtin_cpu_supports("amx-bf16") && at::cpu::init_amx();
#endif
#else
    return false;
#endif
}

const bool amx_available = amx_usable();
std::atomic<bool> amx_on{amx_available};

#if defined(COMPILED_MTP_HAS_AMX)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")  // lets the tile wrappers (amx_tiles.h) inline here

constexpr int64_t LANES = PANEL_LANES, PARTS = 3, GROUP = 3;  // panels at once: 3 weight and 3 sum tiles
constexpr int64_t PAIR_ROW = 2 * LANES * sizeof(uint16_t);  // bytes of a tile row of weights: each lane's pair of columns
constexpr int64_t BLOCK_BYTES = PANEL_K_BLOCK * LANES * sizeof(uint16_t);  // a tile of weights
// Bytes of each panel prefetched ahead of the tile loads (6 tiles): without it, panels read cold
// took 1.3-1.6x the vector path's time (benchmarks/README.md, "AMX's tile products").
constexpr int64_t AHEAD_BYTES = 6 * BLOCK_BYTES;

// x [rows, k] as its three bfloat16 parts [PARTS][rows][kp], the columns past k zero.
void split(const float* x, int64_t rows, int64_t k, int64_t kp, uint16_t* parts) {
    const __m512i top = _mm512_set1_epi32(0xffff0000u);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < kp; c += 16) {
            const __mmask16 live = c + 16 <= k ? 0xffff : c < k ? static_cast<__mmask16>((1u << (k - c)) - 1) : 0;
            __m512 rest = _mm512_maskz_loadu_ps(live, x + r * k + c);
            for (int64_t part = 0; part < PARTS; part++) {
                const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), top);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + (part * rows + r) * kp + c),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
                rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));
            }
        }
    }
}

void prefetch_ahead(const uint16_t* tile) {
    const char* ahead = reinterpret_cast<const char*>(tile) + AHEAD_BYTES;
    for (int64_t line = 0; line < BLOCK_BYTES; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// Tile T's sums [rows][LANES] out to outputs [col, col + LANES) of every row; a partial last panel
// through `spill`.
template <int T>
void store_sums(int64_t rows, float* out, int64_t n, int64_t col, float* spill) {
    if (col + LANES <= n) return store_tile<T>(out + col, n * sizeof(float));
    store_tile<T>(spill, LANES * sizeof(float));
    for (int64_t r = 0; r < rows; r++) std::memcpy(out + r * n + col, spill + r * LANES, (n - col) * sizeof(float));
}

// G <= GROUP panels from `first` on: tiles 2-4 hold a block of each panel's weights, 5-7 each panel's
// sums, and the rows' parts load into tiles 0 and 1 in turn. Each part meets every panel's weights
// before the next part loads, so consecutive products go to different sums: a product into the sum
// the one before wrote waits for it to finish, and the three parts back to back into one sum left
// the tile unit idle for most of each product.
template <int G>
void group(const uint16_t* parts, int64_t rows, int64_t kp, const uint16_t* first, float* out, int64_t n, int64_t col, float* spill) {
    const int64_t panel = kp * LANES, stride = kp * sizeof(uint16_t);
    [&]<int... g>(std::integer_sequence<int, g...>) {
        (zero_tile<5 + g>(), ...);
        for (int64_t c = 0; c < kp; c += PANEL_K_BLOCK) {
            (prefetch_ahead(first + g * panel + c * LANES), ...);
            (load_tile<2 + g>(first + g * panel + c * LANES, PAIR_ROW), ...);
            load_tile<0>(parts + c, stride);
            (dot<5 + g, 0, 2 + g>(), ...);
            load_tile<1>(parts + rows * kp + c, stride);
            (dot<5 + g, 1, 2 + g>(), ...);
            load_tile<0>(parts + 2 * rows * kp + c, stride);
            (dot<5 + g, 0, 2 + g>(), ...);
        }
        (store_sums<5 + g>(rows, out, n, col + g * LANES, spill), ...);
    }(std::make_integer_sequence<int, G>{});
}

template <int G>
void group_of(int64_t count, const uint16_t* parts, int64_t rows, int64_t kp, const uint16_t* first, float* out, int64_t n, int64_t col, float* spill) {
    if (count == G) group<G>(parts, rows, kp, first, out, n, col, spill);
    else if constexpr (G > 1) group_of<G - 1>(count, parts, rows, kp, first, out, n, col, spill);
}

void tile_run(const float* x, int64_t rows, int64_t k, const uint16_t* panels, int64_t n, float* out, int64_t q0, int64_t q1) {
    const int64_t kp = panel_columns(k);
    thread_local std::vector<uint16_t> parts;
    parts.resize(PARTS * rows * kp);
    split(x, rows, k, kp, parts.data());
    TileConfig config;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t >= 2 && t <= 4 ? PANEL_K_BLOCK / 2 : rows;
        config.colsb[t] = 64;
    }
    load_config(&config);
    float spill[PANEL_MAX_ROWS * LANES];
    for (int64_t p = q0; p < q1; p += GROUP) {
        group_of<GROUP>(std::min(GROUP, q1 - p), parts.data(), rows, kp, panels + p * kp * LANES, out, n, p * LANES, spill);
    }
    release_tiles();  // a thread holding tile state makes every context switch save 8 KB more
}

#pragma GCC pop_options
#endif

int64_t panel_amx(std::optional<bool> enabled) {
    if (enabled.has_value()) amx_on = *enabled && amx_available;
    return amx_on ? AMX_MIN_ROWS : 0;
}

}  // namespace

bool amx_enabled() { return amx_on.load(std::memory_order_relaxed); }

void amx_run(const float* x, int64_t rows, int64_t k, const uint16_t* panels, int64_t n, float* out, int64_t q0, int64_t q1) {
#if defined(COMPILED_MTP_HAS_AMX)
    tile_run(x, rows, k, panels, n, out, q0, q1);
#else
    TORCH_CHECK(false, "panel_linear: this build has no AMX products");
#endif
}

TORCH_LIBRARY_FRAGMENT(compiled_mtp, m) { m.def("panel_amx(bool? enabled=None) -> int", panel_amx); }

}  // namespace compiled_mtp
