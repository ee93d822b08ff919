"""The CUDA kernel of `compiled_mtp::verify_sample` (Triton): on the GPU where there is one, else run by
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given

from compiled_mtp.graphs.sampling import verify_sample
from compiled_mtp.ops import verify_sample_triton as kernel
from tests.test_sampling import SETTINGS, verify_cases

# The kernel sums its softmax in another order than torch: a decision may differ where a uniform is
# this close to it.
NUDGE = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


def _commits_within_rounding(
    case: tuple[torch.Tensor, ...], request: int, accepted: torch.Tensor, tokens: torch.Tensor
) -> bool:
    """Whether the definition commits (accepted, tokens) for `request` with its uniforms moved by at most NUDGE."""
    one = tuple(t[request : request + 1] for t in case)
    noise = one[-1]
    for shift in itertools.product((-NUDGE, 0.0, NUDGE), repeat=noise.shape[1]):
        nudged = (noise + torch.tensor(shift)).clamp(0.0, 1.0 - 2.0**-24)
        a, t = verify_sample(*one[:-1], nudged)
        if a[0] == accepted and torch.equal(t[0], tokens):
            return True
    return False


def _assert_same_tokens(case: tuple[torch.Tensor, ...]) -> None:
    expected, got = (
        verify_sample(*case),
        tuple(t.cpu() for t in kernel.verify_sample_triton(*_on_device(*case))),
    )
    temperature = case[1]
    for b in range(len(temperature)):
        if expected[0][b] == got[0][b] and torch.equal(expected[1][b], got[1][b]):
            continue
        # Greedy rows take an argmax on both sides: they must agree exactly.
        assert temperature[b] > 0, f"greedy request {b} differs"
        assert _commits_within_rounding(case, b, got[0][b], got[1][b]), f"request {b} differs beyond rounding"


@SETTINGS
@given(verify_cases())
def test_triton_kernel_gives_the_traced_tokens(case):
    _assert_same_tokens(case)


def test_triton_kernel_over_several_blocks():
    """Rows longer than a block, so the online max/sum rescales and the CDF scan carries across blocks."""
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 6, 2, 2 * kernel.BLOCK + 37
    for trial in range(3):
        logits = torch.randn(batch, k + 1, vocab, generator=gen) * (1.0 + 3 * trial)
        q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, dim=-1)
        drafts = torch.where(
            torch.rand(batch, k, generator=gen) < 0.5,
            logits[:, :k].argmax(-1),
            torch.randint(0, vocab, (batch, k), generator=gen),
        )
        temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.0, 1.0])
        top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0])
        case = (
            logits,
            temperature,
            torch.zeros(batch, dtype=torch.long),
            top_p,
            drafts,
            q,
            torch.rand(batch, k + 1, generator=gen),
        )
        _assert_same_tokens(case)


def test_triton_row_stats_are_the_softmax_normalizer():
    """The online pass gives max(x) and sum(exp(x - max)) of x = logits / T."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 2, 3000, generator=gen) * 4
    temperature = torch.tensor([1.0, 0.3, 2.5])
    stats = kernel.OnlineSoftmax.of(*_on_device(logits, temperature))
    x = logits / temperature[:, None, None]
    torch.testing.assert_close(stats.row_max.cpu(), x.amax(-1))
    torch.testing.assert_close(stats.row_sum.cpu(), torch.exp(x - x.amax(-1, keepdim=True)).sum(-1))


def test_triton_kernel_residual_draw_after_rejections():
    """Drafts from a q close to p, rejected on purpose: the final token comes from the small residual
    max(p - q, 0), where any slip in p, q or the scan moves the draw. Half the final uniforms are 0,
    which must give the first token with residual mass, never one before it."""
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 32, 1, kernel.BLOCK + 300
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    q = torch.softmax(logits[:, :k] + 0.5 * torch.randn(batch, k, vocab, generator=gen), dim=-1)
    drafts = q.argmax(-1)
    final_u = torch.where(torch.arange(batch) % 2 == 0, 0.0, torch.rand(batch, generator=gen))
    noise = torch.cat([torch.full((batch, k), 1.0 - 2.0**-24), final_u[:, None]], dim=1)
    case = (
        logits,
        torch.ones(batch),
        torch.zeros(batch, dtype=torch.long),
        torch.ones(batch),
        drafts,
        q,
        noise,
    )
    assert (verify_sample(*case)[0] == 0).sum() >= batch // 2  # most drafts rejected
    _assert_same_tokens(case)


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compiled_mtp.ops import verify_sample_triton as k

ptrs = lambda *names: {name: "*fp32" for name in names}
stats = ptrs("logits_ptr", "temperature_ptr", "max_ptr", "sum_ptr")
kernels = [
    (k._row_stats, {**stats, "vocab": "i32", "ROWS": "constexpr", "BLOCK": "constexpr"}, {"ROWS": 4, "BLOCK": k.BLOCK}),
    (k._final_draw, {**stats, **ptrs("q_ptr", "u_ptr"), "out_ptr": "*i64", "vocab": "i32", "BLOCK": "constexpr"},
     {"BLOCK": k.BLOCK}),
]
for fn, signature, constexprs in kernels:
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    print(fn.fn.__name__, len(compiled.asm["cubin"]))
"""


def test_triton_kernels_compile_for_h100():
    """The interpreter checks what the kernels compute, not that they compile: Triton's compiler
    (with the ptxas its wheel ships) builds both for sm_90 without a GPU, in a process where they
    are not interpreted."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    built = dict(line.split() for line in done.stdout.splitlines())
    assert set(built) == {"_row_stats", "_final_draw"} and all(int(size) > 0 for size in built.values())
