// compiled_mtp::live_attention: the model's latent attention (models.deepseek_v3.latent_attention)
// over the live part of each request's cache, read by slot, on CPU float32: a block of cache entries
// is read once for every query row of a request (the heads and the K+1 rows share the latent
// entries), the scores, softmax and weighted sum of each row stay here, and the work splits over the
// threads by request and by query rows. See docs/passes.md, live_attention.
#include <cstring>

#include "ops.h"

namespace compiled_mtp {
namespace {
constexpr int64_t ROWS = 4;          // query rows per block
constexpr int64_t ENTRY_BLOCK = 64;  // cache entries per block: in L2 while every row block uses them
// Vectors of entries scored at once and of output columns summed at once: ROWS x WIDE accumulators
// fit 32 vector registers (AVX-512) with room for the loads, and ROWS x 2 fit 16.
constexpr int64_t WIDE = Vec::size() >= 16 ? 4 : 2;
// A thread's query rows of a request from which their scores come from each block of entries
// transposed, the entries along the vector lanes: every score a lane's own sum, none reduced across
// lanes. The transposition costs about as much as scoring a few rows, so fewer rows score the
// entries as stored (benchmarks/README.md, "Scores from the entries transposed").
constexpr int64_t TRANSPOSED_ROWS = 16;


// acc[r][e] += <a[r][:n], w[e][:n]> over whole vectors; the tail is left to the caller.
template <int R>
C10_ALWAYS_INLINE static void dot_vectors(const float* const* a, const float* const* w, int64_t n, Vec acc[][WIDE]) {
    for (int64_t c = 0; c + Vec::size() <= n; c += Vec::size()) {
        Vec ws[WIDE];
        for (int e = 0; e < WIDE; e++) ws[e] = Vec::loadu(w[e] + c);
        for (int r = 0; r < R; r++) {
            const Vec x = Vec::loadu(a[r] + c);
            for (int e = 0; e < WIDE; e++) acc[r][e] = at::vec::fmadd(x, ws[e], acc[r][e]);
        }
    }
}

static inline float dot_tail(const float* a, const float* w, int64_t n) {
    float s = 0.f;
    for (int64_t c = n - n % Vec::size(); c < n; c++) s += a[c] * w[c];
    return s;
}

// Scores of R query rows against the entries [s0, s1) as stored, WIDE at a time: sc[r][s].
template <int R>
static void scores_across(const float* const* ql, const float* const* qp, const float* kv, int64_t s0, int64_t s1,
                          int64_t rank, int64_t rope, float* const* sc) {
    const int64_t width = rank + rope;
    const bool tails = rank % Vec::size() || rope % Vec::size();
    for (int64_t s = s0; s < s1; s += WIDE) {
        const float *w[WIDE], *wp[WIDE];
        for (int e = 0; e < WIDE; e++) {
            w[e] = kv + std::min(s + e, s1 - 1) * width;  // entries past s1 are computed again, stored once
            wp[e] = w[e] + rank;
        }
        Vec acc[R][WIDE];
        for (int r = 0; r < R; r++)
            for (int e = 0; e < WIDE; e++) acc[r][e] = Vec(0.f);
        dot_vectors<R>(ql, w, rank, acc);
        dot_vectors<R>(qp, wp, rope, acc);
        for (int r = 0; r < R; r++) {
            float sums[WIDE];
            sum_each<WIDE>(acc[r], sums);  // with AVX-512, the 4 at once
            for (int e = WIDE - 1; e >= 0; e--) {  // the last entry's score is stored last
                if (tails) sums[e] += dot_tail(ql[r], w[e], rank) + dot_tail(qp[r], wp[e], rope);
                sc[r][std::min(s + e, s1 - 1)] = sums[e];
            }
        }
    }
}

// acc[r][j] += q[r][c] * kv_t[c][j vectors] for c in [0, n): the entries of a block along the vector
// lanes (kv_t, the block transposed), so that every score is a lane's own sum and none is reduced
// across lanes.
template <int R, int J>
C10_ALWAYS_INLINE static void dot_columns(const float* const* q, const float* kv_t, int64_t n, Vec (&acc)[R][J]) {
    for (int64_t c = 0; c < n; c++) {
        Vec w[J];
        for (int j = 0; j < J; j++) w[j] = Vec::loadu(kv_t + c * ENTRY_BLOCK + j * Vec::size());
        for (int r = 0; r < R; r++) {
            const Vec x(q[r][c]);
            for (int j = 0; j < J; j++) acc[r][j] = at::vec::fmadd(x, w[j], acc[r][j]);
        }
    }
}

// Scores of R query rows against the block's `count` entries, J vectors of them, transposed in kv_t
// [rank + rope][ENTRY_BLOCK]: sc[r][0 : count].
template <int R, int J>
static void scores_along(const float* const* ql, const float* const* qp, const float* kv_t, int64_t count,
                         int64_t rank, int64_t rope, float* const* sc) {
    Vec acc[R][J];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = Vec(0.f);
    dot_columns<R, J>(ql, kv_t, rank, acc);
    dot_columns<R, J>(qp, kv_t + rank * ENTRY_BLOCK, rope, acc);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            const int64_t first = j * Vec::size();
            acc[r][j].store(sc[r] + first, static_cast<int>(std::min<int64_t>(Vec::size(), count - first)));
        }
}

template <int R, int J>
static void scores_along_of(const float* const* ql, const float* const* qp, const float* kv_t, int64_t count,
                            int64_t rank, int64_t rope, float* const* sc) {
    if (count > (J - 1) * Vec::size()) scores_along<R, J>(ql, qp, kv_t, count, rank, rope, sc);
    else if constexpr (J > 1) scores_along_of<R, J - 1>(ql, qp, kv_t, count, rank, rope, sc);
}

// out[r][c0 : c0 + V vectors] += sum over s in [s0, s1) of p[r][s] * kv[s][c0 : ...].
template <int R, int V>
static void weighted_sum(const float* const* p, const float* kv, int64_t s0, int64_t s1, int64_t width, int64_t c0,
                         float* const* out) {
    Vec acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = Vec::loadu(out[r] + c0 + v * Vec::size());
    for (int64_t s = s0; s < s1; s++) {
        Vec w[V];
        for (int v = 0; v < V; v++) w[v] = Vec::loadu(kv + s * width + c0 + v * Vec::size());
        for (int r = 0; r < R; r++) {
            const Vec ps(p[r][s]);
            for (int v = 0; v < V; v++) acc[r][v] = at::vec::fmadd(ps, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v].store(out[r] + c0 + v * Vec::size());
}

// Rows [0, R) of a block against the entries [s0, s1): their scores, from the block transposed where
// there is one (kv_t), or the weighted sum of every column.
template <int R>
static void block(bool score, const float* const* ql, const float* const* qp, const float* kv, const float* kv_t,
                  int64_t s0, int64_t s1, int64_t rank, int64_t rope, float* const* p, float* const* out) {
    const int64_t width = rank + rope;
    if (score && kv_t == nullptr) return scores_across<R>(ql, qp, kv, s0, s1, rank, rope, p);
    if (score) {
        for (int64_t e0 = 0; e0 < s1 - s0; e0 += WIDE * Vec::size()) {
            float* sc[R];
            for (int r = 0; r < R; r++) sc[r] = p[r] + s0 + e0;
            scores_along_of<R, WIDE>(ql, qp, kv_t + e0, std::min(WIDE * Vec::size(), s1 - s0 - e0), rank, rope, sc);
        }
        return;
    }
    const int64_t step = WIDE * Vec::size(), whole = rank - rank % Vec::size();
    int64_t c = 0;
    for (; c + step <= whole; c += step) weighted_sum<R, WIDE>(p, kv, s0, s1, width, c, out);
    for (; c < whole; c += Vec::size()) weighted_sum<R, 1>(p, kv, s0, s1, width, c, out);
    for (int r = 0; r < R; r++)
        for (int64_t col = whole; col < rank; col++)
            for (int64_t s = s0; s < s1; s++) out[r][col] += p[r][s] * kv[s * width + col];
}

template <int R>
static void block_any(int64_t rows, bool score, const float* const* ql, const float* const* qp, const float* kv,
                      const float* kv_t, int64_t s0, int64_t s1, int64_t rank, int64_t rope, float* const* p,
                      float* const* out) {
    if (rows == R) block<R>(score, ql, qp, kv, kv_t, s0, s1, rank, rope, p, out);
    else if constexpr (R > 1) block_any<R - 1>(rows, score, ql, qp, kv, kv_t, s0, s1, rank, rope, p, out);
}

// Scaled, masked softmax of one row of scores over [0, live); no visible entry gives NaN, as traced.
// Every pass runs over whole vectors (the masking is the compiler's): a scalar running maximum was a
// chain of dependent instructions as long as the row.
static void softmax(float* sc, const bool* visible, int64_t live, float scale) {
    constexpr float none = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < live; s++) sc[s] = visible[s] ? sc[s] * scale : none;
    const int64_t whole = live - live % Vec::size();
    Vec tops(none);
    for (int64_t s = 0; s < whole; s += Vec::size()) tops = at::vec::maximum(tops, Vec::loadu(sc + s));
    float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, tops);
    for (int64_t s = whole; s < live; s++) top = std::max(top, sc[s]);
    if (top == none) {
        std::fill(sc, sc + live, std::numeric_limits<float>::quiet_NaN());
        return;
    }
    Vec total(0.f);
    for (int64_t s = 0; s < whole; s += Vec::size()) {
        const Vec e = (Vec::loadu(sc + s) - Vec(top)).exp();
        e.store(sc + s);
        total = total + e;
    }
    float sum = sum_lanes(total);
    for (int64_t s = whole; s < live; s++) sum += (sc[s] = std::exp(sc[s] - top));
    for (int64_t s = 0; s < whole; s += Vec::size()) (Vec::loadu(sc + s) / Vec(sum)).store(sc + s);
    for (int64_t s = whole; s < live; s++) sc[s] /= sum;
}

// The entries up to the last visible one in a row of `visible` (0 if none). Every layer scans every
// query row's whole mask, most of it the cache's unused capacity, so blocks of 64 entries are tested
// as 8 words at once: byte by byte, the scans cost about 8 us a layer at 4 requests of 4 rows.
static int64_t visible_prefix(const bool* row, int64_t capacity) {
    int64_t s = capacity;
    for (; s >= 64; s -= 64) {
        uint64_t any = 0;
        for (int i = 0; i < 8; i++) {
            uint64_t word;
            std::memcpy(&word, row + s - 64 + 8 * i, sizeof word);
            any |= word;
        }
        if (any) break;
    }
    while (s > 0 && !row[s - 1]) s--;
    return s;
}

// q_latent [B, T, H, rank], q_pe [B, T, H, rope], cache [N, S, rank + rope], slots [B], visible [B, T, S]
// -> out [B, T, H, rank]. The queries' rows are read by their strides over (B, T, H): the absorbed
// products leave q_latent head-major, and a copy per layer would cost more than reading it in place.
void kernel(const float* q_latent, const float* q_pe, const float* cache, const int64_t* slots,
                       const bool* visible, float* out, int64_t batch, int64_t steps, int64_t heads, int64_t rank,
                       int64_t rope, int64_t capacity, int64_t ql_b, int64_t ql_t, int64_t ql_h, int64_t qp_b,
                       int64_t qp_t, int64_t qp_h, float scale, int64_t threads) {
    const int64_t width = rank + rope, rows = steps * heads;
    std::vector<int64_t> live(batch, 0);  // entries up to the last one any row of the request sees
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < steps; t++)
            live[b] = std::max(live[b], visible_prefix(visible + (b * steps + t) * capacity, capacity));
    // A request's rows split into enough chunks for every thread to have one.
    const int64_t splits = std::min(rows, std::max<int64_t>(1, (threads + batch - 1) / batch));
    const int64_t chunk = (rows + splits - 1) / splits, chunks = (rows + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < batch * chunks; item++) {
        const int64_t b = item / chunks, q0 = (item % chunks) * chunk, q1 = std::min(q0 + chunk, rows), n = live[b];
        const float* kv = cache + slots[b] * capacity * width;
        std::vector<float> probs((q1 - q0) * n), kv_t(q1 - q0 >= TRANSPOSED_ROWS ? width * ENTRY_BLOCK : 0, 0.f);
        float* const transposed = kv_t.empty() ? nullptr : kv_t.data();
        float* o = out + (b * rows + q0) * rank;
        // Nothing visible to any row: NaN, as traced; else the weighted sum accumulates from zero.
        std::fill(o, o + (q1 - q0) * rank, n ? 0.f : std::numeric_limits<float>::quiet_NaN());
        // Every block of entries against every block of rows: their scores, or their weighted sum.
        auto each_block = [&](bool score) {
            for (int64_t s0 = 0; s0 < n; s0 += ENTRY_BLOCK) {
                const int64_t s1 = std::min(s0 + ENTRY_BLOCK, n);
                // Transposed once for all the rows' scores. Past s1, kv_t holds an earlier block's
                // entries (or zeros): scored with the others, never stored.
                if (score && transposed != nullptr) {
                    at::vec::transpose_mxn<float>(kv + s0 * width, width, transposed, ENTRY_BLOCK,
                                                  static_cast<int>(s1 - s0), static_cast<int>(width));
                }
                for (int64_t r0 = q0; r0 < q1; r0 += ROWS) {
                    const int64_t count = std::min(ROWS, q1 - r0);
                    const float *ql[ROWS], *qp[ROWS];
                    float *p[ROWS], *acc[ROWS];
                    for (int64_t r = 0; r < count; r++) {
                        const int64_t t = (r0 + r) / heads, h = (r0 + r) % heads;
                        ql[r] = q_latent + b * ql_b + t * ql_t + h * ql_h;
                        qp[r] = q_pe + b * qp_b + t * qp_t + h * qp_h;
                        p[r] = probs.data() + (r0 + r - q0) * n;
                        acc[r] = o + (r0 + r - q0) * rank;
                    }
                    block_any<ROWS>(count, score, ql, qp, kv, transposed, s0, s1, rank, rope, p, acc);
                }
            }
        };
        each_block(true);
        for (int64_t q = q0; q < q1; q++)
            softmax(probs.data() + (q - q0) * n, visible + (b * steps + q / heads) * capacity, n, scale);
        each_block(false);
    }
}

