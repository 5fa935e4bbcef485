"""Fit a tiny checkpoint to text: a few minutes of next-token training on CPU (seconds on a GPU).

The random tiny model's logits are flat: about one greedy step in ten has a top-2 margin under
0.05 nats, bf16/fp8 noise flips it, and one flip changes every later token, so free-running
greedy agreement between two correct serving paths says little. A fitted model's margins are
decisive, but after minutes of training its free-running answers are a loop (e.g. spaces) the
same for every prompt; ``tools/flip_proxy.py`` measures both, on the answers and on real text.

Training runs our own modules with autograd: ``layer.project`` → causal attention over the
sequence's own latent rows → ``layer.finish`` → ``model.logits``, with sequences no longer than
``index_topk`` so that every position attends to all earlier ones, exactly as ``forward_tokens``
does in that regime (the test holds the two to the same logits). The indexer is trained as
DeepSeek-V3.2's dense warm-up stage trains it: a KL loss from the main attention's distribution
(summed over heads, L1-normalised) to the softmax of its index scores, its inputs detached so
that only the indexer learns from it (``--index-weight 0`` leaves it as initialised). A random
indexer selects keys the fitted attention weighs heavily and drops others; two implementations
that break its near-ties differently then attend different keys that matter. The router's
score-correction biases are written back unchanged. By default a step runs its sequences as one
batch through ``tools/fit_fast.py`` (the same logits in MLA's per-head form, attention through
SDPA, the indexer's KL on sampled rows); ``--forward reference`` runs the form described here.
The output directory has the layout and ``config.json`` of ``corpusd model init``'s, weights in
bf16.

    python -m tools.fit_tiny --src MODEL_DIR --out OUT_DIR [--steps 200] [--minutes 12]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from corpusd.cli import add_dataclass_flags
from corpusd.corpus.layout import FILE_HEADER
from corpusd.model import DeepseekV32, KVCache, load_model, save_checkpoint
from corpusd.testing import span_qa
from corpusd.testing.decode import greedy, model_device
from corpusd.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from tools.copy_sanity import COPY_IDS, copy_loss
from tools.fit_fast import attention_kl, train_forward_batch

ROOT = Path(__file__).resolve().parent.parent
_GENERATED = ("corpusd/v1/",)  # protobuf output: serialized descriptors, not text worth fitting


def default_text_files(root: Path = ROOT) -> list[Path]:
    """README.md, corpusd/**/*.py and holder/**/*.py (generated code left out), sorted."""
    files = [p for d in ("corpusd", "holder") for p in sorted((root / d).rglob("*.py"))]
    files = [p for p in files if not p.relative_to(root).as_posix().startswith(_GENERATED)]
    return [root / "README.md", *files]


def render_files(files: list[Path], root: Path, errors: str = "strict") -> str:
    """The files as a pinned corpus renders them (``FILE_HEADER`` with the path under ``root``,
    else the file's name; the text ending in a newline), concatenated. ``errors``: how bytes
    that are not UTF-8 are read (``str.decode``'s)."""
    base, parts = root.resolve(), []
    for p in files:
        text = p.read_text(encoding="utf-8", errors=errors)
        full = p.resolve()
        path = full.relative_to(base).as_posix() if full.is_relative_to(base) else p.name
        parts.append(FILE_HEADER.format(path=path) + text + ("" if text.endswith("\n") else "\n"))
    return "".join(parts)


def text_tokens(
    files: list[Path], root: Path = ROOT, tokenizer: Tokenizer | None = None
) -> torch.Tensor:
    """:func:`render_files` tokenized (the model's tokenizer; bytes by default): int64 ``[n]``.
    No BOS: each training sequence gets its own."""
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    return torch.tensor(tok.encode(render_files(files, root)), dtype=torch.int64)


def causal_probs(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal absorbed-MLA attention weights of a sequence over its own latent rows.

    ``q [n, h, d_qk]``, ``rows [n, d_qk]`` (position i sees rows 0..i) → float32 ``[n, h, n]``,
    without ``partial_attention``'s gather of ``[n, n, d_qk]`` rows, which autograd would keep.
    """
    n = q.shape[0]
    s = torch.einsum("nhd,kd->nhk", q.float(), rows.float()) * scale
    return s.masked_fill(_future(n, q.device)[:, None, :], float("-inf")).softmax(dim=-1)


def _future(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def index_log_probs(index_q: torch.Tensor, index_w: torch.Tensor, index_key: torch.Tensor,
                    scale: float) -> torch.Tensor:  # fmt: skip
    """The indexer's causal distribution over a sequence's keys: log-softmax of the lightning
    score ``Σ_h w[i, h] · relu(scale · q[i, h] · k[t])`` (``indexer.index_scores``, exact) over
    ``t <= i``; float32 ``[n, n]``, ``-inf`` above the diagonal. Differentiable."""
    s = torch.einsum("nhd,kd->nhk", index_q.float() * scale, index_key.float()).relu()
    s = (index_w.float()[:, :, None] * s).sum(dim=1)
    return s.masked_fill(_future(s.shape[0], s.device), float("-inf")).log_softmax(dim=-1)


def index_kl(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             probs: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DSA's indexer warm-up loss for one layer: mean over queries of
    ``KL(attention ‖ indexer)``, the attention ``probs [n, h, n]`` summed over heads and
    L1-normalised. The indexer's inputs are detached: only its own weights get a gradient."""
    attn = layer.self_attn
    h = layer.input_layernorm(x).detach()
    q_resid = attn.q_a_layernorm(attn.q_a_proj(h)).detach()
    iq, iw, ik = attn.indexer.project(h, q_resid, cos, sin)
    logq = index_log_probs(iq, iw, ik, attn.indexer.scale)
    target = probs.detach().sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True)
    return attention_kl(target, logq, _future(target.shape[0], target.device))


def train_forward(model: DeepseekV32, tokens: torch.Tensor, index_loss: bool = False) -> tuple[
    torch.Tensor, torch.Tensor | None
]:  # fmt: skip
    """Differentiable forward of one sequence from position 0: int ``[n]`` → float32
    ``[n, vocab]`` logits, and with ``index_loss`` the indexers' KL (:func:`index_kl`) summed
    over layers. Needs ``n <= index_topk`` (dense selection); the logits equal
    ``forward_tokens``' on an empty cache there."""
    cfg = model.cfg
    n = tokens.shape[0]
    assert n <= cfg.index_topk, f"{n=} > {cfg.index_topk=}: the indexer would select"
    cos, sin = model.rotary.cos_sin(torch.arange(n, device=tokens.device))
    x = model.model.embed_tokens(tokens)
    kl = None
    for layer in model.layers:
        proj = layer.project(x, cos, sin)
        p = causal_probs(proj.q, proj.cache_row, cfg.softmax_scale)
        if index_loss:
            one = index_kl(layer, x, cos, sin, p)
            kl = one if kl is None else kl + one
        o = torch.einsum("nhk,kv->nhv", p, proj.cache_row[:, : cfg.kv_lora_rank].float())
        x = layer.finish(x, o.to(proj.q.dtype))
    return model.logits(x), kl


def train_logits(model: DeepseekV32, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`train_forward`'s logits alone."""
    return train_forward(model, tokens)[0]


def trainable(model: DeepseekV32, index: bool = True) -> list[torch.nn.Parameter]:
    """Every parameter the losses differentiate: all, or all but the indexers' without
    ``index``."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and (index or ".indexer." not in name)
    ]


def reinit(model: DeepseekV32, std: float, seed: int = 0) -> None:
    """Weights a model trains from (GPT-2's scheme): every matrix and embedding normal(0,
    ``std``), the residual stream's writers (attention ``o_proj``, MLP ``down_proj``) scaled by
    1 / sqrt(2 · layers), norms 1, biases 0. The random checkpoints ``corpusd model init`` writes
    are made for sharp, well-separated scores in exactness tests: unit-variance attention
    scores saturate the softmax, whose gradient then all but vanishes."""
    g = torch.Generator().manual_seed(seed)
    layers = len(model.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif p.dim() < 2:
                p.zero_()
            else:
                s = (
                    std / (2 * layers) ** 0.5
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else std
                )
                p.copy_(torch.randn(p.shape, generator=g) * s)  # fmt: skip


def _opt(default: object, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class FitConfig:
    """One fit. CLI flags come from these fields (``--seq-len`` …)."""

    src: str = field(metadata={"help": "checkpoint directory written by `corpusd model init`"})
    out: str = field(metadata={"help": "where to write the fitted checkpoint"})
    text: tuple[str, ...] = ()  # files to fit; empty: default_text_files()
    steps: int = _opt(200, "optimizer steps")
    minutes: float = _opt(12.0, "wall-clock cap: training stops at this or --steps, first")
    seq_len: int = _opt(
        512,
        "tokens per sequence (BOS + text), at most 2048 and index_topk; attention is dense, "
        "so memory grows as seq-len² × heads × layers (2048 × 128 heads: 2 GiB a layer)",
    )
    batch: int = _opt(1, "sequences per step (gradients accumulated)")
    lr: float = _opt(3e-3, "AdamW peak learning rate")
    warmup: int = _opt(10, "linear warm-up steps, then cosine decay to 10 %% of --lr")
    weight_decay: float = _opt(0.01, "AdamW weight decay")
    index_weight: float = _opt(1.0, "weight of the indexer's KL loss; 0 leaves the indexer as is")
    seed: int = _opt(0, "torch seed and the sequence sampler's")
    log_every: int = _opt(10, "print the loss every this many steps")
    device: str = _opt("cpu", "where to train (cuda:0 fits 200 steps in seconds)")
    task: str = field(
        default="lm",
        metadata={
            "help": "lm: next-token training on the text; span: the text followed by questions "
            "quoting it, trained to answer with what follows the quote (corpusd/testing/span_qa.py;"
            " text: the standard library's packages)",
            "choices": ("lm", "span"),
        },
    )
    questions_per_seq: int = _opt(3, "span: questions after each sequence's text")
    answer_weight: float = _opt(4.0, "span: loss weight of an answer's tokens")
    text_weight: float = _opt(1.0, "span: loss weight of the other tokens (text and questions)")
    repeat_frac: float = _opt(
        0.0,
        "span: this share of sequences are a stretch of text twice over, the second copy "
        "weighed as answers (induction heads form fastest on plain repeats)",
    )
    reinit: float = _opt(
        0.0,
        "re-initialise the weights before fitting, as a trainable model (normal, this std; "
        "residual outputs scaled by 1/sqrt(2 · layers); norms 1): `corpusd model init`'s "
        "weights give unit-variance scores, so attention starts saturated (0: keep them)",
    )
    repeat_random: float = _opt(
        0.0,
        "span: this share of the repeats repeat random printable characters, not text: there "
        "nothing but copying predicts the second copy (text is partly predictable without it)",
    )
    cipher_frac: float = _opt(
        0.0,
        "span: this share of sequences (questions and repeats alike) have their ASCII letters "
        "permuted, a fresh permutation each: the answers are then nowhere in the text a fit "
        "can memorise, so only copying them from the sequence predicts them (a 7-minute GPU "
        "fit reads its 2 M characters 28 times and answers its own text from memory)",
    )
    eval_questions: int = _opt(8, "span: questions asked of the fitted model at the end (0: none)")
    eval_tokens: int = _opt(3600, "span: corpus length the end-of-fit questions are asked over")
    forward: str = field(
        default="fast",
        metadata={
            "help": "fast: the batch at once, per-head attention through SDPA (fused on a GPU), "
            "the indexer's KL on --index-rows sampled rows (tools/fit_fast.py); reference: one "
            "sequence at a time, absorbed attention with its weights materialised, every row",
            "choices": ("fast", "reference"),
        },
    )
    index_rows: int = _opt(256, "fast: query rows per sequence the indexer's KL is taken over")
    copy_warmup: int = _opt(
        0,
        "steps of pure copy data before the fit (tools/copy_sanity.py's random stretches after a "
        "gap, --copy-batch of them, at --copy-lr): on a GPU copying by content forms there in a "
        "few thousand steps, which text does not teach in minutes",
    )
    copy_every: int = _opt(0, "during the fit, a copy step after every this many steps (0: none)")
    copy_batch: int = _opt(64, "copy steps' sequences")
    copy_max_gap: int = _opt(
        64,
        "copy steps: the longest gap between a stretch and its copy (past 64 drawn log-uniform, "
        "tools/copy_sanity.draw_gap): a span question's quote is 100-2,000 tokens back, and a "
        "warm-up within 64 did not carry to that distance",
    )
    copy_lr: float = _opt(1e-3, "copy warm-up's learning rate (the fit's own schedule after)")

    def __post_init__(self) -> None:
        if not 2 <= self.seq_len <= 2048:
            raise ValueError(f"--seq-len must be in 2..2048, got {self.seq_len}")
        for key in ("steps", "batch", "log_every"):
            if getattr(self, key) <= 0:
                raise ValueError(f"--{key.replace('_', '-')} must be > 0")
        if not (self.minutes > 0 and self.lr > 0):
            raise ValueError("--minutes and --lr must be > 0")
        if self.index_weight < 0:
            raise ValueError(f"--index-weight must be >= 0, got {self.index_weight}")
        if self.task == "span" and not (self.questions_per_seq > 0 and self.answer_weight > 0):
            raise ValueError("--questions-per-seq and --answer-weight must be > 0")
        if self.text_weight < 0:
            raise ValueError(f"--text-weight must be >= 0, got {self.text_weight}")
        if not 0 <= self.repeat_frac <= 1:
            raise ValueError(f"--repeat-frac must be in [0, 1], got {self.repeat_frac}")
        if self.reinit < 0:
            raise ValueError(f"--reinit must be >= 0 (0: keep the weights), got {self.reinit}")
        if not 0 <= self.repeat_random <= 1:
            raise ValueError(f"--repeat-random must be in [0, 1], got {self.repeat_random}")
        if not 0 <= self.cipher_frac <= 1:
            raise ValueError(f"--cipher-frac must be in [0, 1], got {self.cipher_frac}")
        if self.index_rows <= 0:
            raise ValueError(f"--index-rows must be > 0, got {self.index_rows}")
        copies = self.copy_warmup > 0 or self.copy_every > 0
        if copies and not 0 <= self.copy_max_gap <= self.seq_len - 65:
            raise ValueError(
                f"--copy-max-gap must be in 0..{self.seq_len - 65} (--seq-len less two copies of "
                f"up to 32), got {self.copy_max_gap}"
            )
        if min(self.copy_warmup, self.copy_every) < 0 or self.copy_batch <= 0 or self.copy_lr <= 0:
            raise ValueError(
                "--copy-warmup and --copy-every must be >= 0, --copy-batch and --copy-lr > 0"
            )


@dataclass(frozen=True, slots=True)
class FitResult:
    steps: int
    wall_s: float
    losses: list[float]  # mean next-token loss (nats/token) per step
    index_kl: list[float]  # the indexers' KL (nats/query, summed over layers) per step; or empty
    text_tokens: int
    answer_losses: list[float] = field(default_factory=list)  # --task span: per step
    span: dict[str, Any] | None = None  # --task span: span_eval's answers of the fitted model
    copy_losses: list[float] = field(default_factory=list)  # --copy-warmup, --copy-every steps


def lr_at(step: int, cfg: FitConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0))))


def fit(cfg: FitConfig) -> FitResult:
    """Train ``cfg.src`` on the text and write ``cfg.out``. Raises ValueError when the sequence
    length exceeds the model's ``index_topk`` or the text is shorter than one sequence."""
    torch.manual_seed(cfg.seed)
    if torch.device(cfg.device).type == "cuda":
        # float32 training's matmuls on tensor cores (TF32: 10-bit mantissas in, float32 sums;
        # the weights stay float32 and are written as bf16); the speed-up is not measured yet
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = load_model(cfg.src, dtype=torch.float32).to(cfg.device).train()
    if cfg.reinit:
        reinit(model, cfg.reinit, cfg.seed)
    if cfg.seq_len > model.cfg.index_topk:
        raise ValueError(
            f"--seq-len {cfg.seq_len} > index_topk {model.cfg.index_topk}: training attends "
            "densely, so sequences must fit in the top-k; lower --seq-len"
        )
    mc = model.cfg
    if (cfg.copy_warmup or cfg.copy_every) and mc.vocab_size < COPY_IDS:
        raise ValueError(f"copy steps use token ids below {COPY_IDS}; the vocabulary has "
                         f"{mc.vocab_size}")  # fmt: skip
    tokenizer = load_tokenizer(cfg.src, mc.bos_token_id, mc.eos_token_id)
    bos_id = model.cfg.bos_token_id
    sample: Any
    if cfg.task == "span":
        files = [Path(t) for t in cfg.text] if cfg.text else span_qa.training_files()
        sample = SpanSequences(rendered(files), tokenizer, bos_id, cfg)
        n_text = len(sample.text)
    else:
        files = [Path(t) for t in cfg.text] if cfg.text else default_text_files()
        tokens = text_tokens(files, tokenizer=tokenizer)
        if tokens.numel() <= cfg.seq_len:
            raise ValueError(f"the text has {tokens.numel()} tokens, not more than --seq-len")
        sample = TextSequences(tokens, bos_id, cfg)
        n_text = int(tokens.numel())
    with_index = cfg.index_weight > 0
    params = trainable(model, index=with_index)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rows_gen = torch.Generator().manual_seed(cfg.seed)  # the fast forward's KL rows
    losses: list[float] = []
    kls: list[float] = []
    answer_losses: list[float] = []  # --task span: the answers' mean loss per step
    copy_gen = torch.Generator().manual_seed(cfg.seed)
    copy_losses: list[float] = []
    t0 = time.monotonic()

    def copy_step(lr: float) -> None:
        for g in opt.param_groups:
            g["lr"] = lr
        loss = copy_loss(model, copy_gen, cfg.copy_batch, 95, False, torch.device(cfg.device),
                         cfg.copy_max_gap)  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        copy_losses.append(loss.item())

    for step in range(cfg.copy_warmup):  # an induction circuit first, on copies alone
        if time.monotonic() - t0 > 60 * cfg.minutes:
            break
        copy_step(cfg.copy_lr)
        if step % cfg.log_every == 0 or step == cfg.copy_warmup - 1:
            last = copy_losses[-cfg.log_every :]
            print(f"copy warm-up {step:4d}  copy loss {sum(last) / len(last):.3f} (uniform "
                  f"{math.log(95):.3f})  {time.monotonic() - t0:6.1f}s", flush=True)  # fmt: skip
    for step in range(cfg.steps):
        if time.monotonic() - t0 > 60 * cfg.minutes:
            print(f"stopping at step {step}: --minutes {cfg.minutes} spent", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        seqs = [sample() for _ in range(cfg.batch)]
        if cfg.forward == "fast":
            total, total_kl, total_answer = fast_step(model, seqs, cfg, with_index, rows_gen)
        else:
            total, total_kl, total_answer = reference_step(model, seqs, cfg, with_index)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if cfg.copy_every and (step + 1) % cfg.copy_every == 0:  # keep the circuit
            copy_step(lr_at(step, cfg))
        if with_index:
            kls.append(total_kl)
        if cfg.task == "span":
            answer_losses.append(total_answer)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            recent = losses[-cfg.log_every :]
            index = f"  index KL {total_kl:.3f}" if with_index else ""
            if answer_losses:  # the answers alone: near 0 once the model copies the corpus
                last = answer_losses[-cfg.log_every :]
                index += f"  answers {sum(last) / len(last):.3f}"
            print(
                f"step {step:4d}  loss {total:.3f}  (mean of last {len(recent)}: "
                f"{sum(recent) / len(recent):.3f}){index}  lr {lr_at(step, cfg):.2e}  "
                f"{time.monotonic() - t0:6.1f}s",
                flush=True,
            )
    wall = time.monotonic() - t0
    model = model.cpu().eval()
    write_like(model, Path(cfg.src), Path(cfg.out))
    span = None
    if cfg.task == "span" and cfg.eval_questions:
        written = load_model(cfg.out, dtype=torch.float32).to(cfg.device)  # as written: bf16
        span = span_eval(written, tokenizer, cfg)
    result = FitResult(len(losses), wall, losses, kls, n_text, answer_losses, span, copy_losses)
    (Path(cfg.out) / "fit.json").write_text(
        json.dumps({"config": asdict(cfg), **asdict(result)}, indent=1)
    )
    return result


Sample = tuple[list[int], list[float] | None, list[bool] | None]


def reference_step(
    model: DeepseekV32, seqs: list[Sample], cfg: FitConfig, with_index: bool
) -> tuple[float, float, float]:
    """One step's gradients through :func:`train_forward`, a sequence at a time: returns the
    step's loss, indexer KL and answers' loss (each a mean over the sequences)."""
    total = total_kl = total_answer = 0.0
    for ids, weights, answer in seqs:
        seq = torch.tensor(ids, dtype=torch.int64, device=cfg.device)
        logits, kl = train_forward(model, seq[:-1], index_loss=with_index)
        if weights is None:
            loss = F.cross_entropy(logits, seq[1:]) / cfg.batch
        else:
            w = torch.tensor(weights, device=cfg.device)
            ce = F.cross_entropy(logits, seq[1:], reduction="none")
            loss = (w * ce).sum() / w.sum() / cfg.batch
            on = torch.tensor(answer, device=cfg.device)
            total_answer += ce.detach()[on].mean().item() / cfg.batch
        total += loss.item()
        if kl is not None:
            total_kl += kl.item() / cfg.batch
            loss = loss + cfg.index_weight * kl / cfg.batch
        loss.backward()
    return total, total_kl, total_answer


def fast_step(
    model: DeepseekV32, seqs: list[Sample], cfg: FitConfig, with_index: bool,
    rows: torch.Generator,
) -> tuple[float, float, float]:  # fmt: skip
    """:func:`reference_step`'s losses through :func:`tools.fit_fast.train_forward_batch`, the
    sequences padded to one length (zero weight past each one's end) and run at once."""
    width = max(len(ids) for ids, _, _ in seqs)
    tok = torch.zeros(len(seqs), width, dtype=torch.int64)
    w = torch.zeros(len(seqs), width - 1)
    on = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for i, (ids, weights, answer) in enumerate(seqs):
        tok[i, : len(ids)] = torch.tensor(ids)
        w[i, : len(ids) - 1] = torch.tensor(weights) if weights is not None else 1.0
        if answer is not None:
            on[i, : len(ids) - 1] = torch.tensor(answer)
    tok, w, on = tok.to(cfg.device), w.to(cfg.device), on.to(cfg.device)
    index_rows = cfg.index_rows if with_index else 0
    logits, kl = train_forward_batch(model, tok[:, :-1], index_rows, rows)
    ce = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten(), reduction="none")
    ce = ce.view_as(w)
    loss = ((w * ce).sum(dim=1) / w.sum(dim=1)).mean()
    answers = torch.zeros((), device=ce.device)
    if bool(on.any()):
        per = (ce.detach() * on).sum(dim=1) / on.sum(dim=1).clamp(min=1)
        answers = per.mean()
    full = loss if kl is None else loss + cfg.index_weight * kl
    full.backward()
    kl_v = kl.detach() if kl is not None else torch.zeros((), device=ce.device)
    got = torch.stack([loss.detach(), kl_v, answers]).tolist()  # one host sync a step
    return got[0], got[1], got[2]


class TextSequences:
    """``--task lm``'s sequences: BOS, then a random stretch of the text; every token weighs
    the same (weights None)."""

    def __init__(self, tokens: torch.Tensor, bos_id: int | None, cfg: FitConfig) -> None:
        self.tokens, self.cfg = tokens.tolist(), cfg
        self.bos = [] if bos_id is None else [bos_id]
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def __call__(self) -> tuple[list[int], None, None]:
        s = int(torch.randint(0, len(self.tokens) - self.cfg.seq_len, (1,), generator=self.gen))
        # BOS first, as a pinned corpus starts
        return self.bos + self.tokens[s : s + self.cfg.seq_len + 1 - len(self.bos)], None, None


class SpanSequences:
    """``--task span``'s sequences: BOS, a random stretch of the text, then questions quoting
    it (:mod:`corpusd.testing.span_qa`), each followed by its answer and a newline. Returns the
    tokens, each target's loss weight (an answer's ``--answer-weight``, the others'
    ``--text-weight``) and whether it is an answer's."""

    def __init__(self, text: str, tok: Tokenizer, bos_id: int | None, cfg: FitConfig) -> None:
        self.text, self.tok, self.cfg = text, tok, cfg
        self.bos = [] if bos_id is None else [bos_id]
        self.rng = random.Random(cfg.seed)
        per_q = len(span_qa.question_text("x" * span_qa.QUOTE_CHARS)) + span_qa.ANSWER_CHARS + 2
        self.window = cfg.seq_len + 1 - len(self.bos) - cfg.questions_per_seq * per_q
        if self.window < 4 * (span_qa.QUOTE_CHARS + span_qa.ANSWER_CHARS):
            raise ValueError(
                f"--seq-len {cfg.seq_len} leaves {self.window} characters of text beside "
                f"{cfg.questions_per_seq} questions: raise --seq-len or lower --questions-per-seq"
            )
        if len(text) <= 2 * self.window:
            raise ValueError(f"the text has {len(text)} characters; the span task needs more")

    def __call__(self) -> tuple[list[int], list[float], list[bool]]:
        table = self.cipher()
        if self.cfg.repeat_frac and self.rng.random() < self.cfg.repeat_frac:
            return self.repeat(table)
        while True:
            a = self.rng.randrange(0, len(self.text) - self.window)
            window = self.text[a : a + self.window].translate(table)
            try:
                qs = span_qa.questions(
                    window, self.cfg.questions_per_seq, self.rng.randrange(1 << 30)
                )
            except ValueError:  # a stretch with too few quotable spans (a table, a docstring)
                continue
            ids = self.bos + self.tok.encode(window)
            answers = [False] * len(ids)
            for q in qs:
                prompt, answer = self.tok.encode(q.prompt), self.tok.encode(q.answer + "\n")
                ids += prompt + answer
                answers += [False] * len(prompt) + [True] * len(answer)
            if len(ids) <= self.cfg.seq_len + 1:  # multi-byte characters may overflow: another
                w, t = self.cfg.answer_weight, self.cfg.text_weight
                return ids, [w if a else t for a in answers[1:]], answers[1:]

    def cipher(self) -> dict[int, int]:
        """``--cipher-frac``: this sequence's letter permutation (lower and upper case alike,
        the rest kept), or the identity ``{}``; drawn only when the option is on, so a fit
        without it samples what it sampled before."""
        if not (self.cfg.cipher_frac and self.rng.random() < self.cfg.cipher_frac):
            return {}
        lower = list(string.ascii_lowercase)
        self.rng.shuffle(lower)
        table = str.maketrans(string.ascii_lowercase, "".join(lower))
        table.update(str.maketrans(string.ascii_uppercase, "".join(lower).upper()))
        return table

    def repeat(self, table: dict[int, int]) -> tuple[list[int], list[float], list[bool]]:
        """A stretch of the text that comes again later in the sequence (``--repeat-frac``):
        text, the stretch, other text, the stretch again, with every length drawn, so the
        distance between the copies varies (a fixed one is learned as a fixed offset, not as
        copying: a proxy fitted on stretches repeated back to back copied at that one distance
        and guessed wildly at any other). The second copy, its first token aside, is what
        copying predicts: weighed and reported as answers. A repeat is the task on which
        induction heads, the circuit the span answers need, form fastest. ``table``: the
        sequence's letter permutation (:meth:`cipher`; ``{}`` keeps the text)."""
        n = self.cfg.seq_len + 1 - len(self.bos)
        rng = self.rng
        while True:
            seg = rng.randrange(max(8, n // 16), n // 2)
            gap = rng.randrange(0, n - 2 * seg + 1)
            pre = n - 2 * seg - gap
            a, b, c = (rng.randrange(0, len(self.text) - n) for _ in range(3))
            stretch = self.text[b : b + seg].translate(table)
            if self.cfg.repeat_random and rng.random() < self.cfg.repeat_random:
                stretch = "".join(chr(rng.randrange(32, 127)) for _ in range(seg))
            parts = [self.tok.encode(self.text[a : a + pre].translate(table))[:pre],
                     self.tok.encode(stretch)[:seg],
                     self.tok.encode(self.text[c : c + gap].translate(table))[:gap]]  # fmt: skip
            ids = self.bos + parts[0] + parts[1] + parts[2] + parts[1]
            if len(ids) > self.cfg.seq_len + 1 or len(parts[1]) < 8:
                continue
            copy = len(parts[1])
            answers = [False] * (len(ids) - copy + 1) + [True] * (copy - 1)
            w, t = self.cfg.answer_weight, self.cfg.text_weight
            return ids, [w if x else t for x in answers[1:]], answers[1:]


def eval_corpus(n_chars: int) -> str:
    """The corpus the end-of-fit questions are asked over: the standard library's top-level
    modules rendered as a pin renders them, ``n_chars`` of them (what the benchmarks pin;
    none of it is in ``span_qa.training_files``)."""
    parts, left = [], n_chars
    for f in span_qa.top_level_modules():
        if left <= 0:
            break
        text = rendered([f])[:left]
        parts.append(text)
        left -= len(text)
    return "".join(parts)


@torch.inference_mode()
def first_answer(model: DeepseekV32, prompt: list[int], new: int) -> tuple[list[int], float]:
    """``new`` greedy tokens after ``prompt`` through the model's own decode (``forward_tokens``:
    the indexer selects past ``index_topk``), and the first step's top-2 margin in nats."""
    cache = KVCache(model.cfg, len(prompt) + new, torch.float32, device=str(model_device(model)))
    tokens, margins = greedy(model, cache, prompt, new)
    return tokens, margins[0]


def common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def span_eval(model: DeepseekV32, tok: Tokenizer, cfg: FitConfig) -> dict[str, Any]:
    """Ask the fitted model ``cfg.eval_questions`` span questions over ``cfg.eval_tokens``
    characters of a corpus it never saw, with the corpus and without it (BOS + question):
    whether its answers copy the corpus, differ per question and depend on the corpus (the
    benchmarks' ``corpus_dependent``)."""
    text = eval_corpus(cfg.eval_tokens)
    qs = span_qa.questions(text, cfg.eval_questions, seed=cfg.seed + 1)
    bos = [] if model.cfg.bos_token_id is None else [model.cfg.bos_token_id]
    corpus = bos + tok.encode(text)
    new = len(tok.encode(qs[0].answer[:16]))
    rows: list[dict[str, Any]] = []
    for q in qs:
        prompt = tok.encode(q.prompt)
        got, margin = first_answer(model, corpus + prompt, new)
        bare, _ = first_answer(model, bos + prompt, new)
        want = q.answer[:16]
        said = tok.decode(got)
        right = common_prefix(said, want)
        rows.append({"quote_at": q.start, "want": want, "said": said, "bare": tok.decode(bare),
                     "right_chars": right, "margin_nats": round(margin, 3)})  # fmt: skip
    return {
        "copy_probe": copy_probe(model, tok, text),
        "corpus_chars": len(text),
        "corpus_tokens": len(corpus),
        "new_tokens": new,
        "answered_exactly": sum(r["said"] == r["want"] for r in rows),
        "corpus_dependent": sum(r["said"] != r["bare"] for r in rows),
        "distinct": len({r["said"] for r in rows}),
        "mean_right_chars": sum(r["right_chars"] for r in rows) / len(rows),
        "questions": rows,
    }


COPY_SEGMENT = 64  # tokens of the stretch copy_probe repeats
COPY_GAPS = (0, 100, 400, 1200)  # tokens of other text between its two copies


@torch.inference_mode()
def copy_probe(
    model: DeepseekV32, tok: Tokenizer, text: str, seed: int = 0
) -> list[dict[str, Any]]:
    """Whether the model copies, measured directly: per gap, 4 sequences of unseen ``text``
    (BOS, text, a 64-token stretch, ``gap`` tokens of other text, the stretch again) and the
    mean loss in nats per token on the stretch's first occurrence and on its copy (its first
    token aside). A model that copies predicts the copy far better than the first occurrence,
    at every gap; one that learned a fixed offset does so at one distance only."""
    rng = random.Random(seed)
    ids_all = tok.encode(text)
    bos = [] if model.cfg.bos_token_id is None else [model.cfg.bos_token_id]
    out = []
    dev = model_device(model)
    for gap in COPY_GAPS:
        n = 64 + 2 * COPY_SEGMENT + gap
        if n + len(bos) > min(model.cfg.index_topk, len(ids_all)):
            continue
        first = second = 0.0
        for _ in range(4):
            a = rng.randrange(0, len(ids_all) - n)
            pre, seg = ids_all[a : a + 64], ids_all[a + 64 : a + 64 + COPY_SEGMENT]
            other = ids_all[a + 64 + COPY_SEGMENT : a + 64 + COPY_SEGMENT + gap]
            seq = torch.tensor(bos + pre + seg + other + seg, device=dev)
            logits, _ = train_forward_batch(model, seq[None, :-1])
            ce = F.cross_entropy(logits[0].float(), seq[1:], reduction="none")
            s0 = len(bos) + 64 - 1  # target index of the stretch's first token
            first += float(ce[s0 : s0 + COPY_SEGMENT].mean()) / 4
            second += float(ce[-(COPY_SEGMENT - 1) :].mean()) / 4
        out.append({"gap": gap, "first_nats": round(first, 3), "copy_nats": round(second, 3)})
    return out


def rendered(files: list[Path]) -> str:
    """:func:`render_files` for the span task: each file named by its path in the standard
    library when it is there (``asyncio/events.py``), else by its name; bytes that are not
    UTF-8 read as U+FFFD."""
    return render_files(files, span_qa.STDLIB, errors="replace")


def write_like(model: DeepseekV32, src: Path, out: Path) -> None:
    """Save ``model`` as bf16 shards + index, with ``src``'s own config.json (byte for byte) and
    its tokenizer.json when it has one."""
    save_checkpoint(model, out, dtype=torch.bfloat16)
    written = json.loads((out / "config.json").read_text())
    assert written == json.loads((src / "config.json").read_text()), (
        f"config.json of {out} differs from {src}'s: the model's config did not round-trip"
    )
    shutil.copyfile(src / "config.json", out / "config.json")
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_flags(p, FitConfig, skip=("text",))
    p.add_argument("--text", nargs="+", default=[], help="files to fit (default: README.md, "
                   "corpusd/**/*.py and holder/**/*.py, generated code left out)")  # fmt: skip
    a = p.parse_args(argv)
    cfg = FitConfig(**{**vars(a), "text": tuple(a.text)})
    if Path(cfg.out).resolve() == Path(cfg.src).resolve():
        p.error("--out must differ from --src")
    r = fit(cfg)
    head = sum(r.losses[:10]) / min(10, len(r.losses))
    tail = sum(r.losses[-10:]) / min(10, len(r.losses))
    index = ""
    if r.index_kl:
        k0, k1 = (sum(part) / len(part) for part in (r.index_kl[:10], r.index_kl[-10:]))
        index = f", index KL {k0:.3f} → {k1:.3f}"
    if r.span is not None:
        e = r.span
        for q in e["questions"]:
            print(f"  want {q['want']!r:24} said {q['said']!r:24} bare {q['bare']!r}")
        probe = ", ".join(f"gap {c['gap']}: {c['first_nats']} → {c['copy_nats']}"
                          for c in e["copy_probe"])  # fmt: skip
        print(f"copy probe (nats/token, first occurrence → copy): {probe}")
        print(
            f"span questions over {e['corpus_tokens']} unseen tokens: {e['answered_exactly']}/"
            f"{len(e['questions'])} answered exactly, {e['corpus_dependent']} change without "
            f"the corpus, {e['distinct']} distinct"
        )
    print(
        f"fitted {r.steps} steps × {cfg.batch} × {cfg.seq_len} tokens of a "
        f"{r.text_tokens}-token text in {r.wall_s:.0f}s: loss {head:.3f} → {tail:.3f}{index} "
        f"(mean of first/last 10 steps); wrote {cfg.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
