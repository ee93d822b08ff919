"""`compiled_mtp::verify_sample` on CUDA: Triton kernels for requests sampled at a temperature.

Such a request's K+1 rows are read once each, by `_row_stats`, with an online max and sum of
exp(logits / T - max); p(d) of each draft then comes from those two numbers, with no probabilities
ever written out. `_final_draw` reads row a once more for the residual's total and draws the final
token with the inverse CDF in a second pass. Greedy requests take torch's argmax, top-k/top-p
requests the traced definition (a sort on the GPU), both as on the CPU.

For the same noise the tokens equal the definition's wherever no uniform lies within float rounding
of a decision (accept test or CDF step): the softmax here is summed in another order.
Without CUDA, TRITON_INTERPRET=1 runs these kernels on CPU tensors; the tests use that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..graphs.sampling import processed_probs
from .verify_sample import Probs, Rows, verify_by_kind

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the CPU kernel serves every graph
    triton = None

BLOCK = 1024


def available() -> bool:
    return triton is not None


def verify_sample_triton(*inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The CUDA kernel. Arguments (compiled_mtp::verify_sample's) and results as
    `graphs.sampling.verify_sample`."""
    return verify_by_kind(OnlineSoftmax.of, _traced_rows, *inputs)


def _traced_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Probs:
    """Top-k/top-p requests: the traced definition (a sort of each row, on the GPU)."""
    return Probs(processed_probs(logits, temperature[:, None], top_k[:, None], top_p[:, None]))


@dataclass
class OnlineSoftmax(Rows):
    """Requests sampled at temperature T alone: their logits [R, K+1, V] and, per row, the max of
    logits / T and the sum of exp(logits / T - max) [R, K+1]."""

    logits: Tensor
    temperature: Tensor
    row_max: Tensor
    row_sum: Tensor

    @classmethod
    def of(cls, logits: Tensor, temperature: Tensor) -> OnlineSoftmax:
        logits = logits.contiguous()
        requests, rows, vocab = logits.shape
        temperature = temperature.float().contiguous()
        row_max, row_sum = (logits.new_empty(requests, rows) for _ in range(2))
        if requests:
            _row_stats[(requests * rows,)](
                logits, temperature, row_max, row_sum, vocab, ROWS=rows, BLOCK=BLOCK
            )
        return cls(logits, temperature, row_max, row_sum)

    def p_draft(self, drafts: Tensor) -> Tensor:
        at_draft = self.logits[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)
        return torch.exp(at_draft / self.temperature[:, None] - self.row_max[:, :-1]) / self.row_sum[:, :-1]

    def final(self, a: Tensor, q_a: Callable[[], Tensor], u: Tensor) -> Tensor:
        requests, _, vocab = self.logits.shape
        if not requests:
            return a.new_empty(0)
        pick = (
            torch.arange(requests, device=a.device),
            a,
        )  # row a of each request, gathered into fresh contiguous tensors
        tokens = torch.empty(requests, dtype=torch.long, device=a.device)
        _final_draw[(requests,)](
            self.logits[pick],
            self.temperature,
            self.row_max[pick],
            self.row_sum[pick],
            q_a().contiguous(),
            u.float().contiguous(),
            tokens,
            vocab,
            BLOCK=BLOCK,
        )
        return tokens


if triton is not None:

    @triton.jit
    def _row_stats(
        logits_ptr, temperature_ptr, max_ptr, sum_ptr, vocab, ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One program per row: max and sum of exp(x - max) of x = logits / T, in one read."""
        row = tl.program_id(0)
        t = tl.load(temperature_ptr + row // ROWS)
        base = logits_ptr + row.to(tl.int64) * vocab
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")) / t
            new_m = tl.maximum(m, tl.max(x, 0))
            total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        tl.store(max_ptr + row, m)
        tl.store(sum_ptr + row, total)

    @triton.jit
    def _residual(logits_ptr, q_ptr, offs, mask, t, m, total):
        """p and max(p - q, 0) at `offs` of one row."""
        p = tl.exp(tl.load(logits_ptr + offs, mask=mask, other=float("-inf")) / t - m) / total
        q = tl.load(q_ptr + offs, mask=mask, other=0.0)
        return p, tl.maximum(p - q, 0.0)

    @triton.jit
    def _final_draw(
        logits_ptr, temperature_ptr, max_ptr, sum_ptr, q_ptr, u_ptr, out_ptr, vocab, BLOCK: tl.constexpr
    ):
        """One program per request, on its row a: a token from normalize(max(p - q, 0)), from p if
        that is empty, as `graphs.sampling.residual_draw`: the first index whose cumulative mass
        exceeds u * total, capped at the last token with mass."""
        row = tl.program_id(0)
        t, m, total = tl.load(temperature_ptr + row), tl.load(max_ptr + row), tl.load(sum_ptr + row)
        logits_ptr += row.to(tl.int64) * vocab
        q_ptr += row.to(tl.int64) * vocab
        p_mass = tl.full((), 0.0, tl.float32)
        r_mass = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            p, r = _residual(logits_ptr, q_ptr, offs, offs < vocab, t, m, total)
            p_mass += tl.sum(p, 0)
            r_mass += tl.sum(r, 0)
        use_residual = r_mass > 0
        threshold = tl.load(u_ptr + row) * tl.where(use_residual, r_mass, p_mass)
        below = tl.full((), 0.0, tl.float32)
        first = tl.full((), 0, tl.int32) + vocab
        last_positive = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            p, r = _residual(logits_ptr, q_ptr, offs, mask, t, m, total)
            mass = tl.where(use_residual, r, p)
            cdf = below + tl.cumsum(mass, 0)
            first = tl.minimum(first, tl.min(tl.where(mask & (cdf > threshold), offs, vocab), 0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(mask & (mass > 0), offs, 0), 0))
            below += tl.sum(mass, 0)
        tl.store(out_ptr + row, tl.minimum(first, last_positive).to(tl.int64))

    torch.library.register_kernel("compiled_mtp::verify_sample", "cuda", verify_sample_triton)
