"""Train the shipped default model: a small DeepSeek-V3-architecture checkpoint with one MTP layer.

What it trains
    A byte-level BPE tokenizer (`tokenizers`, 4096 ids, `<|endoftext|>` = id 0 = bos = eos) and a
    DeepSeek-V3 model built from the engine's own model code (`compiled_mtp.models.deepseek_v3`):
    12 target layers of MLA (q_lora_rank 128, kv_lora_rank 64, 4 heads) with hidden size 256, the first
    11 dense (intermediate size 1792) and the last one MoE (8 routed experts in 4 groups, top-2 from the
    best 2 groups, sigmoid scores with `e_score_correction_bias`, one shared expert), plus one MoE MTP
    layer (DeepSeek-V3's NextN layer: `eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])`, a decoder
    block, `shared_head.norm`, the target's lm_head). 20.80M parameters (1.15M of them in the MTP
    layer), 256-token training windows. The target is deep and the MTP layer small so that a draft
    step reads a small share of what a target forward reads (with the 1024-token draft vocabulary,
    0.05), as in DeepSeek-V3 (about 0.04). The dense MLPs are as wide as the 48 MB budget allows, so
    that a target forward reads more than a CPU's last-level cache holds, as a real model's weights
    do (docs/design.md, "The default model"). It also writes the token ranking for `draft_vocab`
    (draft_vocab.json), counted on the training files.

Data
    The Python standard library's own source: every `*.py` under `sysconfig.get_paths()["stdlib"]`,
    skipping site-packages and the test suites (`test`, `tests`, `idle_test` directories) and files that
    are not UTF-8, sorted by relative path. Every 20th file of that list (index % 20 == 0) is held out as
    evaluation text; the rest is training text (compiled_mtp/corpus.py, which `compiled-mtp bench` shares).
    Files are joined into one token stream, each preceded by `<|endoftext|>`. The text differs a little
    between Python versions (this was run on 3.11).

How
    Phase 1 (joint, as DeepSeek-V3 trains MTP): loss = CE(target, t_{i+1}) + 0.3 * CE(MTP, t_{i+2}), the
    MTP layer fed the target's post-final-norm hidden h_i and the embedding of t_{i+1}; AdamW, warmup then
    cosine decay. Phase 2 (self-distillation): target frozen, only the MTP layer trains, on
    KL(target's distribution for t_{i+2} given t_0..t_{i+1} || MTP's), which is exactly what greedy draft
    acceptance measures, at each draft depth the engine runs it (`--distill-depths`, default 3): depth j
    feeds the layer its own hidden from depth j - 1, as draft_decode does, and its KL weighs less, since
    a deeper draft is tested only after the ones before it were accepted. Phase 3 distills the same way
    on the checkpoint as it ships (bf16 values), on the target's own greedy continuations of training
    text (`--continuation-prompt` tokens of it, continued to `--continuation-len`): greedy decoding
    commits exactly such tokens and tests the drafts on them, where training text differs from the
    target's own choice at about two tokens in three. `--from DIR` runs phase 3 alone, on a checkpoint
    of phases 1 and 2. Every phase keeps the routers balanced the DeepSeek-V3 way (no auxiliary loss:
    after every step each expert's `e_score_correction_bias` moves by +-gamma towards the mean load).
    Forwards use the engine's `forward_target` / `forward_mtp` over a [B, T] block with slots = arange(B),
    a fresh zero cache per forward, positions = arange(T) and write_index = slot * T + position; autograd
    flows through the in-place MLA cache write.

    The result is saved with `save_checkpoint(..., dtype=torch.bfloat16)`, reloaded with `load_model`,
    and measured: held-out losses, and greedy draft acceptance of `reference_generate` at K = 1, 2, 3 on
    prefixes of held-out files. Everything is seeded (seed 0) and runs on a fixed number of threads
    (`--threads`, default 2), so a rerun on the same machine, Python and thread count gives the same
    checkpoint.

How long (the shipped run, on the 2 cores of an AMD EPYC of the Zen 4 generation)
    tokenizer and data 7 s; phase 1 32.5 min (1000 steps x 8 x 256 tokens = 2.05M tokens, ~0.6 epoch,
    ~1050 tokens/s); phase 2 10.0 min (500 steps, 3 depths); phase 3 about 4 min (800 continuations
    of 32 + 128 tokens; 200 steps, 2.5 min, two passes over them; two saves and reloads); the final
    measurement 1.2 min; a held-out evaluation (about 6 s) every `--eval-every` 250 steps. 47.9 min in
    all. Machines of this kind differ by up to 1.4x: the previous default, with MLPs of 1024, took 48
    to 58 min on them. The run writes train_log.json next to the checkpoint (loss curves, acceptance,
    samples, timings; `from` names the checkpoint a --from run started on).

Result (train_log.json)
    Held-out target CE 3.58 nats/token (3.48 bytes/token), MTP CE 3.62; teacher-forced MTP/target argmax
    agreement on held-out text 0.79; greedy K=1 draft acceptance 0.896 on 24 held-out prefixes x 64 new
    tokens (K=2: 1.67 accepted per step, K=3: 2.40, per position 0.88, 0.80, 0.71). The previous
    default (MLPs of 1024, 14.31M parameters, the same steps) measured K=1 0.866 and K=3 2.25 (0.87,
    0.74, 0.64). On the target's own text phase 3 moved that model's drafts by 2 to 7 points a
    position, where 200 more steps of phase 2 on training text moved them by -2 to +3
    (benchmarks/README.md, "Phase 3").

Run
    python scripts/train_default.py                # all three phases; writes compiled_mtp/default_model/
    python scripts/train_default.py --from DIR     # phase 3 alone, on DIR's checkpoint of phases 1 and 2
    A smoke test, about 6 min here: --out /tmp/m --steps 50 --distill-steps 10 --continuation-steps 10
    --continuation-prompts 80.
    The shipped checkpoint is one run of all three phases, with the defaults.
"""

