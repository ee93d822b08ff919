"""Runtime: requests, batching, sampling parameters, stop rules and statistics.

The runtime does no per-token tensor work: each decode step it builds three small integer/noise
tensors (slots, sequence lengths, uniforms), replays the graphs its step plan names for (B, K)
(graphs/plan.py) and reads back the accepted counts and committed tokens.
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .capture.cache import user_cache
from .capture.compiler import CompiledGraphs
from .capture.profile import DEFAULT_MODEL
from .depth_policy import DepthPolicy
from .graphs.plan import PREFILL, GraphKey, StepPlan, graph_keys, step_plan
from .graphs.state import StaticState
from .models.checkpoint import load_model
from .models.draft_vocab import read_ranking
from .models.family import CausalLM
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. temperature 0 is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    """A finished (or, from `step`, running) request."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    text: str | None = None  # the decoded tokens, when the checkpoint has a tokenizer
    # Drafts the target accepted at each decode step with K > 0, in order, counted before a stop
    # token or max_new_tokens cut the step's tokens (num_accepted_tokens counts only emitted ones).
    accepted_per_step: list[int] = field(default_factory=list)


class StepOutput(NamedTuple):
    """Tokens a request gained in one `step()`; `output` is the whole result once it finished.
    A named tuple, not a frozen dataclass: the runtime makes one per request and step, on caches the
    step's graphs have just emptied, where a frozen dataclass's field-by-field setattr costs 6 us."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None = None


def _last_tokens(out: RequestOutput, n: int) -> list[int]:
    """The request's last n tokens, prompt included, zeros before its first: without copying the whole
    prompt and output, which a catch-up's Python would at every request."""
    tail = out.token_ids[-n:]
    if len(tail) < n:
        tail = out.prompt_token_ids[len(tail) - n :] + tail
    return [0] * (n - len(tail)) + tail


@dataclass
class _Request:
    out: RequestOutput
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    slot: int = -1
    seq_len: int = 0  # committed tokens, prompt included
    lag: int = 0  # positions M has not run over yet (depth-0 steps since it last caught up)
    drafted: int = 0  # drafts d_1.. in the state that are current (the last step or prefill drew them)
    rates: list[float] = field(default_factory=list)  # acceptance per draft position (auto depth)
    wanted: int = 0  # tokens it may still emit, max_new_tokens at first


@dataclass
class _Stats:
    steps: int = 0
    committed: int = 0  # tokens emitted by decode steps
    request_steps: int = 0
    proposed: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)
    host_seconds: float = 0.0  # decode steps' Python time outside graph calls
    depths: Counter[int] = field(default_factory=Counter)  # decode steps run at each depth

    def record(self, depth: int, emitted: int, accepted: int) -> None:
        grow = depth - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        self.request_steps += 1
        self.committed += emitted
        for j in range(depth):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted


class _KeptInts:
    """A step's integer input kept across steps: the graphs read it before the next step rewrites it.
    Written only when its values change (a batch's slots stay), and through struct: the Python between
    a step's graphs runs on caches the graphs have just emptied, where numpy's slice write of a list
    costs about twice as much, and a new tensor several times more."""

    __slots__ = ("_buffer", "_pack", "tensor", "values")

    def __init__(self, n: int) -> None:
        self.tensor = torch.zeros(n, dtype=torch.long)
        self.values: list[int] = []
        self._pack = struct.Struct(f"{n}q").pack_into  # native order and size: torch.long's
        self._buffer = self.tensor.numpy().data.cast("B")

    def holding(self, values: list[int]) -> torch.Tensor:
        if values != self.values:
            self._pack(self._buffer, 0, *values)
            self.values = values
        return self.tensor


