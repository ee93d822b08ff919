// compiled_mtp::greedy_sample: the sampling ops' greedy path on CPU float32, for a batch whose
// requests are all greedy: each row's argmax in one vectorized pass (rows, and parts of a row when
// there are fewer rows than threads, split over the threads), then the accept test and the committed
// tokens in a few scalar steps per request. The results are the Python path's: torch's argmax (the
// first maximum; a NaN ranks above every number), p(d) 1 at the argmax and 0 elsewhere, and the test
// u * q(d) < p(d) in float32, as graphs.sampling.accept_drafts computes it. `done` is 0 where a
// request is sampled or a draft is out of the vocabulary: the caller then takes its general path.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros.h>

namespace compiled_mtp {
namespace {
constexpr int64_t BLOCK = 512;         // a block's maximum is found with vectors, its index only if it leads
constexpr int64_t MIN_SPLIT = 16384;  // the fewest logits a thread takes: less costs more to hand out than to read

struct Top { float value; int64_t index; };

// torch.argmax's order: a NaN ranks above every number, and an earlier index wins a tie.
static inline bool above(float x, float best) { return std::isnan(x) ? !std::isnan(best) : x > best; }
static inline bool matches(float x, float value) { return std::isnan(value) ? std::isnan(x) : x == value; }

static float block_max(const float* x, int64_t n) {
    Vec m(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(x + i));  // NaN propagates
    float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
    for (; i < n; i++) if (above(x[i], best)) best = x[i];
    return best;
}

// The first maximum of x[0, n), n >= 1.
static Top first_max(const float* x, int64_t n) {
    Top top{x[0], 0};
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        const int64_t b1 = std::min(b0 + BLOCK, n);
        const float m = block_max(x + b0, b1 - b0);
        if (!above(m, top.value)) continue;
        int64_t i = b0;
        while (!matches(x[i], m)) i++;
        top = Top{m, i};
    }
    return top;
}

// Each row's first maximum; rows, and parts of a row when there are fewer rows than threads, split
// over the threads.
static std::vector<int64_t> row_argmax(const float* logits, int64_t rows, int64_t vocab, int64_t threads) {
    // Each row in `splits` parts, so that every thread has one when rows are fewer than threads.
    const int64_t splits = std::max<int64_t>(1, std::min((threads + rows - 1) / rows, vocab / MIN_SPLIT));
    const int64_t part = (vocab + splits - 1) / splits;
    std::vector<Top> tops(rows * splits);
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * vocab >= MIN_SPLIT)
    for (int64_t item = 0; item < rows * splits; item++) {
        const int64_t row = item / splits, v0 = (item % splits) * part, v1 = std::min(v0 + part, vocab);
        Top top = first_max(logits + row * vocab + v0, v1 - v0);
        tops[item] = Top{top.value, top.index + v0};
    }
    std::vector<int64_t> argmax(rows);
    for (int64_t row = 0; row < rows; row++) {
        Top top = tops[row * splits];
        for (int64_t s = 1; s < splits; s++) if (above(tops[row * splits + s].value, top.value)) top = tops[row * splits + s];
        argmax[row] = top.index;
    }
    return argmax;
}

