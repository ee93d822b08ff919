// AMX's tile instructions as panel_amx.cpp uses them, in one of two forms: the instructions
// themselves, or, in a build with COMPILED_MTP_AMX_MODEL defined, a model of them in plain C++ that
// follows each instruction's definition in Intel's manual (palette 1: 8 tiles of up to 16 rows of 64
// bytes, the shapes set by the configuration). The model lets a machine without AMX run the tile path
// end to end, its tile loads, strides, products and stores, so that tests check the path's addressing
// and sums anywhere (tests/test_ops.py); it is not for speed.
#pragma once

#include <cstdint>
#include <cstring>

namespace compiled_mtp {

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

#if defined(COMPILED_MTP_AMX_MODEL)

struct TileState {
    TileConfig config;
    alignas(64) uint8_t data[8][16][64];
};
inline thread_local TileState tile_state;

inline float widen(uint16_t bits) {
    const uint32_t wide = uint32_t{bits} << 16;
    float v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
}

inline void load_config(const TileConfig* config) { tile_state = TileState{*config, {}}; }
inline void release_tiles() { tile_state = TileState{}; }

template <int T>
inline void load_tile(const void* from, int64_t stride) {
    for (int r = 0; r < tile_state.config.rows[T]; r++) {
        std::memcpy(tile_state.data[T][r], static_cast<const uint8_t*>(from) + r * stride, tile_state.config.colsb[T]);
    }
}
template <int T>
inline void store_tile(void* to, int64_t stride) {
    for (int r = 0; r < tile_state.config.rows[T]; r++) {
        std::memcpy(static_cast<uint8_t*>(to) + r * stride, tile_state.data[T][r], tile_state.config.colsb[T]);
    }
}
template <int T>
inline void zero_tile() { std::memset(tile_state.data[T], 0, sizeof tile_state.data[T]); }

// tdpbf16ps, as the manual defines it: for each sum, the even and the odd products of the pairs
// along k add into two float32 sums from zero, whose sum then adds into C (each product of bfloat16
// values is exact in float32, so the manual's multiply-adds are these).
template <int C, int A, int B>
inline void dot() {
    const TileConfig& config = tile_state.config;
    for (int m = 0; m < config.rows[C]; m++) {
        float even[16] = {}, odd[16] = {}, sums[16];
        for (int k = 0; k < config.colsb[A] / 4; k++) {
            uint16_t a[2], b[32];
            std::memcpy(a, tile_state.data[A][m] + 4 * k, sizeof a);
            std::memcpy(b, tile_state.data[B][k], sizeof b);
            for (int n = 0; n < config.colsb[C] / 4; n++) {
                even[n] += widen(a[0]) * widen(b[2 * n]);
                odd[n] += widen(a[1]) * widen(b[2 * n + 1]);
            }
        }
        std::memcpy(sums, tile_state.data[C][m], sizeof sums);
        for (int n = 0; n < config.colsb[C] / 4; n++) sums[n] += even[n] + odd[n];
        std::memcpy(tile_state.data[C][m], sums, sizeof sums);
    }
}

#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// The instructions with their tile numbers as template arguments (the intrinsics' macros paste the
// number into the instruction's text, so they take only literals).
inline void load_config(const TileConfig* config) { _tile_loadconfig(config); }
inline void release_tiles() { _tile_release(); }
template <int T>
inline void load_tile(const void* from, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(from), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void store_tile(void* to, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(to), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void zero_tile() { __asm__ volatile("tilezero %%tmm%c0" ::"i"(T)); }
template <int C, int A, int B>
inline void dot() { __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
#pragma GCC pop_options

#endif

}  // namespace compiled_mtp