class Runtime:
    """MTP speculative decoding over captured graphs keyed by (batch bucket, depth)."""

    def __init__(
        self,
        model: CausalLM,
        *,
        mtp_depth: int | str = 3,
        mtp_depths: Sequence[int] | None = None,
        batch_sizes: Sequence[int] = (1, 2, 4, 8),
        max_seq_len: int | None = None,
        compile_backend: str = "inductor",
        passes: Sequence[str] | None = None,
        prefill_chunk: int | None = None,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        depths = _depths(mtp_depth, mtp_depths, model.num_mtp_layers)
        if depths[0] < 0:
            raise ValueError(f"mtp_depth: must be >= 0, got {depths[0]}")
        if depths[-1] > 0 and model.num_mtp_layers == 0:
            raise ValueError(f"mtp_depth: {depths[-1]} needs MTP layers, but the model has none (use 0)")
        buckets = sorted({_integer(b, "batch_sizes:") for b in batch_sizes})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"batch_sizes: must be positive integers, got {list(batch_sizes)}")
        max_seq_len = _max_seq_len(max_seq_len, model.cfg.max_position_embeddings)
        if prefill_chunk is None:  # 64 rows a prefill call, fewer when the cache is shorter
            prefill_chunk = min(64, max_seq_len)
        if not 1 <= prefill_chunk <= max_seq_len:
            raise ValueError(f"prefill_chunk: must be in [1, max_seq_len={max_seq_len}], got {prefill_chunk}")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.cfg.vocab_size
        self.eos_ids = frozenset(model.cfg.eos_token_ids)
        self.depths = tuple(depths)
        self.buckets = tuple(buckets)
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.state = _static_state(model, buckets[-1], max_seq_len, depths[-1])
        keys = tuple(graph_keys(self.buckets, self.depths))
        self.graphs = CompiledGraphs(
            model, self.state, compile_backend, None if passes is None else tuple(passes), cache_dir, keys
        )
        self._depth = mtp_depth
        self._policy = DepthPolicy(depths)
        # Auto's steps that repeat a held choice without asking the policy (DepthPolicy.repeats): how
        # many are left for the running batch, their (bucket, depth) and the wall times not yet told.
        self._repeats, self._repeated = 0, (0, 0)
        self._repeat_seconds: list[float] = []
        self._device = model.lm_head.weight.device
        # Read at every decode step, on caches its graphs have just emptied, where a lookup through
        # the torch objects that hold them costs microseconds: kept as plain values.
        self._on_cpu = self._device.type == "cpu"
        self._bucket_of = [min(s for s in self.buckets if s >= b) for b in range(self.buckets[-1] + 1)]
        self._lag_window, self._scratch_slot = self.state.lag_window, self.state.scratch_slot
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}
        self._free = list(range(buckets[-1]))[::-1]
        self._stats = _Stats()
        self._held: list[StepOutput] = []  # other requests' outputs from steps run by generate()
        self._greedy_noise: dict[tuple[int, int], list[torch.Tensor]] = {}  # (bucket, depth) -> uniforms
        self._step_inputs: dict[tuple[str, int], _KeptInts] = {}  # see _step_ints

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path = "default",
        mtp_depth: int | str = 3,
        batch_sizes: Sequence[int] = (1, 2, 4, 8),
        max_seq_len: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        cache_dir: str | Path | bool | None = True,
        draft_vocab: int | None = None,
        **options: Any,
    ) -> Runtime:
        """Load an HF-layout checkpoint directory (DeepSeek-V3 or GLM-4 MoE) and prepare its graphs. `path` "default"
        (the default) is the model shipped with the package, `compiled_mtp.DEFAULT_MODEL`.

        `mtp_depth` is the draft depth K of every step, or "auto": each step's K is chosen among the
        captured depths (`mtp_depths`, default 0..3) from the graphs' measured cost and the running
        requests' acceptance (see depth_policy.py). `draft_vocab=N` drafts among the checkpoint's N
        most frequent tokens (its draft_vocab.json, from `compiled-mtp calibrate`): a cheaper draft
        head, the same output (verification stays exact). `max_seq_len` (prompt and output, the
        caches' positions a request) is at most the checkpoint's max_position_embeddings; by default
        that or 2048, the fewer.

        Options: `mtp_depths` (extra depths to allow switching to), `compile_backend` ("inductor",
        "aot_eager" or "eager"), `passes` (names of the custom FX passes to run, of
        `passes.manager.available()`; None = all, () = none), `prefill_chunk` (prompt tokens per prefill call,
        default min(64, max_seq_len)), `seed` (for requests
        without one). `cache_dir` is a capture cache (CPU only): graphs are loaded from it, and those
        it lacks are built once and stored there. True (the default) is the per-user cache,
        `capture.cache.user_cache()`, on CPU (on CUDA graphs compile in the process); None or False
        compiles every graph in the process. A runtime loads every stored graph whose key matches
        its settings (model, dtype, buckets, depths, max_seq_len, passes), whoever stored it."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
        check_device(device)
        if path == "default":
            path = DEFAULT_MODEL
        if cache_dir is True or cache_dir is False:
            cache_dir = user_cache() if cache_dir and torch.device(device).type == "cpu" else None
        with_mtp = max(_depths(mtp_depth, options.get("mtp_depths"), mtp_layers=1)) > 0  # as if it has them
        model = load_model(path, dtype=DTYPES[dtype], device=device, with_mtp=with_mtp)
        if draft_vocab is not None:
            vocab = model.cfg.vocab_size
            if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
                raise ValueError(f"draft_vocab: must be an integer in [1, {vocab}], got {draft_vocab!r}")
            model.restrict_drafts(torch.tensor(read_ranking(path, vocab)[:draft_vocab]))
        return cls(
            model,
            mtp_depth=mtp_depth,
            batch_sizes=batch_sizes,
            max_seq_len=max_seq_len,
            cache_dir=cache_dir,
            tokenizer=Tokenizer.find(path),
            **options,
        )

    @property
    def mtp_depth(self) -> int | str:
        """The depth of every decode step, or "auto"."""
        return self._depth

    @mtp_depth.setter
    def mtp_depth(self, depth: int | str) -> None:
        if depth != "auto" and depth not in self.depths:
            raise ValueError(
                f"mtp_depth: {depth} is not one of the captured depths {list(self.depths)} (or 'auto')"
            )
        self._depth = depth
        self._repeats = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None) -> int:
        """Queue a request (token ids, or text when the checkpoint has a tokenizer); returns its id.
        Raises ValueError (naming the field) on bad input. Weights updated in place since the last
        request reach every graph from this one on."""
        params = params or SamplingParams()
        prompt_ids = self.check(prompt, params)
        self.graphs.follow_weights()
        return self._queue(prompt_ids, params)

    @property
    def num_slots(self) -> int:
        """Requests that can run at once (the largest batch bucket); more wait for a free slot."""
        return self.buckets[-1]

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free slot."""
        return len(self._waiting)

    def _queue(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a request `_check` has passed."""
        seed = (
            operator.index(params.seed)
            if params.seed is not None
            else int(torch.randint(2**62, (), generator=self._seeds))
        )
        greedy = params.temperature == 0
        stop_ids = frozenset(map(operator.index, params.stop_token_ids))  # a torch integer hashes by identity
        req = _Request(
            out=RequestOutput(next(self._ids), prompt),
            params=params,
            stop_ids=stop_ids | (frozenset() if params.ignore_eos else self.eos_ids),
            generator=None if greedy else torch.Generator().manual_seed(seed),
            rates=self._policy.prior(),
            wanted=operator.index(params.max_new_tokens),
        )
        self._waiting.append(req)
        return req.out.request_id

    def abort(self, request_id: int) -> RequestOutput | None:
        """Cancel a request (a client went away). A waiting request leaves the queue; a running one
        leaves the batch, and its slot is free for the next `step()` to admit a waiting request into.
        `step()` returns nothing more for it. Returns its output so far, with finish_reason "abort";
        None, changing nothing, when the id is unknown or already finished (a disconnect may race
        with the request's last step)."""
        req = next(
            (r for r in (*self._waiting, *self._running.values()) if r.out.request_id == request_id), None
        )
        if req is None:
            return None
        if req.slot < 0:  # not admitted yet
            self._waiting.remove(req)
        self._finish(req, "abort")
        return req.out

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or outputs that step() has yet to return."""
        return bool(self._waiting or self._running or self._held)

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one SamplingParams for all or one per prompt. Every prompt and
        SamplingParams is checked before any is queued: on a ValueError nothing was added. Requests
        added with add_request keep running alongside; what they gain meanwhile is returned by the
        next step(), so a caller streaming them loses no token."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: expected 1 or {len(prompts)} SamplingParams, got {len(params)}")
        checked = [self.check(p, sp, where=f"prompts[{i}]") for i, (p, sp) in enumerate(zip(prompts, params))]
        self.graphs.follow_weights()
        ids = [self._queue(p, sp) for p, sp in zip(checked, params)]
        wanted, done = set(ids), dict[int, RequestOutput]()
        while len(done) < len(ids):
            for s in self._step():
                if s.request_id not in wanted:
                    self._held.append(s)  # a streamed request's: the caller's next step() returns it
                elif s.output is not None:
                    done[s.request_id] = s.output
        return [done[i] for i in ids]

    def step(self) -> list[StepOutput]:
        """Admit waiting requests (prefill) while slots are free, then run one speculative step for
        every running request. Returns the tokens each request gained, after those that requests
        not its own gained during a `generate` call since the last step()."""
        held, self._held = self._held, []
        return held + self._step()

    def _step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while self._waiting and self._free:
            outputs.append(self._prefill(self._waiting.popleft()))
        if self._running:
            start, graph_seconds = time.perf_counter(), self.graphs.seconds
            outputs += self._decode(list(self._running.values()))
            self._stats.host_seconds += time.perf_counter() - start - (self.graphs.seconds - graph_seconds)
        return outputs

    def check(self, prompt: Sequence[int] | str, params: SamplingParams, where: str = "prompt") -> list[int]:
        """Validate a request as `add_request` does, without queueing it; returns the prompt's token ids.
        Raises ValueError naming the field (`where` names the prompt). Reads only settings fixed at
        construction, so a thread other than the one stepping the runtime may call it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: must be a list of token ids (this checkpoint has no tokenizer)")
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, Iterable):
            raise ValueError(f"{where}: must be text or a sequence of token ids, got {type(prompt).__name__}")
        prompt = [self._token_id(t, f"{where}[{i}]") for i, t in enumerate(prompt)]
        if not prompt:
            raise ValueError(f"{where}: must not be empty")
        if _integer(params.max_new_tokens, "max_new_tokens:") < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {params.max_new_tokens}")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"max_new_tokens: prompt length {len(prompt)} + max_new_tokens {params.max_new_tokens} "
                f"exceeds max_seq_len {self.max_seq_len}"
            )
        if not 0 <= params.temperature < math.inf:  # inf or nan would sample from garbage
            raise ValueError(f"temperature: must be finite and >= 0 (0 = greedy), got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {params.top_p}")
        if _integer(params.top_k, "top_k:") < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = no limit), got {params.top_k}")
        if params.seed is not None and not 0 <= _integer(params.seed, "seed:") <= MAX_SEED:
            raise ValueError(f"seed: must be in [0, 2**63 - 1] or None, got {params.seed}")
        for i, t in enumerate(params.stop_token_ids):
            self._token_id(t, f"stop_token_ids[{i}]")
        return prompt

    # -- internals ------------------------------------------------------------------------------

    def _token_id(self, t: object, where: str) -> int:
        """An integer-like token id (int, NumPy or torch integer) in [0, vocab_size)."""
        t = _integer(t, f"{where}: token id")
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"{where}: token id {t} outside [0, {self.vocab_size})")
        return t

    def _tensor(self, values: Iterable) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self._device)

    def _step_ints(self, name: str, values: list[int]) -> torch.Tensor:
        """A decode step's integer input `name` (slots, lengths): on CPU the tensor kept for that name
        and length, holding `values` (docs/design.md, "The decode loop as graphs")."""
        if not self._on_cpu:
            return self._tensor(values)
        kept = self._step_inputs.get((name, len(values)))
        if kept is None:
            kept = self._step_inputs[name, len(values)] = _KeptInts(len(values))
        return kept.holding(values)

    def _noise(self, reqs: Sequence[_Request], rows: int, width: int) -> torch.Tensor:
        """Uniforms [rows, width], each request's row from its own generator (greedy rows: zeros)."""
        noise = torch.zeros(rows, width)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i] = torch.rand(width, generator=r.generator)
        return noise.to(self._device)

    def _step_noise(
        self, reqs: Sequence[_Request], bucket: int, k: int, plan: StepPlan
    ) -> list[torch.Tensor]:
        """draft_decode's, target_verify's and draft_extend's uniforms for a step, each request's drawn
        at once. A batch of greedy requests takes zeros, the same tensors at every step of its bucket
        and depth: the Python between a step's graphs runs on caches the graphs have just emptied,
        where each tensor it makes costs microseconds."""
        greedy = not any(r.generator is not None for r in reqs)
        if greedy and (bucket, k) in self._greedy_noise:
            return self._greedy_noise[bucket, k]
        noise = self._noise(reqs, bucket, plan.uniforms)
        columns = [noise[:, c] for c in plan.columns]  # strides as the graphs were built for
        if greedy:
            self._greedy_noise[bucket, k] = columns
        return columns

    def _prefill(self, req: _Request) -> StepOutput:
        req.slot = self._free.pop()
        self.graphs.begin_step()
        p = req.params
        self.state.set_sampling(req.slot, p.temperature, p.top_k, p.top_p)
        prompt, c = req.out.prompt_token_ids, self.prefill_chunk
        padded = prompt + [0] * (-len(prompt) % c + 1)
        noise = self._noise([req], 1, PREFILL.uniforms)
        slot, n = self._tensor([req.slot]), self._tensor([len(prompt)])
        for start in range(0, len(prompt), c):
            tokens = self._tensor(padded[start : start + c])[None]
            following = self._tensor(padded[start + 1 : start + c + 1])[None]
            first = self.graphs(PREFILL, tokens, following, slot, self._tensor([start]), n, noise)
        req.seq_len = len(prompt)
        req.drafted = 1 if self.state.mtp_cache.shape[0] else 0
        self._running[req.slot] = req
        self._repeats = 0  # a held choice is the batch's
        return self._commit(req, [int(first)], depth=None, accepted=0)

    def _choose_depth(self, reqs: list[_Request], bucket: int) -> tuple[int, bool]:
        """The step's depth, and whether it repeats auto's held choice, its time told to the policy
        later (record_repeats)."""
        if isinstance(self._depth, int):  # else "auto"
            return self._depth, False
        if self._repeats:
            self._repeats -= 1
            return self._repeated[1], True
        if self._repeat_seconds:
            self._policy.record_repeats(*self._repeated, self._repeat_seconds)
            del self._repeat_seconds[:]
        k = self._policy.choose(bucket, [r.rates for r in reqs], [r.wanted for r in reqs])
        self._repeats, self._repeated = self._policy.repeats, (bucket, k)
        return k, False

    def _decode(self, reqs: list[_Request]) -> list[StepOutput]:
        b = len(reqs)
        bucket = self._bucket_of[b]
        k, repeat = self._choose_depth(reqs, bucket)
        plan = step_plan(bucket, k, self.depths)
        self.graphs.begin_step()
        pad = bucket - b
        slots = self._step_ints("slots", [r.slot for r in reqs] + [self._scratch_slot] * pad)
        lens = self._step_ints("lens", [r.seq_len for r in reqs] + [1] * pad)
        window = self._lag_window
        if plan.catch_up and any(r.lag for r in reqs):
            began = time.perf_counter()
            self._catch_up(plan.catch_up, reqs, slots, lens)
            if self._depth == "auto":
                self._policy.record_catch_up(bucket, time.perf_counter() - began)
        elif plan.fill and any(r.lag >= window for r in reqs):
            self._catch_up(plan.fill, reqs, slots, lens)
        start = time.perf_counter()
        decode_noise, verify_noise, extend_noise = self._step_noise(reqs, bucket, k, plan)
        if plan.draft_decode and any(r.drafted < k for r in reqs):
            drafted = self._step_ints("drafted", [r.drafted for r in reqs] + [0] * pad)
            self.graphs(plan.draft_decode, slots, lens, drafted, decode_noise)
        accepted, committed, hidden = self.graphs(plan.target_verify, slots, lens, verify_noise)
        if plan.draft_extend:
            self.graphs(plan.draft_extend, slots, lens, accepted, committed, hidden, extend_noise)
        self._stats.steps += 1
        self._stats.depths[k] += 1
        accepted_l, committed_l = accepted.tolist(), committed.tolist()
        for r in reqs:
            r.lag += k == 0 and window > 0
            r.drafted = k
        outputs = [
            self._commit(r, committed_l[i][: accepted_l[i] + 1], k, accepted_l[i]) for i, r in enumerate(reqs)
        ]
        if repeat:
            self._repeat_seconds.append(time.perf_counter() - start)
        elif self._depth == "auto":  # a fixed depth's steps pay for no policy's bookkeeping
            if k:  # a depth-0 step tests no draft
                self._policy.observe([r.rates for r in reqs], k, accepted_l)
            self._policy.record_cost(bucket, k, time.perf_counter() - start)
        return outputs

    def _catch_up(self, key: GraphKey, reqs: list[_Request], slots: torch.Tensor, lens: torch.Tensor) -> None:
        """M over the positions depth-0 steps left it behind on: with fresh d_1 drafts (mtp_catch_up), or
        its cache entries alone (mtp_fill)."""
        window, bucket = self._lag_window, key.batch
        tokens = [_last_tokens(r.out, window) for r in reqs] + [[0] * window] * (bucket - len(reqs))
        lags = self._tensor([r.lag for r in reqs] + [0] * (bucket - len(reqs)))
        inputs = [slots, lens, lags, self._tensor(itertools.chain.from_iterable(tokens)).view(bucket, window)]
        if key.uniforms:
            inputs.append(self._noise(reqs, bucket, key.uniforms))
        self.graphs(key, *inputs)
        for r in reqs:
            r.lag = 0
            r.drafted = int(key.uniforms > 0)  # mtp_catch_up drafts d_1, mtp_fill none

    def _commit(self, req: _Request, tokens: list[int], depth: int | None, accepted: int) -> StepOutput:
        """Emit committed tokens up to the first stop token and max_new_tokens; count only those.
        `depth` is None for the token a prefill samples."""
        out, room = req.out, req.wanted
        emitted = tokens[:room]
        reason = "length" if len(tokens) >= room else None
        if not req.stop_ids.isdisjoint(emitted):  # walked only where a stop token came
            end = next(i for i, t in enumerate(emitted) if t in req.stop_ids) + 1
            emitted, reason = emitted[:end], "stop"
        out.token_ids += emitted
        req.wanted -= len(emitted)
        req.seq_len += len(tokens)
        if depth is not None:
            # Drafts are the first `accepted` committed tokens; the last one is the target's own.
            counted = min(accepted, len(emitted))
            out.num_draft_tokens += depth
            out.num_accepted_tokens += counted
            if depth:
                out.accepted_per_step.append(accepted)
            self._stats.record(depth, len(emitted), counted)
        if reason is not None:
            self._finish(req, reason)
        return StepOutput(out.request_id, emitted, reason is not None, reason, out if reason else None)

    def _finish(self, req: _Request, reason: str) -> None:
        """Close the request's output; a running request leaves the batch and frees its slot."""
        req.out.finish_reason = reason
        req.out.text = self.tokenizer.decode(req.out.token_ids) if self.tokenizer else None
        if req.slot >= 0:
            del self._running[req.slot]
            self._free.append(req.slot)
            self._repeats = 0

    def reset_stats(self) -> None:
        """Start the decode statistics (acceptance, steps, depths, host time) afresh; the graph
        counters (replays, compiles, recompiles, graph seconds) keep counting."""
        self._stats = _Stats()

    def stats(self) -> dict:
        """Acceptance length (tokens per request and decode step, depth-0 steps included), per-position
        acceptance (rates and counts), decode steps per depth, replays per graph key, compiles and recompiles."""
        s = self._stats
        return {
            "acceptance_length": acceptance_length(s.committed, s.request_steps),
            "request_steps": s.request_steps,
            "acceptance_rate_per_position": [a / p if p else 0.0 for a, p in zip(s.accepted, s.proposed)],
            "draft_tokens_per_position": list(s.proposed),
            "accepted_tokens_per_position": list(s.accepted),
            "draft_tokens": sum(s.proposed),
            "accepted_tokens": sum(s.accepted),
            "decode_steps": s.steps,
            "host_seconds": s.host_seconds,
            "host_seconds_per_step": s.host_seconds / s.steps if s.steps else 0.0,
            "graph_seconds": self.graphs.seconds,
            "depth_histogram": dict(sorted(s.depths.items())),
            "graph_replays": {key.name: n for key, n in self.graphs.replays.items()},
            "compiles": self.graphs.compiles,
            "recompiles": self.graphs.recompiles,
        }