void kernel(const float* logits, const float* temperature, const int64_t* drafts, const float* draft_probs,
                       const float* noise, int64_t* num_accepted, int64_t* tokens, int64_t* done, int64_t batch,
                       int64_t steps, int64_t vocab, int64_t q_batch_stride, int64_t q_step_stride, int64_t q_vocab_stride,
                       int64_t threads) {
    const int64_t k = steps - 1, rows = batch * steps;
    done[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (!(temperature[b] <= 0.f)) return;  // a sampled request: the caller takes the general path
        for (int64_t i = 0; i < k; i++) if (drafts[b * k + i] < 0 || drafts[b * k + i] >= vocab) return;
    }
    const std::vector<int64_t> argmax = row_argmax(logits, rows, vocab, threads);
    for (int64_t b = 0; b < batch; b++) {
        int64_t a = 0;
        while (a < k) {
            const int64_t d = drafts[b * k + a];
            const float p = d == argmax[b * steps + a] ? 1.f : 0.f;
            const float q = draft_probs[b * q_batch_stride + a * q_step_stride + d * q_vocab_stride];
            if (!(noise[b * steps + a] * q < p)) break;
            a++;
        }
        const int64_t final_token = argmax[b * steps + a];
        for (int64_t i = 0; i < steps; i++) tokens[b * steps + i] = i < a ? drafts[b * k + i] : final_token;
        num_accepted[b] = a;
    }
    done[0] = 1;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits_in, const at::Tensor& temperature_in,
                                                             const at::Tensor& drafts_in, const at::Tensor& draft_probs,
                                                             const at::Tensor& noise_in) {
    const char* op = "greedy_sample";
    check(logits_in, op, "logits", at::kFloat, 3);
    check(temperature_in, op, "temperature", at::kFloat, 1);
    check(drafts_in, op, "drafts", at::kLong, 2);
    check(draft_probs, op, "draft_probs", at::kFloat, 3);
    check(noise_in, op, "noise", at::kFloat, 2);
    const int64_t batch = logits_in.size(0), steps = logits_in.size(1), vocab = logits_in.size(2);
    TORCH_CHECK(steps >= 1 && vocab >= 1, op, ": logits must hold at least one row and one token, got ", logits_in.sizes());
    TORCH_CHECK(temperature_in.size(0) == batch, op, ": temperature must be [", batch, "], got ", temperature_in.sizes());
    TORCH_CHECK(drafts_in.sizes() == at::IntArrayRef({batch, steps - 1}), op, ": drafts must be [", batch, ", ", steps - 1, "], got ", drafts_in.sizes());
    TORCH_CHECK(draft_probs.sizes() == at::IntArrayRef({batch, steps - 1, vocab}), op, ": draft_probs must be [", batch, ", ", steps - 1, ", ", vocab, "], got ", draft_probs.sizes());
    TORCH_CHECK(noise_in.sizes() == at::IntArrayRef({batch, steps}), op, ": noise must be [", batch, ", ", steps, "], got ", noise_in.sizes());
    const at::Tensor logits = logits_in.contiguous(), temperature = temperature_in.contiguous();
    const at::Tensor drafts = drafts_in.contiguous(), noise = noise_in.contiguous();
    at::Tensor num_accepted = at::empty({batch}, drafts.options()), tokens = at::empty({batch, steps}, drafts.options());
    at::Tensor done = at::empty({1}, drafts.options());
    kernel(logits.data_ptr<float>(), temperature.data_ptr<float>(), drafts.data_ptr<int64_t>(), draft_probs.data_ptr<float>(),
           noise.data_ptr<float>(), num_accepted.data_ptr<int64_t>(), tokens.data_ptr<int64_t>(), done.data_ptr<int64_t>(),
           batch, steps, vocab, draft_probs.stride(0), draft_probs.stride(1), draft_probs.stride(2), at::get_num_threads());
    return {num_accepted, tokens, done};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_sample_meta(const at::Tensor& logits, const at::Tensor&, const at::Tensor& drafts,
                                                                  const at::Tensor&, const at::Tensor&) {
    return {at::empty({logits.size(0)}, drafts.options()), at::empty({logits.size(0), logits.size(1)}, drafts.options()), at::empty({1}, drafts.options())};
}

// compiled_mtp::greedy_draft_sample: compiled_mtp::draft_sample (ops/draft_sample.py) whose greedy
// batches stay here: a batch of CPU float32 logits whose requests are all greedy gets each row's
// argmax and a one-hot q without a call into Python (a draft step's sampling cost more in that call
// than in its arithmetic); any other batch is handed to that op.
static bool all_greedy(const at::Tensor& logits, const at::Tensor& temperature) {
    if (!(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.numel() &&
          temperature.device().is_cpu() && temperature.scalar_type() == at::kFloat &&
          temperature.sizes() == at::IntArrayRef({logits.size(0)})))
        return false;
    const at::Tensor t = temperature.contiguous();
    const float* tp = t.data_ptr<float>();
    return std::all_of(tp, tp + t.numel(), [](float v) { return v <= 0.f; });
}

std::tuple<at::Tensor, at::Tensor> greedy_draft_sample(const at::Tensor& logits, const at::Tensor& temperature,
                                                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& u) {
    if (!all_greedy(logits, temperature)) {
        static const auto general = c10::Dispatcher::singleton()
            .findSchemaOrThrow("compiled_mtp::draft_sample", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const at::Tensor&)>();
        return general.call(logits, temperature, top_k, top_p, u);
    }
    const at::Tensor x = logits.contiguous();
    const int64_t batch = x.size(0), vocab = x.size(1);
    const std::vector<int64_t> argmax = row_argmax(x.data_ptr<float>(), batch, vocab, at::get_num_threads());
    at::Tensor tokens = at::empty({batch}, x.options().dtype(at::kLong)), q = at::zeros({batch, vocab}, x.options());
    int64_t* tp = tokens.data_ptr<int64_t>();
    float* qp = q.data_ptr<float>();
    for (int64_t b = 0; b < batch; b++) tp[b] = argmax[b], qp[b * vocab + argmax[b]] = 1.f;
    return {tokens, q};
}

std::tuple<at::Tensor, at::Tensor> greedy_draft_sample_meta(const at::Tensor& logits, const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, const at::Tensor&) {
    return {at::empty({logits.size(0)}, logits.options().dtype(at::kLong)), at::empty(logits.sizes(), logits.options().dtype(at::kFloat))};
}

// compiled_mtp::greedy_verify_sample: compiled_mtp::verify_sample (ops/verify_sample.py) whose greedy
// batches stay here, as greedy_draft_sample's do: a verify graph's batch of CPU float32 greedy
// requests is checked by greedy_sample's kernel without a call into Python; any other batch is handed
// to that op.
static bool fits_greedy_kernel(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& drafts,
                               const at::Tensor& draft_probs, const at::Tensor& noise) {
    if (!(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 3 && logits.numel()))
        return false;
    const int64_t batch = logits.size(0), steps = logits.size(1), vocab = logits.size(2);
    const auto is = [](const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
        return t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == sizes;
    };
    return is(temperature, at::kFloat, {batch}) && is(drafts, at::kLong, {batch, steps - 1}) &&
           is(draft_probs, at::kFloat, {batch, steps - 1, vocab}) && is(noise, at::kFloat, {batch, steps});
}

std::tuple<at::Tensor, at::Tensor> greedy_verify_sample(const at::Tensor& logits, const at::Tensor& temperature,
                                                        const at::Tensor& top_k, const at::Tensor& top_p,
                                                        const at::Tensor& drafts, const at::Tensor& draft_probs,
                                                        const at::Tensor& noise) {
    if (fits_greedy_kernel(logits, temperature, drafts, draft_probs, noise)) {
        auto [num_accepted, tokens, done] = greedy_sample(logits, temperature, drafts, draft_probs, noise);
        if (done.data_ptr<int64_t>()[0]) return {num_accepted, tokens};
    }
    static const auto general = c10::Dispatcher::singleton()
        .findSchemaOrThrow("compiled_mtp::verify_sample", "")
        .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return general.call(logits, temperature, top_k, top_p, drafts, draft_probs, noise);
}

std::tuple<at::Tensor, at::Tensor> greedy_verify_sample_meta(const at::Tensor& logits, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const at::Tensor& drafts, const at::Tensor&,
                                                             const at::Tensor&) {
    return {at::empty({logits.size(0)}, drafts.options()), at::empty({logits.size(0), logits.size(1)}, drafts.options())};
}

}  // namespace

COMPILED_MTP_OP(greedy_sample,
                "(Tensor logits, Tensor temperature, Tensor drafts, Tensor draft_probs, Tensor noise) -> (Tensor, Tensor, Tensor)")
COMPILED_MTP_OP(greedy_draft_sample,
                "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor u) -> (Tensor, Tensor)")
COMPILED_MTP_OP(greedy_verify_sample,
                "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor drafts, Tensor draft_probs, "
                "Tensor noise) -> (Tensor, Tensor)")

}  // namespace compiled_mtp
