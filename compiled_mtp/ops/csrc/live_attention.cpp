// compiled_mtp::live_attention: the model's latent attention (models.deepseek_v3.latent_attention)
// over the live part of each request's cache, read by slot, on CPU float32: each query row is taken
// into the latent space through its head's key half of kv_b_proj, a block of cache entries is read
// once for every query row of a request (the heads and the K+1 rows share the latent entries), the
// scores, softmax and weighted sum of each row stay here, and each row's output leaves through its
// head's value half; the work splits over the threads by request and by query rows. See
// docs/passes.md, live_attention.
#include <cstring>
#include <memory>
#include <type_traits>

#include "dots.h"

namespace compiled_mtp {
namespace {
constexpr int64_t LANES = Vec::size();
constexpr int64_t ENTRY_BLOCK = 64;  // cache entries per block: in L1 while every group of rows uses them
constexpr int64_t ROWS = 4;          // query rows per block of the weighted sum
static_assert(LANES % ROWS == 0);
// Output columns summed at once: ROWS x WIDE sums fit the vector registers with room for the loads.
constexpr int64_t WIDE = LANES >= 16 ? 4 : 2;
using Lanes = uint32_t;  // a bit per lane
static_assert(LANES <= 32);

// A group of up to LANES query rows is scored with its rows along the lanes, J lanes a row (J = LANES
// / the group's rows, rounded down to a power of two): a lane multiplies J columns of its row by the
// same J columns of an entry, broadcast from the entry as stored, so no block of entries is
// transposed, and a row's J lanes are added once for J entries (pack_sums), where a score of one row
// against one entry ended in a sum across all of its lanes. Lane r * J + j of the v-th vector of
// scores holds row r's score for entry v * J + j: the softmax runs along the lanes, and only a row's
// maximum and sum cross its J lanes (benchmarks/README.md, "Query rows along the lanes").

// J consecutive floats from p, repeated along the lanes: lane l holds p[l % J].
template <int J>
C10_ALWAYS_INLINE Vec spread(const float* p) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (J == 1) return _mm512_set1_ps(*p);
    if constexpr (J == 2) {
        double pair;
        std::memcpy(&pair, p, sizeof pair);
        return _mm512_castpd_ps(_mm512_set1_pd(pair));
    }
    if constexpr (J == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
    if constexpr (J == 8) return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
    if constexpr (J == 16) return _mm512_loadu_ps(p);
#endif
    float lanes[LANES];
    for (int64_t l = 0; l < LANES; l++) lanes[l] = p[l % J];
    return Vec::loadu(lanes);
}

// v with lane l and lane l ^ D exchanged.
template <int D>
C10_ALWAYS_INLINE Vec swapped(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (D == 1) return _mm512_permute_ps(v, 0xB1);
    if constexpr (D == 2) return _mm512_permute_ps(v, 0x4E);
    if constexpr (D == 4) return _mm512_shuffle_f32x4(v, v, 0xB1);
    if constexpr (D == 8) return _mm512_shuffle_f32x4(v, v, 0x4E);
#endif
    float lanes[LANES], out[LANES];
    v.store(lanes);
    for (int64_t l = 0; l < LANES; l++) out[l] = lanes[l ^ D];
    return Vec::loadu(out);
}

// The lanes l with l & D set.
template <int D>
constexpr Lanes with_bit() {
    Lanes bits = 0;
    for (int64_t l = 0; l < LANES; l++) bits |= Lanes{(l & D) != 0} << l;
    return bits;
}

// The lanes l with l % J == 0.
template <int J>
constexpr Lanes with_step() {
    Lanes bits = 0;
    for (int64_t l = 0; l < LANES; l += J) bits |= Lanes{1} << l;
    return bits;
}

// acc[0..J) (entry j's products in acc[j], a row's J lanes to be added) become acc[0] with lane
// r * J + j holding the sum of acc[j]'s lanes of row r: log2(J) rounds, each adding two vectors'
// lanes D apart where the other takes the first's place.
template <int J, int D = 1>
C10_ALWAYS_INLINE void pack_sums(Vec* acc) {
    if constexpr (D < J) {
        constexpr int64_t mask = with_bit<D>();
        for (int i = 0; i < J; i += 2 * D) {
            const Vec kept = Vec::template blend<mask>(acc[i], acc[i + D]);
            const Vec moved = Vec::template blend<mask>(acc[i + D], acc[i]);
            acc[i] = kept + swapped<D>(moved);
        }
        pack_sums<J, 2 * D>(acc);
    }
}

// Every lane of v becomes op of its row's J lanes.
template <int J, typename Op>
C10_ALWAYS_INLINE Vec across_row(Vec v, Op op) {
    if constexpr (J >= 2) v = op(v, swapped<1>(v));
    if constexpr (J >= 4) v = op(v, swapped<2>(v));
    if constexpr (J >= 8) v = op(v, swapped<4>(v));
    if constexpr (J >= 16) v = op(v, swapped<8>(v));
    return v;
}

// v where `lanes` are set, `other` elsewhere.
C10_ALWAYS_INLINE Vec select(Lanes lanes, Vec v, Vec other) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_mask_blend_ps(static_cast<__mmask16>(lanes), other, v);
#else
    float a[LANES], b[LANES];
    v.store(a);
    other.store(b);
    for (int64_t l = 0; l < LANES; l++) a[l] = (lanes >> l) & 1 ? a[l] : b[l];
    return Vec::loadu(a);
#endif
}

// A group of query rows along the lanes, J to a row: lane r * J + j of columns[c] holds column
// c * J + j of row r (the latent part, then the rope part, as a cache entry stores them) for the first
// `whole` columns; tail[c] holds column whole + c of each row in its first lane, zeros beside.
struct Group {
    std::vector<float> columns, tail;  // [whole / J][LANES], [width - whole][LANES]
    int64_t whole, J;
};

// Where a request's query rows are: row q is step q / heads, head q % heads.
struct Queries {
    const float *latent, *pe;
    int64_t l_t, l_h, p_t, p_h, heads;
    const float* latent_of(int64_t q) const { return latent + q / heads * l_t + q % heads * l_h; }
    const float* pe_of(int64_t q) const { return pe + q / heads * p_t + q % heads * p_h; }
};

// The rows [q0, q0 + count) (count * J <= LANES).
Group group_of(const Queries& q, int64_t q0, int64_t count, int64_t J, int64_t rank, int64_t rope) {
    const int64_t width = rank + rope, whole = width - width % J;
    Group g{std::vector<float>(whole / J * LANES, 0.f), std::vector<float>((width - whole) * LANES, 0.f), whole, J};
    for (int64_t r = 0; r < count; r++) {
        const float *latent = q.latent_of(q0 + r), *pe = q.pe_of(q0 + r);
        float* lanes = g.columns.data() + r * J;
        // Column c goes to vector c / J, lane r * J + c % J (J a power of two).
        for (int64_t c = 0; c < whole; c++) lanes[(c & -J) * (LANES / J) + (c & (J - 1))] = c < rank ? latent[c] : pe[c - rank];
        for (int64_t c = whole; c < width; c++) g.tail[(c - whole) * LANES + r * J] = c < rank ? latent[c] : pe[c - rank];
    }
    return g;
}

// A group's scores against the entries [s0, s1) (s0 a multiple of J), E entries at once: each vector
// of queries is loaded once for E entries, and every J entries' products are packed into one vector.
// Entries past s1 are scored again as the last one, and masked by the softmax.
template <int J>
void score_group(const Group& g, const float* kv, int64_t width, int64_t s0, int64_t s1, float* scores) {
    constexpr int E = J > 8 ? J : 8;
    for (int64_t s = s0; s < s1; s += E) {
        const float* e[E];
        Vec acc[E];
        for (int i = 0; i < E; i++) {
            e[i] = kv + std::min(s + i, s1 - 1) * width;
            acc[i] = Vec(0.f);
        }
        for (int64_t c = 0; c < g.whole / J; c++) {
            const Vec q = Vec::loadu(g.columns.data() + c * LANES);
            for (int i = 0; i < E; i++) acc[i] = at::vec::fmadd(q, spread<J>(e[i] + c * J), acc[i]);
        }
        for (int64_t c = g.whole; c < width; c++) {
            const Vec q = Vec::loadu(g.tail.data() + (c - g.whole) * LANES);
            for (int i = 0; i < E; i++) acc[i] = at::vec::fmadd(q, Vec(e[i][c]), acc[i]);
        }
        for (int i = 0; i < E && s + i < s1; i += J) {
            pack_sums<J>(acc + i);
            acc[i].store(scores + (s + i) / J * LANES);
        }
    }
}

template <int J = LANES>
void score_any(const Group& g, const float* kv, int64_t width, int64_t s0, int64_t s1, float* scores) {
    if (g.J == J) score_group<J>(g, kv, width, s0, s1, scores);
    else if constexpr (J > 1) score_any<J / 2>(g, kv, width, s0, s1, scores);
}

// A group's rows at one step of the request: their lanes, and that step's row of the mask.
struct Step {
    Lanes lanes;
    const bool* visible;
};

// The lanes of entries [s, s + J) that the group's rows see (none past `live`).
template <int J>
Lanes seen(const std::vector<Step>& steps, int64_t s, int64_t live) {
    constexpr Lanes firsts = with_step<J>();  // a bit at each row's first lane
    Lanes lanes = 0;
    for (const Step& step : steps) {
        Lanes entries = 0;
        for (int64_t j = 0; j < J && s + j < live; j++) entries |= Lanes{step.visible[s + j]} << j;
        lanes |= entries * firsts & step.lanes;
    }
    return lanes;
}

// The scaled, masked softmax of each row of a group's scores over [0, live), left divided by nothing:
// returns the vector whose lanes hold their row's sum. A row that sees nothing sums to NaN, as traced.
template <int J>
Vec softmax_group(float* scores, int64_t live, const std::vector<Step>& steps, float scale) {
    const Vec none(-std::numeric_limits<float>::infinity()), scaled(scale);
    const int64_t vectors = (live + J - 1) / J;
    Vec top = none;
    for (int64_t v = 0; v < vectors; v++) {
        const Vec x = select(seen<J>(steps, v * J, live), Vec::loadu(scores + v * LANES) * scaled, none);
        x.store(scores + v * LANES);
        top = at::vec::maximum(top, x);
    }
    top = across_row<J>(top, [](Vec a, Vec b) { return at::vec::maximum(a, b); });
    Vec sum(0.f);
    for (int64_t v = 0; v < vectors; v++) {
        const Vec e = (Vec::loadu(scores + v * LANES) - top).exp();
        e.store(scores + v * LANES);
        sum = sum + e;
    }
    return across_row<J>(sum, [](Vec a, Vec b) { return a + b; });
}

template <int J = LANES>
Vec softmax_any(int64_t spread, float* scores, int64_t live, const std::vector<Step>& steps, float scale) {
    if (spread == J) return softmax_group<J>(scores, live, steps, scale);
    if constexpr (J > 1) return softmax_any<J / 2>(spread, scores, live, steps, scale);
    return Vec(0.f);
}

// Rows [0, R) of a group, its weights a vector of J entries (J = 1 << shift) from p[r] on: entry s's
// weight is p[r][at(s)].
struct Weights {
    const float* p[ROWS];
    int64_t shift;
    int64_t at(int64_t s) const { return (s >> shift) * LANES + (s & ((int64_t{1} << shift) - 1)); }
};

// out[r][c0 : c0 + V vectors] += sum over s in [s0, s1) of r's weight of s * kv[s][c0 : ...].
template <int R, int V>
void weighted_sum(const Weights& p, const float* kv, int64_t s0, int64_t s1, int64_t width, int64_t c0, float* const* out) {
    Vec acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = Vec::loadu(out[r] + c0 + v * LANES);
    for (int64_t s = s0; s < s1; s++) {
        Vec w[V];
        for (int v = 0; v < V; v++) w[v] = Vec::loadu(kv + s * width + c0 + v * LANES);
        const int64_t index = p.at(s);
        for (int r = 0; r < R; r++) {
            const Vec ps(p.p[r][index]);
            for (int v = 0; v < V; v++) acc[r][v] = at::vec::fmadd(ps, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v].store(out[r] + c0 + v * LANES);
}

// Rows [0, R)'s weighted sums of the entries [s0, s1), every column of the latent part.
template <int R>
void weigh(const Weights& p, const float* kv, int64_t s0, int64_t s1, int64_t rank, int64_t width, float* const* out) {
    const int64_t step = WIDE * LANES, whole = rank - rank % LANES;
    int64_t c = 0;
    for (; c + step <= whole; c += step) weighted_sum<R, WIDE>(p, kv, s0, s1, width, c, out);
    for (; c < whole; c += LANES) weighted_sum<R, 1>(p, kv, s0, s1, width, c, out);
    for (int r = 0; r < R; r++)
        for (int64_t col = whole; col < rank; col++)
            for (int64_t s = s0; s < s1; s++) out[r][col] += p.p[r][p.at(s)] * kv[s * width + col];
}

template <int R>
void weigh_any(int64_t rows, const Weights& p, const float* kv, int64_t s0, int64_t s1, int64_t rank, int64_t width,
               float* const* out) {
    if (rows == R) weigh<R>(p, kv, s0, s1, rank, width, out);
    else if constexpr (R > 1) weigh_any<R - 1>(rows, p, kv, s0, s1, rank, width, out);
}

// The entries up to the last visible one in a row of `visible` (0 if none). Every layer scans every
// query row's whole mask, most of it the cache's unused capacity, so blocks of 64 entries are tested
// as 8 words at once: byte by byte, the scans cost about 8 us a layer at 4 requests of 4 rows.
int64_t visible_prefix(const bool* row, int64_t capacity) {
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

// The steps of a group's rows [g0, g0 + count) of a request, J lanes a row; `visible` its mask [T, S].
std::vector<Step> steps_of(int64_t g0, int64_t count, int64_t J, int64_t heads, const bool* visible, int64_t capacity) {
    std::vector<Step> steps;
    for (int64_t t = g0 / heads; t <= (g0 + count - 1) / heads; t++) {
        const int64_t r0 = std::max(g0, t * heads) - g0, r1 = std::min(g0 + count, (t + 1) * heads) - g0;
        steps.push_back({static_cast<Lanes>(((uint64_t{1} << (r1 * J)) - 1) ^ ((uint64_t{1} << (r0 * J)) - 1)), visible + t * capacity});
    }
    return steps;
}

// J for a group of `rows`: the largest power of two with rows * J <= LANES.
int64_t lanes_per_row(int64_t rows) {
    int64_t J = LANES;
    while (J > 1 && rows * J > LANES) J /= 2;
    return J;
}

// One request's query rows [q0, q1) against its n live entries kv: their attention into o [q1 - q0, rank].
void attend(const Queries& q, int64_t q0, int64_t q1, const float* kv, int64_t n, const bool* visible, int64_t capacity,
            int64_t rank, int64_t rope, float scale, float* o) {
    const int64_t width = rank + rope, groups = (q1 - q0 + LANES - 1) / LANES;
    std::vector<Group> group;
    for (int64_t i = 0; i < groups; i++) {
        const int64_t count = std::min(LANES, q1 - q0 - i * LANES);
        group.push_back(group_of(q, q0 + i * LANES, count, lanes_per_row(count), rank, rope));
    }
    std::vector<int64_t> begin(groups + 1, 0);  // where each group's scores begin: n / J vectors, rounded up
    for (int64_t i = 0; i < groups; i++) begin[i + 1] = begin[i] + (n + group[i].J - 1) / group[i].J * LANES;
    const std::unique_ptr<float[]> scores(new float[begin[groups]]);  // each vector written before it is read
    for (int64_t s0 = 0; s0 < n; s0 += ENTRY_BLOCK)  // a block of entries stays in L1 for every group
        for (int64_t i = 0; i < groups; i++)
            score_any(group[i], kv, width, s0, std::min(s0 + ENTRY_BLOCK, n), scores.get() + begin[i]);
    std::vector<float> share(q1 - q0);  // each row's 1 / its sum
    for (int64_t i = 0; i < groups; i++) {
        const int64_t g0 = q0 + i * LANES, count = std::min(LANES, q1 - g0), J = group[i].J;
        float sums[LANES];
        softmax_any(J, scores.get() + begin[i], n, steps_of(g0, count, J, q.heads, visible, capacity), scale).store(sums);
        for (int64_t r = 0; r < count; r++) share[g0 - q0 + r] = 1.f / sums[r * J];
    }
    // Blocks of ROWS rows, each within a group (ROWS divides LANES).
    for (int64_t s0 = 0; s0 < n; s0 += ENTRY_BLOCK)
        for (int64_t r0 = 0; r0 < q1 - q0; r0 += ROWS) {
            const Group& g = group[r0 / LANES];
            Weights p{{}, 0};
            while ((int64_t{1} << p.shift) < g.J) p.shift++;
            float* out[ROWS];
            for (int64_t r = 0; r < std::min(ROWS, q1 - q0 - r0); r++) {
                p.p[r] = scores.get() + begin[r0 / LANES] + (r0 + r) % LANES * g.J;
                out[r] = o + (r0 + r) * rank;
            }
            weigh_any<ROWS>(std::min(ROWS, q1 - q0 - r0), p, kv, s0, std::min(s0 + ENTRY_BLOCK, n), rank, width, out);
        }
    for (int64_t r = 0; r < q1 - q0; r++)
        for (int64_t c = 0; c < rank; c++) o[r * rank + c] *= share[r];
}

// Rows [0, R) of one head's queries taken into the latent space, V vectors of outputs from c0 on:
// latent[r][c] = the sum over d of qn[r][d] * wk[d][c], each weight vector loaded once for the R rows.
template <int R, int V, typename W>
void absorb_block(const float* const* qn, const W* wk, int64_t dn, int64_t rank, int64_t c0, float* const* latent) {
    Vec acc[R][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = Vec(0.f);
    for (int64_t d = 0; d < dn; d++) {
        Vec w[V];
        for (int v = 0; v < V; v++) w[v] = load_weights(wk + d * rank + c0 + v * LANES);
        for (int r = 0; r < R; r++) {
            const Vec x(qn[r][d]);
            for (int v = 0; v < V; v++) acc[r][v] = at::vec::fmadd(x, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v].store(latent[r] + c0 + v * LANES);
}

// Every column of rows [0, R)'s latent queries.
template <int R, typename W>
void absorb(const float* const* qn, const W* wk, int64_t dn, int64_t rank, float* const* latent) {
    const int64_t whole = rank - rank % LANES;
    int64_t c = 0;
    for (; c + WIDE * LANES <= whole; c += WIDE * LANES) absorb_block<R, WIDE>(qn, wk, dn, rank, c, latent);
    for (; c < whole; c += LANES) absorb_block<R, 1>(qn, wk, dn, rank, c, latent);
    for (int r = 0; r < R; r++)
        for (int64_t col = whole; col < rank; col++) {
            float sum = 0.f;
            for (int64_t d = 0; d < dn; d++) sum += qn[r][d] * weight_at(wk, d * rank + col);
            latent[r][col] = sum;
        }
}

template <int R, typename W>
void absorb_any(int64_t rows, const float* const* qn, const W* wk, int64_t dn, int64_t rank, float* const* latent) {
    if (rows == R) absorb<R>(qn, wk, dn, rank, latent);
    else if constexpr (R > 1) absorb_any<R - 1>(rows, qn, wk, dn, rank, latent);
}

// Each head's query rows among [q0, q1) (row q is head q % heads), DOT_ROWS at a time: fn(head, the
// rows, their count). The rows of a head share its slice of kv_b_proj.
template <typename Fn>
void by_head(int64_t q0, int64_t q1, int64_t heads, Fn fn) {
    for (int64_t h = 0; h < heads; h++) {
        int64_t rows[DOT_ROWS], count = 0;
        for (int64_t q = q0 + ((h - q0) % heads + heads) % heads; q < q1; q += heads) {
            rows[count++] = q;
            if (count == DOT_ROWS) fn(h, rows, count), count = 0;
        }
        if (count > 0) fn(h, rows, count);
    }
}

// A call's shapes and where its tensors are.
template <typename W>
struct Call {
    const float *q_nope, *q_pe, *cache;
    const W* kv_b;  // [heads, dn + dv, rank]: each head's key rows, then its value rows
    const int64_t* slots;
    const bool* visible;
    float* out;
    int64_t batch, steps, heads, dn, dv, rank, rope, capacity;
    int64_t qn_b, qn_t, qn_h, qp_b, qp_t, qp_h;  // the queries' strides
    float scale;
};

// Request b's query rows [q0, q1): into the latent space, their attention over its n live entries,
// and out through the value half, into out [B, T, H, dv].
template <typename W>
void attend_rows(const Call<W>& a, int64_t b, int64_t q0, int64_t q1, int64_t n) {
    const int64_t rows = a.steps * a.heads, rank = a.rank, part = (a.dn + a.dv) * rank;
    float* out = a.out + b * rows * a.dv;
    if (n == 0) {  // nothing visible to any row: NaN, as traced
        std::fill(out + q0 * a.dv, out + q1 * a.dv, std::numeric_limits<float>::quiet_NaN());
        return;
    }
    const std::unique_ptr<float[]> latent(new float[rows * rank]);  // rows [q0, q1) written
    by_head(q0, q1, a.heads, [&](int64_t h, const int64_t* qs, int64_t count) {
        const float* qn[DOT_ROWS];
        float* to[DOT_ROWS];
        for (int64_t i = 0; i < count; i++) {
            qn[i] = a.q_nope + b * a.qn_b + qs[i] / a.heads * a.qn_t + h * a.qn_h;
            to[i] = latent.get() + qs[i] * rank;
        }
        absorb_any<DOT_ROWS>(count, qn, a.kv_b + h * part, a.dn, rank, to);
    });
    const Queries q{latent.get(), a.q_pe + b * a.qp_b, a.heads * rank, rank, a.qp_t, a.qp_h, a.heads};
    std::vector<float> o((q1 - q0) * rank, 0.f);  // the weighted sums accumulate from zero
    attend(q, q0, q1, a.cache + a.slots[b] * a.capacity * (rank + a.rope), n, a.visible + b * a.steps * a.capacity,
           a.capacity, rank, a.rope, a.scale, o.data());
    by_head(q0, q1, a.heads, [&](int64_t h, const int64_t* qs, int64_t count) {
        const float* x[DOT_ROWS];
        for (int64_t i = 0; i < count; i++) x[i] = o.data() + (qs[i] - q0) * rank;
        const W* values = a.kv_b + h * part + a.dn * rank;
        for (int64_t j = 0; j < a.dv; j += O) {
            const W* w[O];
            for (int k = 0; k < O; k++) w[k] = values + std::min(j + k, a.dv - 1) * rank;
            float sums[DOT_ROWS][O];
            dots_any<DOT_ROWS>(count, x, w, rank, sums);
            for (int64_t i = 0; i < count; i++)
                for (int k = 0; k < O && j + k < a.dv; k++) out[qs[i] * a.dv + j + k] = sums[i][k];
        }
    });
}

template <typename W>
void kernel(const Call<W>& a, int64_t threads) {
    const int64_t rows = a.steps * a.heads;
    std::vector<int64_t> live(a.batch, 0);  // entries up to the last one any row of the request sees
    for (int64_t b = 0; b < a.batch; b++)
        for (int64_t t = 0; t < a.steps; t++)
            live[b] = std::max(live[b], visible_prefix(a.visible + (b * a.steps + t) * a.capacity, a.capacity));
    // A request's rows split into enough chunks for every thread to have one.
    const int64_t splits = std::min(rows, std::max<int64_t>(1, (threads + a.batch - 1) / a.batch));
    const int64_t chunk = (rows + splits - 1) / splits, chunks = (rows + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < a.batch * chunks; item++) {
        const int64_t b = item / chunks, q0 = (item % chunks) * chunk;
        attend_rows(a, b, q0, std::min(q0 + chunk, rows), live[b]);
    }
}

// The queries' rows are read in place by their strides over (B, T, H): a copy per layer would cost
// more than reading them there.
at::Tensor rows_in_place(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

// q_nope [B, T, H, dn], q_pe [B, T, H, rope], kv_b [H * (dn + dv), rank] (float32, or the bfloat16 copy
// of a weight of bfloat16 values that the bfloat16_reads pass hands the op), cache [N, S, rank + rope],
// slots [B], visible [B, T, S] -> out [B, T, H, dv].
at::Tensor live_attention(const at::Tensor& q_nope_in, const at::Tensor& q_pe_in, const at::Tensor& kv_b,
                          const at::Tensor& cache, const at::Tensor& slots_in, const at::Tensor& visible_in, double scale) {
    const char* op = "live_attention";
    check(q_nope_in, op, "q_nope", at::kFloat, 4);
    check(q_pe_in, op, "q_pe", at::kFloat, 4);
    check(kv_b, op, "kv_b", kv_b.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat, 2, true);
    check(cache, op, "cache", at::kFloat, 3, true);
    check(slots_in, op, "slots", at::kLong, 1);
    check(visible_in, op, "visible", at::kBool, 3);
    const int64_t batch = q_nope_in.size(0), steps = q_nope_in.size(1), heads = q_nope_in.size(2), dn = q_nope_in.size(3);
    const int64_t rope = q_pe_in.size(3), capacity = cache.size(1), rank = cache.size(2) - rope;
    TORCH_CHECK(rank >= 1, op, ": cache entries have ", cache.size(2), " values, not more than q_pe's ", rope);
    TORCH_CHECK(heads >= 1 && kv_b.size(0) % heads == 0 && kv_b.size(0) / heads > dn && kv_b.size(1) == rank, op,
                ": kv_b must be [", heads, " x (", dn, " + v), ", rank, "], got ", kv_b.sizes());
    TORCH_CHECK(q_pe_in.size(0) == batch && q_pe_in.size(1) == steps && q_pe_in.size(2) == heads, op, ": q_pe ", q_pe_in.sizes(), " does not match q_nope ", q_nope_in.sizes());
    TORCH_CHECK(slots_in.size(0) == batch, op, ": ", slots_in.size(0), " slots for ", batch, " requests");
    TORCH_CHECK(visible_in.sizes() == at::IntArrayRef({batch, steps, capacity}), op, ": visible must be ", at::IntArrayRef({batch, steps, capacity}), ", got ", visible_in.sizes());
    const at::Tensor q_nope = rows_in_place(q_nope_in), q_pe = rows_in_place(q_pe_in);
    const at::Tensor slots = slots_in.contiguous(), visible = visible_in.contiguous();
    const int64_t dv = kv_b.size(0) / heads - dn;
    at::Tensor out = at::empty({batch, steps, heads, dv}, q_nope.options());
    const auto call = [&](const auto* w) {
        const Call<std::remove_const_t<std::remove_pointer_t<decltype(w)>>> a{
            q_nope.data_ptr<float>(), q_pe.data_ptr<float>(), cache.data_ptr<float>(), w, slots.data_ptr<int64_t>(),
            visible.data_ptr<bool>(), out.data_ptr<float>(), batch, steps, heads, dn, dv, rank, rope, capacity,
            q_nope.stride(0), q_nope.stride(1), q_nope.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
            static_cast<float>(scale)};
        kernel(a, at::get_num_threads());
    };
    if (kv_b.scalar_type() == at::kBFloat16) call(reinterpret_cast<const uint16_t*>(kv_b.data_ptr()));
    else call(kv_b.data_ptr<float>());
    return out;
}

at::Tensor live_attention_meta(const at::Tensor& q_nope, const at::Tensor&, const at::Tensor& kv_b, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double) {
    const int64_t heads = q_nope.size(2);
    return at::empty({q_nope.size(0), q_nope.size(1), heads, kv_b.size(0) / heads - q_nope.size(3)}, q_nope.options());
}

}  // namespace

COMPILED_MTP_OP(live_attention,
                "(Tensor q_nope, Tensor q_pe, Tensor kv_b, Tensor cache, Tensor slots, Tensor visible, float scale) -> Tensor")

}  // namespace compiled_mtp