def _depths(mtp_depth: int | str, extra: Sequence[int] | None, mtp_layers: int) -> list[int]:
    """The captured depths: `mtp_depth` and `extra`; "auto" adds 0 and, by default, 1..3 when the model
    has MTP layers."""
    extra = [_integer(k, "mtp_depths:") for k in extra or ()]
    if mtp_depth == "auto":
        return sorted({0, *(extra or (range(1, 4) if mtp_layers else ()))})
    if isinstance(mtp_depth, bool) or not isinstance(mtp_depth, int):
        raise ValueError(f"mtp_depth: must be an integer >= 0 or 'auto', got {mtp_depth!r}")
    return sorted({*extra, mtp_depth})


def _max_seq_len(max_seq_len: int | None, positions: int) -> int:
    """The cache's positions a request: at most the checkpoint's max_position_embeddings, whose rotary
    embedding the model was trained for; by default that or 2048, the fewer."""
    if max_seq_len is None:
        return min(2048, positions)
    n = _integer(max_seq_len, "max_seq_len:")
    if not 1 <= n <= positions:
        raise ValueError(
            f"max_seq_len: must be in [1, {positions}] (the checkpoint's max_position_embeddings), got {n}"
        )
    return n


def _static_state(model: CausalLM, slots: int, max_seq_len: int, max_depth: int) -> StaticState:
    """The runtime's caches, or a ValueError naming the settings that size them where memory cannot
    hold them."""
    try:
        return StaticState(model, slots, max_seq_len, max_depth)
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; on CPU, the allocator's own
        if "allocate" not in str(e):
            raise
        raise ValueError(
            f"max_seq_len: the caches of {slots} slots (the largest of batch_sizes) x {max_seq_len} positions "
            f"do not fit in memory; lower max_seq_len or batch_sizes"
        ) from None


def acceptance_length(committed: int, request_steps: int) -> float:
    """Tokens committed per request and decode step (a target step; the token a prefill samples is not
    counted): 1.0 at depth 0, at most K + 1. 1.0 before any decode step, the value without drafts."""
    return committed / request_steps if request_steps else 1.0


def _integer(value: Any, what: str) -> int:
    """`value` as an int when it is integer-like (int, NumPy or torch integer; not bool); `what` leads
    the error, e.g. "seed:"."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def check_device(device: str | torch.device) -> None:
    """A one-line error for a device this torch cannot use, before anything is loaded onto it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: must be cpu or cuda[:N], got {device!r}") from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(
                f"device: {device} needs a CUDA build of torch; this one ({torch.__version__}) is CPU-only, use cpu"
            )
        count = torch.cuda.device_count()
        if (device.index or 0) >= count:
            raise ValueError(f"device: {device} is not available ({count} CUDA devices visible)")
    elif device.type != "cpu":
        raise ValueError(f"device: must be cpu or cuda[:N], got {str(device)!r}")
