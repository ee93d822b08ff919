// compiled_mtp::routed_experts: the routed experts of a MoE layer on CPU float32, each chosen
// expert's weights read once for every row routed to it (models.deepseek_v3.gathered_experts reads an
// expert once per row that chose it). The rows are grouped by expert; each expert's gate and up
// weights are read once, in blocks that every row routed to it multiplies while the block is in
// cache, then each block of the down projection once for all its rows. The experts' weights are
// float32, or bfloat16 (the copies of weights of bfloat16 values that the bfloat16_reads pass hands
// the op: half the bytes, widened as loaded, so the products are the float32 ones bit for bit). See
// docs/passes.md.
#include <omp.h>

#include "dots.h"
#include "panels.h"

namespace compiled_mtp {
namespace {
constexpr int64_t GATE_BLOCK = 64;  // rows of an expert's gate and up weights per work item
constexpr int64_t DOWN_BLOCK = 64;  // rows of the down weights (outputs) per work item

// act[i] = silu(act[i]) * up[i] for i in [0, n), vectorised (the exponentials dominate otherwise).
static void silu_mul(float* act, const float* up, int64_t n) {
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
        const Vec g = Vec::loadu(act + i);
        (g / (Vec(1.f) + g.neg().exp()) * Vec::loadu(up + i)).store(act + i);
    }
    for (; i < n; i++) act[i] = act[i] / (1.f + std::exp(-act[i])) * up[i];
}

// The (row, slot) pairs routed to one expert, DOT_ROWS at a time: fn(pair index p0, rows).
template <typename Fn>
static inline void row_groups(const std::vector<int64_t>& ps, Fn fn) {
    for (size_t p0 = 0; p0 < ps.size(); p0 += DOT_ROWS) fn(p0, std::min<int64_t>(DOT_ROWS, ps.size() - p0));
}

// x [n, h], idx / weight [n, k], gate / up [e, inter, h], down [e, h, inter] -> out [n, h]
template <typename W>
void kernel(const float* x, const int64_t* idx, const float* weight, const W* gate, const W* up,
                       const W* down, float* out, int64_t n, int64_t k, int64_t e, int64_t h, int64_t inter,
                       int64_t threads) {
    // The (row, slot) pairs routed to each expert, grouped by expert.
    std::vector<std::vector<int64_t>> pairs(e);
    for (int64_t p = 0; p < n * k; p++) pairs[idx[p]].push_back(p);
    std::vector<int64_t> used;
    for (int64_t j = 0; j < e; j++) if (!pairs[j].empty()) used.push_back(j);
    // x gate^T per (row, slot), then silu of it times x up^T (kept in ups until then).
    std::vector<float> act(n * k * inter), ups(n * k * inter);
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
            const int64_t i1 = std::min(i0 + GATE_BLOCK, inter);
            const std::vector<int64_t>& ps = pairs[ex];
            // Each pair of weight rows meets every row group while it is in L1, so the weights stream
            // from memory once, beside the arithmetic (a block read once per group left the memory
            // idle after the first group: at 8 rows a cold MLP cost its read plus its arithmetic).
            for (int64_t i = i0; i < i1; i += 2) {
                const int64_t i2 = std::min(i + 1, i1 - 1);  // an odd last row is computed twice, stored once
                const W* w[O] = {gate + (ex * inter + i) * h, gate + (ex * inter + i2) * h,
                                     up + (ex * inter + i) * h, up + (ex * inter + i2) * h};
                row_groups(ps, [&](size_t p0, int64_t rows) {
                    const float* xr[DOT_ROWS];
                    for (int64_t r = 0; r < rows; r++) xr[r] = x + ps[p0 + r] / k * h;
                    float s[DOT_ROWS][O];
                    dots_any<DOT_ROWS>(rows, xr, w, h, s);
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t at = ps[p0 + r] * inter;
                        act[at + i] = s[r][0], act[at + i2] = s[r][1];
                        ups[at + i] = s[r][2], ups[at + i2] = s[r][3];
                    }
                });
            }
            for (int64_t p : ps) silu_mul(act.data() + p * inter + i0, ups.data() + p * inter + i0, i1 - i0);
        }
        #pragma omp for schedule(static)
        for (int64_t j0 = 0; j0 < h; j0 += DOWN_BLOCK) {
            const int64_t j1 = std::min(j0 + DOWN_BLOCK, h);
            for (int64_t t = 0; t < n; t++) std::fill(out + t * h + j0, out + t * h + j1, 0.f);
            for (int64_t ex : used) {
                const std::vector<int64_t>& ps = pairs[ex];
                for (int64_t j = j0; j < j1; j += O) {  // weight rows outside the row groups, as above
                    const W* w[O];
                    for (int o = 0; o < O; o++) w[o] = down + (ex * h + std::min(j + o, j1 - 1)) * inter;
                    row_groups(ps, [&](size_t p0, int64_t rows) {
                        const float* ar[DOT_ROWS];
                        for (int64_t r = 0; r < rows; r++) ar[r] = act.data() + ps[p0 + r] * inter;
                        float s[DOT_ROWS][O];
                        dots_any<DOT_ROWS>(rows, ar, w, inter, s);
                        for (int64_t r = 0; r < rows; r++) {
                            const int64_t p = ps[p0 + r];
                            for (int o = 0; o < O && j + o < j1; o++) out[p / k * h + j + o] += weight[p] * s[r][o];
                        }
                    });
                }
            }
        }
    }
}