at::Tensor live_attention(const at::Tensor& q_latent_in, const at::Tensor& q_pe_in, const at::Tensor& cache,
                          const at::Tensor& slots_in, const at::Tensor& visible_in, double scale) {
    const char* op = "live_attention";
    check(q_latent_in, op, "q_latent", at::kFloat, 4);
    check(q_pe_in, op, "q_pe", at::kFloat, 4);
    check(cache, op, "cache", at::kFloat, 3, true);
    check(slots_in, op, "slots", at::kLong, 1);
    check(visible_in, op, "visible", at::kBool, 3);
    const int64_t batch = q_latent_in.size(0), steps = q_latent_in.size(1), heads = q_latent_in.size(2);
    const int64_t rank = q_latent_in.size(3), rope = q_pe_in.size(3), capacity = cache.size(1);
    TORCH_CHECK(cache.size(2) == rank + rope, op, ": cache entries have ", cache.size(2), " values, the queries ", rank, " + ", rope);
    TORCH_CHECK(q_pe_in.size(0) == batch && q_pe_in.size(1) == steps && q_pe_in.size(2) == heads, op, ": q_pe ", q_pe_in.sizes(), " does not match q_latent ", q_latent_in.sizes());
    TORCH_CHECK(slots_in.size(0) == batch, op, ": ", slots_in.size(0), " slots for ", batch, " requests");
    TORCH_CHECK(visible_in.sizes() == at::IntArrayRef({batch, steps, capacity}), op, ": visible must be ", at::IntArrayRef({batch, steps, capacity}), ", got ", visible_in.sizes());
    // The absorbed products leave q_latent head-major: its rows are read by their strides.
    const at::Tensor q_latent = q_latent_in.stride(3) == 1 ? q_latent_in : q_latent_in.contiguous();
    const at::Tensor q_pe = q_pe_in.stride(3) == 1 ? q_pe_in : q_pe_in.contiguous();
    const at::Tensor slots = slots_in.contiguous(), visible = visible_in.contiguous();
    at::Tensor out = at::empty(q_latent.sizes(), q_latent.options());
    kernel(q_latent.data_ptr<float>(), q_pe.data_ptr<float>(), cache.data_ptr<float>(), slots.data_ptr<int64_t>(),
           visible.data_ptr<bool>(), out.data_ptr<float>(), batch, steps, heads, rank, rope, capacity,
           q_latent.stride(0), q_latent.stride(1), q_latent.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
           static_cast<float>(scale), at::get_num_threads());
    return out;
}

at::Tensor live_attention_meta(const at::Tensor& q_latent, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
    return at::empty(q_latent.sizes(), q_latent.options());
}

}  // namespace

COMPILED_MTP_OP(live_attention,
                "(Tensor q_latent, Tensor q_pe, Tensor cache, Tensor slots, Tensor visible, float scale) -> Tensor")

}  // namespace compiled_mtp
