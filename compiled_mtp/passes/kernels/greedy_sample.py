"""The greedy path of the sampling ops on CPU float32: a batch whose requests are all greedy is
verified (or drafted) in one C++ call.

Greedy decoding is the common case, and for it the sampling ops' Python paths cost more than their
arithmetic: about 20 small operations a call, and a single-threaded argmax. Measured on 2 cores
(B=1, K=3): the verify op took 0.36 ms at a 4096-token vocabulary and 0.65 ms at 129280, the draft
op 0.23 and 0.43 ms; at B=8 and 129280 tokens, 2.3 and 3.4 ms. Here each row's argmax is one
vectorized pass (the rows and, when there are fewer rows than threads, parts of each row split over
the threads), then the accept test and the committed tokens take a few scalar steps per request.

The results are the Python path's: the argmax is torch's (the first maximum; a NaN ranks above every
number, the first NaN wins), p(d) is 1 at the argmax and 0 elsewhere, and the accept test is
u * q(d) < p(d) in float32, as `graphs.sampling.accept_drafts` computes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import cpp_build

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
using Vec = at::vec::Vectorized<float>;
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

extern "C" void kernel(const float* logits, const float* temperature, const int64_t* drafts, const float* draft_probs,
                       const float* noise, int64_t* num_accepted, int64_t* tokens, int64_t* done, int64_t batch,
                       int64_t steps, int64_t vocab, int64_t q_batch_stride, int64_t q_step_stride, int64_t q_vocab_stride,
                       int64_t threads) {
    const int64_t k = steps - 1, rows = batch * steps;
    done[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (!(temperature[b] <= 0.f)) return;  // a sampled request: the caller takes the general path
        for (int64_t i = 0; i < k; i++) if (drafts[b * k + i] < 0 || drafts[b * k + i] >= vocab) return;
    }
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
"""

_ARGTYPES = ["const float*", "const float*", "const int64_t*", "const float*", "const float*", "int64_t*", "int64_t*", "int64_t*"]
_ARGTYPES += ["int64_t"] * 7


@functools.cache
def build() -> Callable[..., None] | None:
    """The compiled kernel (built on the first call in a process), or None where it does not build."""
    return cpp_build.load("greedy_sample", _ARGTYPES, _SOURCE, fallback="the sampling ops' Python paths")


def prepare(model: nn.Module) -> None:
    """Build the kernel now if `model`'s logits are CPU float32, so that the first step served does
    not wait for the compiler."""
    if cpp_build.serves(model):
        build()


def greedy_verify(
    logits: Tensor, temperature: Tensor, drafts: Tensor, draft_probs: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor] | None:
    """`graphs.sampling.verify_sample`'s (num_accepted [B], tokens [B, K+1]) when every request is
    greedy, the tensors are CPU float32 and the kernel is built; None otherwise (the caller then
    takes its general path). Arguments as that function's, less top_k and top_p, which greedy
    requests ignore."""
    if not _supports(logits, temperature, drafts, draft_probs, noise):
        return None
    kernel = build()
    if kernel is None:
        return None
    batch, steps, vocab = logits.shape
    logits, temperature, drafts, noise = (t.contiguous() for t in (logits, temperature, drafts, noise))
    num_accepted, tokens, done = drafts.new_empty(batch), drafts.new_empty(batch, steps), drafts.new_empty(1)
    kernel(logits, temperature, drafts, draft_probs, noise, num_accepted, tokens, done, batch, steps, vocab, *draft_probs.stride(), torch.get_num_threads())
    return (num_accepted, tokens) if done.item() else None


def _supports(logits: Tensor, temperature: Tensor, drafts: Tensor, draft_probs: Tensor, noise: Tensor) -> bool:
    """CPU float32 tensors of consistent shapes (the kernel reads by logits' shape), none empty."""
    if logits.dim() != 3 or logits.numel() == 0:
        return False
    batch, steps, vocab = logits.shape
    return (
        all(t.device.type == "cpu" for t in (logits, temperature, drafts, draft_probs, noise))
        and logits.dtype == temperature.dtype == draft_probs.dtype == noise.dtype == torch.float32 and drafts.dtype == torch.int64
        and temperature.shape == (batch,) and drafts.shape == (batch, steps - 1) and noise.shape == (batch, steps)
        and draft_probs.shape == (batch, steps - 1, vocab)
    )