at::Tensor routed_experts(const at::Tensor& x_in, const at::Tensor& idx_in, const at::Tensor& weights_in,
                          const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
    const char* op = "routed_experts";
    check(x_in, op, "x", at::kFloat, 2);
    check(idx_in, op, "idx", at::kLong, 2);
    check(weights_in, op, "weights", at::kFloat, 2);
    const at::ScalarType type = gate.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
    check(gate, op, "gate", type, 3, true);
    check(up, op, "up", type, 3, true);
    check(down, op, "down", type, 3, true);
    const int64_t n = x_in.size(0), h = x_in.size(1), k = idx_in.size(1), e = gate.size(0), inter = gate.size(1);
    TORCH_CHECK(idx_in.size(0) == n && weights_in.sizes() == idx_in.sizes(), op, ": idx ", idx_in.sizes(), " and weights ", weights_in.sizes(), " must both be [", n, ", k]");
    TORCH_CHECK(up.sizes() == gate.sizes() && gate.size(2) == h, op, ": gate and up must be [experts, inter, ", h, "], got ", gate.sizes(), " and ", up.sizes());
    TORCH_CHECK(down.sizes() == at::IntArrayRef({e, h, inter}), op, ": down must be ", at::IntArrayRef({e, h, inter}), ", got ", down.sizes());
    const at::Tensor x = x_in.contiguous(), idx = idx_in.contiguous(), weights = weights_in.contiguous();
    const int64_t* ids = idx.data_ptr<int64_t>();
    for (int64_t p = 0; p < n * k; p++) TORCH_CHECK(ids[p] >= 0 && ids[p] < e, op, ": expert id ", ids[p], " outside [0, ", e, ")");
    at::Tensor out = at::empty(x.sizes(), x.options());
    if (type == at::kBFloat16) {
        const auto bits = [](const at::Tensor& w) { return reinterpret_cast<const uint16_t*>(w.data_ptr()); };
        kernel(x.data_ptr<float>(), ids, weights.data_ptr<float>(), bits(gate), bits(up), bits(down),
               out.data_ptr<float>(), n, k, e, h, inter, at::get_num_threads());
    } else {
        kernel(x.data_ptr<float>(), ids, weights.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(),
               down.data_ptr<float>(), out.data_ptr<float>(), n, k, e, h, inter, at::get_num_threads());
    }
    return out;
}

