// Weights copied once into panels of one vector's width of outputs, and the products that read them
// (panel_linear.cpp; dense_mlp in routed_experts.cpp on up to 16 rows). A weight [out, in] becomes
// [ceil(out / PANEL_LANES)][in][PANEL_LANES]: each step along `in` loads one vector of a panel and
// multiplies it by a broadcast element of each row, so every output lane keeps its own sum and
// nothing is reduced across lanes (see docs/passes.md, panel_linear). A weight whose every element is
// a bfloat16 value (a bfloat16 checkpoint's, upcast) is copied as bfloat16: half the bytes to read,
// and widened back on load to the same float32 values, so every product is bit for bit the same.
// Its panels keep each lane's columns in pairs, [panels][in padded][PANEL_LANES][2], so that one load
// widens to two columns, and AMX's tile products (panel_amx.cpp) read them as they are.
#pragma once

#include "ops.h"

namespace compiled_mtp {

constexpr int64_t PANEL_LANES = Vec::size();
// Rows whose sums stay in registers: a block's rows x 3 panels of sums, 3 weight vectors and an input
// must fit the vector registers, 32 with AVX-512 and 16 with AVX2, where blocks of 8 rows spilled
// (with AVX-512, up to 3 rows take 6 panels at once and 4 rows take 4, panel_linear.cpp).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t PANEL_ROW_BLOCK = 8;
#else
constexpr int64_t PANEL_ROW_BLOCK = 4;
#endif
constexpr int64_t PANEL_MAX_ROWS = 16;
// The columns of bfloat16 panels: `in` padded with zeros to whole blocks of an AMX tile product.
constexpr int64_t PANEL_K_BLOCK = 32;
inline int64_t panel_columns(int64_t k) { return (k + PANEL_K_BLOCK - 1) / PANEL_K_BLOCK * PANEL_K_BLOCK; }
// Rows from which products of bfloat16 panels run on AMX's tiles where the machine has them: on 4 rows
// the tiles took 1.09x the vector path's time in the graphs (benchmarks/README.md, "AMX's tile products").
constexpr int64_t AMX_MIN_ROWS = 8;

// The panels of `weight` (contiguous float32 [out, in]; float32 or bfloat16, see above), made on its
// first use and kept beside it; made again after an in-place update, and never served for a freed
// weight at the same address.
at::Tensor panels_of(const at::Tensor& weight);

// AVX-512's bfloat16 dot products, where the compiler has them; whether the machine does is asked at run time.
#if defined(CPU_CAPABILITY_AVX512) && (defined(__clang__) || __GNUC__ >= 10)
#define COMPILED_MTP_HAS_BF16_DOT 1
#endif

// Whether dense_mlp rounds its rows and its activation to bfloat16 and multiplies them by bfloat16
// panels on the bfloat16 dot products, adding in float32: off until compiled_mtp::bfloat16_products
// (True) turns it on, which it does only where the machine has them. Asked once a call, so the same
// graphs serve both. A process switch of its own, not torch's float32 precision for oneDNN: that
// one also makes oneDNN's packed float32 products (a prefill's) round, 1.09x the prefill's time here.
// panel_linear never rounds: narrow_linear leaves its smaller weights to Inductor's float32 code on
// one row, and a row must get the same products at every depth (docs/passes.md).
bool bfloat16_products();

// Columns [c0, c1) of rows x [rows, k] rounded to the nearest bfloat16, into [rows][panel_columns(k)];
// the padding past k zeroed once c1 reaches k.
void round_rows(const float* x, int64_t rows, int64_t k, int64_t c0, int64_t c1, uint16_t* out);

// round_rows of every column where `panels` are bfloat16 and bfloat16_products(); else undefined.
at::Tensor rounded_rows(const float* x, int64_t rows, int64_t k, const at::Tensor& panels);

// Panels [q0, q1) of out [rows, n] = x [rows, k] W^T, on the calling thread; from `rounded` (x rounded
// by round_rows) on the bfloat16 dot products where it is given and the panels are bfloat16.
void panel_run(const float* x, const uint16_t* rounded, int64_t rows, int64_t k, const at::Tensor& panels, int64_t n, float* out, int64_t q0, int64_t q1);

// Whether products of AMX_MIN_ROWS rows or more run on AMX (panel_amx.cpp): the machine has it, the
// process may use it, and neither COMPILED_MTP_AMX=0 nor compiled_mtp::panel_amx(False) turned it off.
bool amx_enabled();

// panel_run on AMX's tiles, for bfloat16 panels.
void amx_run(const float* x, int64_t rows, int64_t k, const uint16_t* panels, int64_t n, float* out, int64_t q0, int64_t q1);

// out [rows, n] = x [rows, k] W^T, reading W's panels (panels_of), on at::parallel_for's threads.
void panel_product(const float* x, int64_t rows, int64_t k, const at::Tensor& panels, int64_t n, float* out);

}  // namespace compiled_mtp