from __future__ import annotations

import os

# A fixed thread count everywhere (torch below, and the tokenizers Rust pool), so a rerun on the same
# machine sums in the same order and gives the same checkpoint.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from compiled_mtp.corpus import acceptance_prompts, split, stdlib_files  # noqa: E402
from compiled_mtp.models.checkpoint import load_model, save_checkpoint  # noqa: E402
from compiled_mtp.models.config import ModelConfig  # noqa: E402
from compiled_mtp.models.deepseek_v3 import DeepseekV3, Router  # noqa: E402
from compiled_mtp.models.draft_vocab import token_ranking, write_ranking  # noqa: E402
from compiled_mtp.reference import reference_generate  # noqa: E402

EOT = "<|endoftext|>"
# Phases 2 and 3's weight on each draft depth's KL (distill_loss).
DEPTH_WEIGHTS = (1.0, 0.8, 0.6)
GENERATE_BATCH = 64  # prompts continued at once in phase 3 (about 1 ms a token at 64-256 here)
# Not standard-library text: the sample prompt (tests/test_default_model.py guards acceptance on it).
SAMPLE_PROMPT = '''import os


class Cache:
    """A small least-recently-used cache."""

    def __init__(self, size=128):
        self.size = size
        self.data = {}

    def get(self, key, default=None):
        if key not in self.data:
            return default
        value = self.data.pop(key)
        self.data[key] = value
        return value

    def set(self, key, value):
'''

CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1792,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 11,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}


# ----------------------------------------------------------------------------------------------- data


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOT) == 0 and tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for text in texts:
        ids.append(0)
        ids.extend(tok.encode(text).ids)
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------------------------------------- model