// The dense MLP on up to 16 rows from its weights' panels: x gate^T, x up^T, the activation, then down,
// each product a vector of outputs times a broadcast input with no reduction across lanes, where the
// dot blocks of `kernel` spend about a third of their work reducing (see docs/passes.md,
// fuse_dense_mlp). One parallel region: each thread takes the activation of its own run of
// intermediate columns (gate, up, silu), and after one barrier its own run of outputs of down.
static void panel_mlp(const float* x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, float* out, int64_t n, int64_t h, int64_t inter) {
    const at::Tensor scratch = at::empty({2, n * inter}, gate.options());  // written in full before read
    float *act = scratch.data_ptr<float>(), *ups = act + n * inter;
    const at::Tensor g = panels_of(gate), u = panels_of(up), d = panels_of(down);
    // Where the products round their rows to bfloat16 (bfloat16_products), the activation too: each
    // thread rounds the columns it wrote, before the barrier.
    const at::Tensor x_rounded = rounded_rows(x, n, h, g);
    const at::Tensor act_rounded = x_rounded.defined() && d.scalar_type() == at::kBFloat16 ? at::empty({n, panel_columns(inter)}, x_rounded.options()) : at::Tensor();
    const uint16_t* xr = x_rounded.defined() ? reinterpret_cast<const uint16_t*>(x_rounded.data_ptr()) : nullptr;
    uint16_t* ar = act_rounded.defined() ? reinterpret_cast<uint16_t*>(act_rounded.data_ptr()) : nullptr;
    const int64_t inner = (inter + PANEL_LANES - 1) / PANEL_LANES, outer = (h + PANEL_LANES - 1) / PANEL_LANES;
    #pragma omp parallel num_threads(at::get_num_threads())
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t q0 = inner * t / threads, q1 = inner * (t + 1) / threads;
        panel_run(x, xr, n, h, g, inter, act, q0, q1);
        panel_run(x, xr, n, h, u, inter, ups, q0, q1);
        const int64_t c0 = q0 * PANEL_LANES, c1 = std::min(q1 * PANEL_LANES, inter);
        for (int64_t r = 0; r < n && c1 > c0; r++) silu_mul(act + r * inter + c0, ups + r * inter + c0, c1 - c0);
        if (ar != nullptr && c1 > c0) round_rows(act, n, inter, c0, c1, ar);
        #pragma omp barrier
        panel_run(act, ar, n, inter, d, h, out, outer * t / threads, outer * (t + 1) / threads);
    }
}

// compiled_mtp::dense_mlp: a dense SwiGLU MLP (models.deepseek_v3.dense_mlp) as one expert that every
// row takes with weight 1: x [..., H], gate / up [I, H], down [H, I] -> [..., H]. One call reads each
// weight once for up to PANEL_MAX_ROWS rows, where three linears and the activation between them
// were four, from copies of the weights in panels (panels.h). More rows (a prefill chunk, a verify of
// B(K + 1) > 16 rows) go through the panels PANEL_MAX_ROWS at a time, so that a row's outputs never
// depend on how many rows share its call: rounded to bfloat16 (bfloat16_products) they would differ
// from any other kernel's float32 products, and a verify's tokens from a depth-0 step's.
at::Tensor dense_mlp(const at::Tensor& x_in, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
    const char* op = "dense_mlp";
    TORCH_CHECK(x_in.dim() >= 1, op, ": x must have a dimension of features");
    check(x_in, op, "x", at::kFloat, x_in.dim());
    check(gate, op, "gate", at::kFloat, 2, true);
    check(up, op, "up", at::kFloat, 2, true);
    check(down, op, "down", at::kFloat, 2, true);
    const int64_t h = x_in.size(-1), n = h ? x_in.numel() / h : 0, inter = gate.size(0);
    TORCH_CHECK(up.sizes() == gate.sizes() && gate.size(1) == h, op, ": gate and up must be [inter, ", h, "], got ", gate.sizes(), " and ", up.sizes());
    TORCH_CHECK(down.sizes() == at::IntArrayRef({h, inter}), op, ": down must be ", at::IntArrayRef({h, inter}), ", got ", down.sizes());
    const at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options());
    for (int64_t r0 = 0; r0 < n; r0 += PANEL_MAX_ROWS) {
        const int64_t rows = std::min(PANEL_MAX_ROWS, n - r0);
        panel_mlp(x.data_ptr<float>() + r0 * h, gate, up, down, out.data_ptr<float>() + r0 * h, rows, h, inter);
    }
    return out;
}

at::Tensor dense_mlp_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    return at::empty(x.sizes(), x.options());
}

at::Tensor routed_experts_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    return at::empty(x.sizes(), x.options());
}

}  // namespace

COMPILED_MTP_OP(routed_experts, "(Tensor x, Tensor idx, Tensor weights, Tensor gate, Tensor up, Tensor down) -> Tensor")
COMPILED_MTP_OP(dense_mlp, "(Tensor x, Tensor gate, Tensor up, Tensor down) -> Tensor")

}  // namespace compiled_mtp
