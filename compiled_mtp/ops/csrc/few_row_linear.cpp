// compiled_mtp::few_row_linear(x [rows, in], weight [out, in]) -> x W^T [rows, out], rows 1..4, float32.
// Each vector of x meets several weight rows and each product has its own accumulators, so the
// arithmetic keeps up with reading the weight (see docs/passes.md, narrow_linear).
#include "ops.h"

namespace compiled_mtp {
namespace {
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

at::Tensor few_row_linear(const at::Tensor& x_in, const at::Tensor& weight) {
    check(x_in, "few_row_linear", "x", at::kFloat, 2);
    check(weight, "few_row_linear", "weight", at::kFloat, 2, true);
    const int64_t rows = x_in.size(0), n = weight.size(0), k = weight.size(1);
    TORCH_CHECK(rows >= 1 && rows <= 4, "few_row_linear: x must have 1 to 4 rows, got ", rows);
    TORCH_CHECK(x_in.size(1) == k, "few_row_linear: x has ", x_in.size(1), " columns, weight ", k);
    const at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({rows, n}, x.options());
    const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t threads = at::get_num_threads();
    switch (rows) {
        case 1: few_rows<1, 4>(xp, wp, op, n, k, threads); break;
        case 2: few_rows<2, 2>(xp, wp, op, n, k, threads); break;
        case 3: few_rows<3, 2>(xp, wp, op, n, k, threads); break;
        default: few_rows<4, 1>(xp, wp, op, n, k, threads); break;
    }
    return out;
}

at::Tensor few_row_linear_meta(const at::Tensor& x, const at::Tensor& weight) {
    return at::empty({x.size(0), weight.size(0)}, x.options());
}

}  // namespace

COMPILED_MTP_OP(few_row_linear, "(Tensor x, Tensor weight) -> Tensor")

}  // namespace compiled_mtp