def init_model(cfg: ModelConfig, seed: int) -> DeepseekV3:
    torch.manual_seed(seed)
    model = DeepseekV3(cfg)
    out_std = 0.02 / math.sqrt(2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    return model


def block_args(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions, write indices and slots for a [b, t] training block in a fresh [.., b, t, ..] cache."""
    slots = torch.arange(b)
    pos = torch.arange(t)[None].expand(b, t)
    return pos, slots[:, None] * t + pos, slots


def target_hidden(model: DeepseekV3, x: torch.Tensor) -> torch.Tensor:
    b, t = x.shape
    pos, wi, slots = block_args(b, t)
    cache = torch.zeros(model.cfg.num_hidden_layers, b, t, model.cfg.cache_dim)
    return model.forward_target(x, pos, wi, slots, cache)


def mtp_hidden(model: DeepseekV3, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """MTP row i reads t_{i+1} (next_tokens[:, i]) and h_i (hidden[:, i]); its logits predict t_{i+2}."""
    b, t = next_tokens.shape
    pos, wi, slots = block_args(b, t)
    cache = torch.zeros(1, b, t, model.cfg.cache_dim)
    return model.forward_mtp(0, next_tokens, hidden, pos, wi, slots, cache)


class RouterLoads:
    """Records each router's expert choices per forward; `rebalance` applies DeepSeek-V3's bias update."""

    def __init__(self, model: DeepseekV3) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.choices: dict[int, list[torch.Tensor]] = {id(r): [] for r in self.routers}
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def reset(self) -> None:
        for picks in self.choices.values():
            picks.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, module, inputs, output) -> None:
        self.choices[id(module)].append(output[0].detach())

    @torch.no_grad()
    def rebalance(self, gamma: float, only=None) -> list[float]:
        """b_e += gamma * sign(mean load - load_e); returns max/mean load per router (1.0 = balanced)."""
        imbalance = []
        for r in self.routers:
            picks = self.choices[id(r)]
            self.choices[id(r)] = []
            if not picks or (only is not None and r not in only):
                continue
            load = torch.bincount(
                torch.cat([p.reshape(-1) for p in picks]), minlength=r.cfg.n_routed_experts
            ).float()
            r.e_score_correction_bias.add_(gamma * torch.sign(load.mean() - load))
            imbalance.append(float(load.max() / load.mean()))
        return imbalance


# ------------------------------------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def adamw(params: list[torch.nn.Parameter], lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


@torch.no_grad()
def evaluate(model: DeepseekV3, windows: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Held-out target CE, MTP CE (vs the true t_{i+2}), and teacher-forced draft agreement: the fraction of
    rows where the MTP's argmax equals the target's argmax for the same token t_{i+2}."""
    sums = {"target_loss": 0.0, "mtp_loss": 0.0, "target_acc": 0.0, "agree": 0.0}
    n_t = n_m = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        x = w[:, :-1]
        h = target_hidden(model, x)
        lt = model.logits(h)
        hm = mtp_hidden(model, x[:, 1:], h[:, :-1])
        lm = model.logits(hm)
        sums["target_loss"] += F.cross_entropy(lt.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        sums["target_acc"] += (lt.argmax(-1) == w[:, 1:]).sum().item()
        sums["mtp_loss"] += F.cross_entropy(lm.flatten(0, 1), w[:, 2:].flatten(), reduction="sum").item()
        sums["agree"] += (lm.argmax(-1) == lt[:, 1:].argmax(-1)).sum().item()
        n_t += w[:, 1:].numel()
        n_m += w[:, 2:].numel()
    return {
        "target_loss": sums["target_loss"] / n_t,
        "target_acc": sums["target_acc"] / n_t,
        "mtp_loss": sums["mtp_loss"] / n_m,
        "agree": sums["agree"] / n_m,
    }


def windows_of(stream: np.ndarray, length: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens; `count` of them evenly spaced, or all."""
    n = (len(stream) - 1) // length
    starts = np.arange(n) * length
    if count is not None and count < n:
        starts = starts[np.linspace(0, n - 1, count).round().astype(int)]
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]))


def train_joint(model, stream, held, args, log) -> None:
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = adamw(params, args.lr, args.weight_decay)
    loads = RouterLoads(model)
    rng = np.random.default_rng(args.seed)
    t = args.seq_len
    n_windows = (len(stream) - 2) // (t + 1)
    order = rng.permutation(n_windows)
    offset = int(rng.integers(0, t + 1))
    start = time.time()
    ema = None
    for step in range(args.steps):
        idx = order[(step * args.batch + np.arange(args.batch)) % n_windows]
        w = torch.from_numpy(
            np.stack([stream[offset + i * (t + 1) : offset + (i + 1) * (t + 1)] for i in idx])
        )
        x = w[:, :-1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loads.reset()
        h = target_hidden(model, x)
        lt = F.cross_entropy(model.logits(h).flatten(0, 1), w[:, 1:].flatten())
        hm = mtp_hidden(model, x[:, 1:], h[:, :-1])
        lm = F.cross_entropy(model.logits(hm).flatten(0, 1), w[:, 2:].flatten())
        loss = lt + args.mtp_weight * lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, args.clip))
        opt.step()
        imbalance = loads.rebalance(args.bias_gamma)
        cur = np.array([lt.item(), lm.item()])
        ema = cur if ema is None else 0.95 * ema + 0.05 * cur
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - start
            print(
                f"[joint {step:4d}/{args.steps}] target {cur[0]:.3f} mtp {cur[1]:.3f} (ema {ema[0]:.3f} {ema[1]:.3f}) "
                f"gnorm {gnorm:.2f} lr {opt.param_groups[0]['lr']:.2e} load max/mean {max(imbalance):.2f} "
                f"{(step + 1) * args.batch * t / el:.0f} tok/s {el / 60:.1f} min",
                flush=True,
            )
            log["joint_train"].append(
                {"step": step, "target": float(ema[0]), "mtp": float(ema[1]), "min": el / 60}
            )
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            ev = evaluate(model, held)
            print(f"[joint {step + 1:4d}] held-out {fmt(ev)}", flush=True)
            log["joint_eval"].append({"step": step + 1, **ev})
    log["joint_minutes"] = (time.time() - start) / 60
    loads.remove()
    for p in params:
        p.requires_grad_(False)


def train_distill(model, windows, steps: int, lr: float, held, args, log, phase: str) -> None:
    """Target frozen; the MTP layer learns the target's own distribution at each draft depth
    (distill_loss), on `windows(step)` ([distill_batch, T] tokens) for `steps` steps."""
    mtp = model.model.layers[model.cfg.num_hidden_layers]
    params = list(mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = adamw(params, lr, args.weight_decay)
    loads = RouterLoads(model)
    start = time.time()
    ema = None
    for step in range(steps):
        x = windows(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, 20)
        loads.reset()
        with torch.no_grad():
            h = target_hidden(model, x)
            p_log = F.log_softmax(model.logits(h), dim=-1)  # row i: the target's view of t_{i+1}
        loss = distill_loss(model, x, h, p_log, args.distill_depths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        loads.rebalance(args.bias_gamma, only=[m for m in mtp.modules() if isinstance(m, Router)])
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == steps - 1:
            el = time.time() - start
            print(
                f"[{phase} {step:4d}/{steps}] KL {loss.item():.3f} (ema {ema:.3f}) {el / 60:.1f} min",
                flush=True,
            )
            log[f"{phase}_train"].append({"step": step, "kl": float(ema), "min": el / 60})
        if (step + 1) % args.eval_every == 0 or step == steps - 1:
            ev = evaluate(model, held)
            print(f"[{phase} {step + 1:4d}] held-out {fmt(ev)}", flush=True)
            log[f"{phase}_eval"].append({"step": step + 1, **ev})
    log[f"{phase}_minutes"] = (time.time() - start) / 60
    loads.remove()
    for p in params:
        p.requires_grad_(False)


def text_windows(stream: np.ndarray, args) -> Callable[[int], torch.Tensor]:
    """Phase 2's windows: `seq_len` tokens of training text at a random offset, in a seeded order."""
    rng = np.random.default_rng(args.seed + 1)
    t = args.seq_len
    n_windows = (len(stream) - 1) // t
    order = rng.permutation(n_windows)
    offset = int(rng.integers(0, t))

    def windows(step: int) -> torch.Tensor:
        idx = order[(step * args.distill_batch + np.arange(args.distill_batch)) % n_windows]
        return torch.from_numpy(np.stack([stream[offset + i * t : offset + (i + 1) * t] for i in idx]))

    return windows


def continuations(model: DeepseekV3, stream: np.ndarray, args) -> torch.Tensor:
    """Phase 3's `continuation_prompts` windows: `continuation_prompt` tokens of training text, each at
    a seeded random place, then the target's own greedy continuation up to `continuation_len` tokens:
    greedy decoding tests the drafts on exactly such tokens. Phase 3 takes them in order,
    `distill_batch` a step, and from the first again once all were used."""
    rng = np.random.default_rng(args.seed + 2)
    count, length = args.continuation_prompts, args.continuation_prompt
    starts = rng.integers(0, len(stream) - length, count)
    prompts = torch.from_numpy(np.stack([stream[s : s + length] for s in starts]))
    start = time.time()
    total = args.continuation_len
    out = torch.cat([greedy_continue(model, p, total) for p in prompts.split(GENERATE_BATCH)])
    print(f"[continuation] {count} x {total} tokens in {(time.time() - start) / 60:.1f} min", flush=True)
    return out


@torch.no_grad()
def greedy_continue(model: DeepseekV3, prompts: torch.Tensor, total: int) -> torch.Tensor:
    """[B, P] prompts continued greedily by the target to [B, total] tokens."""
    b, p = prompts.shape
    cache = model.new_cache(model.cfg.num_hidden_layers, b, total)
    slots = torch.arange(b)
    out = torch.cat([prompts, prompts.new_zeros(b, total - p)], dim=1)
    tokens, positions = prompts, torch.arange(p)[None].expand(b, p)
    for t in range(p, total):
        h = model.forward_target(tokens, positions, slots[:, None] * total + positions, slots, cache)
        out[:, t] = model.logits(h[:, -1]).argmax(-1)
        tokens, positions = out[:, t : t + 1], torch.full((b, 1), t)
    return out


def distill_loss(model, x: torch.Tensor, h: torch.Tensor, p_log: torch.Tensor, depths: int) -> torch.Tensor:
    """KL(target || MTP) at draft depths 1..`depths`, as the engine drafts: depth 1's row i reads t_{i+1}
    and the target's h_i; depth j's row i reads t_{i+j} and M's own hidden from depth j - 1's row i, and
    predicts t_{i+j+1}. A deeper draft counts for less (DEPTH_WEIGHTS): it is tested only when every
    draft before it was accepted."""
    t = x.shape[1]
    hidden, loss = h[:, :-1], h.new_zeros(())
    for j in range(1, depths + 1):
        rows = t - j
        hm = mtp_hidden(model, x[:, j : j + rows], hidden[:, :rows])
        q_log = F.log_softmax(model.logits(hm), dim=-1)
        kl = F.kl_div(
            q_log.flatten(0, 1), p_log[:, j : j + rows].flatten(0, 1), log_target=True, reduction="batchmean"
        )
        loss = loss + DEPTH_WEIGHTS[j - 1] * kl
        hidden = hm
    return loss


def fmt(d: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in d.items())


# -------------------------------------------------------------------------------------------- measure


def measure_acceptance(model: DeepseekV3, prompts: list[list[int]], new_tokens: int) -> dict:
    out = {}
    plain = reference_generate(model, prompts, new_tokens, 0)
    for k in (1, 2, 3):
        res = reference_generate(model, prompts, new_tokens, k)
        assert all(r.token_ids == p.token_ids for r, p in zip(res, plain)), (
            "speculative output differs from greedy"
        )
        acc = [a for r in res for a in r.accepted]
        out[f"K{k}"] = {
            "steps": len(acc),
            "accepted_per_step": sum(acc) / len(acc),
            "acceptance_rate": sum(acc) / (k * len(acc)),
            "per_position": [sum(a >= j for a in acc) / len(acc) for j in range(1, k + 1)],
        }
    return out


def first_phases(args, train_stream, held, data: dict) -> tuple[dict, DeepseekV3]:
    """A fresh model through phase 1 (joint) and phase 2 (distillation on text); the training log,
    `data`'s counts of files and tokens in it."""
    cfg = ModelConfig.from_dict(CONFIG)
    model = init_model(cfg, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    mtp_params = sum(p.numel() for p in model.model.layers[cfg.num_hidden_layers].parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({mtp_params / 1e6:.2f}M in the MTP layer)", flush=True)
    log: dict = {
        "config": CONFIG,
        "args": args_of(args),
        "python": sys.version.split()[0],
        **data,
        "parameters": n_params,
        "mtp_parameters": mtp_params,
        "joint_train": [],
        "joint_eval": [],
        "distill_train": [],
        "distill_eval": [],
    }
    train_joint(model, train_stream, held, args, log)
    if args.distill_steps:
        windows = text_windows(train_stream, args)
        train_distill(model, windows, args.distill_steps, args.distill_lr, held, args, log, "distill")
    return log, model


def start_problem(directory: Path) -> str | None:
    """Why phase 3 cannot start from `directory` alone, or None: it needs a checkpoint this script
    wrote after phases 1 and 2, and running phase 3 twice is not the recipe."""
    log = directory / "train_log.json"
    if not log.is_file():
        return "has no train_log.json: give a checkpoint this script wrote"
    if json.loads(log.read_text()).get("continuation_train"):
        return "has been through phase 3 already: give a checkpoint of phases 1 and 2"
    return None


def args_of(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def save_and_reload(model: DeepseekV3, tok: Tokenizer, train_files, train_stream, out: Path) -> DeepseekV3:
    """Write the checkpoint (bf16), its tokenizer and draft-vocabulary ranking; the model as the
    engine loads it."""
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, CONFIG, out, dtype=torch.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    ranking = token_ranking((tok.encode(t).ids for _, t in train_files), CONFIG["vocab_size"])
    write_ranking(out, ranking, f"{len(train_files)} files, {len(train_stream) - len(train_files)} tokens")
    return load_model(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "compiled_mtp" / "default_model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=0.003)
    ap.add_argument("--distill-steps", type=int, default=500)
    ap.add_argument("--distill-depths", type=int, default=3, choices=range(1, len(DEPTH_WEIGHTS) + 1))
    ap.add_argument("--distill-batch", type=int, default=8)
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--continuation-steps", type=int, default=200)
    ap.add_argument("--continuation-prompts", type=int, default=800)
    ap.add_argument("--continuation-prompt", type=int, default=32)
    ap.add_argument("--continuation-len", type=int, default=160)
    ap.add_argument("--continuation-lr", type=float, default=5e-4)
    ap.add_argument(
        "--from",
        dest="start",
        type=Path,
        help="a checkpoint this script wrote: skip phases 1 and 2 and run phase 3 on it",
    )
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--accept-prompts", type=int, default=24)
    ap.add_argument("--accept-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.continuation_steps and args.continuation_prompts < 1:
        ap.error(f"--continuation-prompts must be at least 1 (got {args.continuation_prompts})")
    problem = args.start and start_problem(args.start)
    if problem:
        raise SystemExit(f"error: --from: {args.start} {problem}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    files = stdlib_files()
    train_files, held_files = split(files)
    print(
        f"stdlib {sysconfig.get_paths()['stdlib']}: "
        f"{len(files)} files, {len(train_files)} train, {len(held_files)} held out",
        flush=True,
    )
    if args.start is None:
        tok = train_tokenizer([t for _, t in train_files], CONFIG["vocab_size"])
    else:
        tok = Tokenizer.from_file(str(args.start / "tokenizer.json"))
    train_stream = token_stream(tok, [t for _, t in train_files])
    held_stream = token_stream(tok, [t for _, t in held_files])
    train_bytes = sum(len(t.encode()) for _, t in train_files)
    print(
        f"tokenizer + data {time.time() - t0:.0f}s: train {len(train_stream)} tokens "
        f"({train_bytes / len(train_stream):.2f} bytes/token), "
        f"held out {len(held_stream)} tokens",
        flush=True,
    )
    held = windows_of(held_stream, args.seq_len + 1, args.eval_windows)
    ship = partial(save_and_reload, tok=tok, train_files=train_files, train_stream=train_stream, out=args.out)

    if args.start is None:
        data = {
            "files": {"train": len(train_files), "held_out": len(held_files)},
            "tokens": {"train": len(train_stream), "held_out": len(held_stream)},
        }
        log, model = first_phases(args, train_stream, held, data)
        model = ship(model)
        log["train_minutes"] = (time.time() - t0) / 60
    else:
        log = json.loads((args.start / "train_log.json").read_text())
        log["from"] = {"dir": str(args.start), "args": log["args"], "train_minutes": log["train_minutes"]}
        log["args"] = args_of(args)
        model = load_model(args.start)
    # Phase 3 runs on the checkpoint as it ships (bf16 values), so a run --from a checkpoint of phases
    # 1 and 2 gives what one run of all three does.
    log["continuation_train"], log["continuation_eval"] = [], []
    phase3 = time.time()
    if args.continuation_steps:
        windows = continuations(model, train_stream, args).split(args.distill_batch)
        steps, lr = args.continuation_steps, args.continuation_lr
        train_distill(
            model, lambda step: windows[step % len(windows)], steps, lr, held, args, log, "continuation"
        )
        model = ship(model)
    log["train_minutes"] += (time.time() - phase3) / 60

    # Measure what ships: the bf16 checkpoint as the engine loads it.
    shipped = model
    log["held_out_shipped"] = evaluate(shipped, held)
    print(f"shipped checkpoint held-out {fmt(log['held_out_shipped'])}", flush=True)
    prompts = acceptance_prompts(lambda text: tok.encode(text).ids, held_files, args.accept_prompts, 64)
    log["acceptance"] = measure_acceptance(shipped, prompts, args.accept_new_tokens)
    log["acceptance"]["prompts"] = len(prompts)
    for k, v in log["acceptance"].items():
        print(f"acceptance {k}: {v}", flush=True)
    log["samples"] = []
    for prompt in (tok.encode(SAMPLE_PROMPT).ids, prompts[0]):
        res = reference_generate(shipped, [prompt], 64, 1)[0]
        sample = {
            "prompt": tok.decode(prompt),
            "greedy": tok.decode(res.token_ids),
            "k1_acceptance": sum(res.accepted) / len(res.accepted),
        }
        log["samples"].append(sample)
        print(
            f"--- sample prompt:\n{sample['prompt']}\n"
            f"--- greedy continuation (K=1 acceptance {sample['k1_acceptance']:.3f}):\n"
            f"{sample['greedy']}\n---",
            flush=True,
        )
    log["total_minutes"] = (time.time() - t0) / 60
    log["sizes_bytes"] = {
        p.name: p.stat().st_size
        for p in sorted(args.out.iterdir())
        if p.is_file() and p.name != "train_log.json"
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"done in {log['total_minutes']:.1f} min; sizes {log['sizes_bytes']}", flush=True)


if __name__ == "__main__":
    main()
