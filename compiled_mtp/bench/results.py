"""The bench's results: what each system measured, the bound and the goals, as written to the JSON."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Meta:
    """What was run, where, and on which prompts."""

    model: str
    device: str
    device_name: str
    dtype: str
    backend: str
    threads: int
    torch: str
    transformers: str
    python: str
    date: str
    new_tokens: int
    prompt_len: int
    runs: int
    depths: list[int]
    batch_sizes: list[int]
    prompt_source: str  # "held-out" or "random"
    prompts: str  # where the prompts came from, for people
    accept_prompts: int
    draft_vocab: int | None = None  # drafts among this many most frequent tokens (None: all)
    hf_attention: str = ""
    bfloat16_mlps: bool = False  # the dense MLPs multiplied in bfloat16 (--bfloat16-mlps)
    compiles: int = 0
    recompiles: int = 0


@dataclass
class Acceptance:
    """Greedy draft acceptance at depth K over the acceptance prompts."""

    k: int
    acceptance_length: float  # tokens per request and decode step, in [1, K + 1]
    acceptance_rate: float  # accepted / drafted
    per_position: list[float]  # acceptance rate of draft position 1..K
    draft_tokens: int
    accepted_tokens: int


@dataclass
class EngineRun:
    """compiled_mtp at depth K (or "auto") and batch B."""

    k: int | str
    batch: int
    tokens_per_s: float  # prompts * new tokens / best wall seconds (prefill included)
    decode_tokens_per_s: float  # prompts * (new tokens - 1) / its decode seconds: what speculation changes
    seconds: float  # best run
    iteration_ms: float  # decode-only wall time per step of the best run
    host_ms: float  # runtime Python outside graph calls per step
    host_share: float  # host_ms / iteration_ms
    acceptance_length: float  # tokens per request and decode step over the timed runs
    decode_steps: int  # of the best run
    bound_tokens_per_s: float = 0.0  # the memory-bandwidth bound at this K, B and acceptance length
    speedup: float = 0.0  # decode_tokens_per_s over K=0's at this B (the bound counts no prefill either)
    bound_speedup: float = 0.0  # bound_tokens_per_s over K=0's
    bound_fraction: float = 0.0  # speedup / bound_speedup
    roofline_tokens_per_s: float = 0.0  # the roofline (bytes or multiply-adds) at this K, B and acc. length
    roofline_speedup: float = 0.0  # roofline_tokens_per_s over K=0's
    depth_histogram: dict[int, int] | None = None  # auto: decode steps run at each depth, timed runs
    decode_runs: list[float] = field(default_factory=list)  # decode tok/s of each timed run, by round


@dataclass
class HFRun:
    """HF transformers at batch B: `generate` (k = 0) or `generate(use_mtp=True)` (k = its draft count)."""

    system: str
    k: int
    batch: int
    tokens_per_s: float
    seconds: float
    acceptance_length: float | None = None  # generate(use_mtp=True) only
    acceptance_rate: float | None = None


@dataclass
class PeerRun:
    """Another engine on the same checkpoint, prompts and token counts, timed in turns with ours at
    B = 1: llama.cpp's plain greedy decoding, and its MTP speculative decoding at each depth."""

    system: str
    batch: int
    tokens_per_s: float
    seconds: float
    same_tokens: bool  # its greedy tokens equal the engine's
    first_difference: int | None = None  # index of the first token that differs
    drafted: int | None = None  # MTP rows: drafts made and accepted in the compared generation
    accepted: int | None = None


@dataclass
class Bound:
    """Weight bytes per step over measured bandwidth: the most steps per second memory allows. The
    bandwidth is the faster of a large copy's (memory's) and a warm read of as many bytes as a step
    reads (`resident_bytes_per_s`): where a step's weights stay in the cache between steps, the cache's
    speed bounds it, not memory's."""

    copy_bytes: int  # size of the tensor copied
    bandwidth_bytes_per_s: float  # best of 5 copies, read + written bytes over seconds
    target_bytes: int  # read by one target forward of one row
    mtp_step_bytes: list[int]  # read by one draft step of one row, per MTP layer
    steps_per_s: dict[str, float]  # by "K/B": the faster bandwidth / (target + K draft steps + routed)
    resident_bytes_per_s: float = 0.0  # best of 5 reads of target + one draft step's bytes, just read
    routed_bytes: dict[str, int] = field(default_factory=dict)  # by "K/B": routed experts beyond one row's
    expert_count: int = 0  # routed experts of a MoE layer (0: a dense model)
    verify_experts: dict[str, float] = field(default_factory=dict)  # by "K/B": read a target MoE layer
    flops_per_s: float = 0.0  # the best of 5 large torch.mm products, float operations over seconds
    target_flops: int = 0  # of one target forward's weights, per row
    mtp_step_flops: list[int] = field(default_factory=list)  # of one draft step's, per row and MTP layer
    extend_row_flops: int = 0  # of MTP layer 0's parts a draft extend runs on every row of its block, per row
    roofline_steps_per_s: dict[str, float] = field(default_factory=dict)  # by "K/B": bytes or arithmetic
    # Rows from which the ops' products of bfloat16 weights run faster than float32's (on AMX's tiles,
    # or from 1 row on the bfloat16 dot products, --bfloat16-mlps); 0: none do.
    tile_rows: int = 0
    tile_flops_per_s: float = 0.0  # their rate: the best of 5 such products of 16 rows, on weights in cache


@dataclass
class Goal:
    """A ratio the project's goals are about; `goal` None for ratios reported for context only."""

    id: str
    name: str
    value: float | None
    goal: float | None
    met: bool | None
    detail: str


@dataclass
class BenchResult:
    meta: Meta
    acceptance: list[Acceptance]
    engine: list[EngineRun]
    hf: list[HFRun]
    bound: Bound
    peers: list[PeerRun]
    goals: list[Goal]


def engine_row(runs: list[EngineRun], k: int | str, b: int) -> EngineRun | None:
    """The row of depth `k` at batch `b`, if measured."""
    return next((r for r in runs if r.k == k and r.batch == b), None)
