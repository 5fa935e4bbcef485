"""Proxy of the greedy-flip problem: float32 vs bfloat16 runs of one checkpoint.

The SGLang comparison (``tools/bench_sglang.py``) decodes 32 greedy tokens per prompt with and
without corpusd and counts agreeing positions; with flat logits a near-tie flips under bf16
noise and every later token differs. This runs the same prompts (the corpus bench_sglang pins,
as corpusd renders it, + each question) through our model on CPU twice: float32 weights and
cache (the reference) and bfloat16 weights and cache (the perturbation), and reports

- ``greedy_agree``: free-running greedy tokens equal position by position;
- ``forced_agree``: the bf16 argmax given the reference's own prefix equals the reference token;
- the reference's top-2 logit margins (nats) at its greedy steps: median, share below 0.05;
- ``corpus_nll``: the reference's mean next-token loss on the corpus tokens (nats), and on
  those real-text positions the same two margin statistics and the fp32/bf16 argmax agreement
  (``corpus_*``): free-running answers of a briefly fitted model collapse into a loop (all
  prompts the same answer, ``distinct_answers``), which is robust but tests little;
- ``corpus_dependent``: how many of the reference's answers change when the corpus is dropped
  (BOS + question alone): an answer that does not depend on the corpus cannot show that the
  corpus attention is right.

It runs on CPU by default; ``--device cuda:0`` runs the same arithmetic on a GPU in seconds.

    python -m tools.flip_proxy MODEL_DIR [MODEL_DIR …] [--regimes dense] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from corpusd.corpus.ingest import ingest
from corpusd.corpus.layout import render
from corpusd.model import DeepseekV32, KVCache, forward_tokens, load_model
from corpusd.testing.decode import greedy, model_device
from corpusd.tokenizer import ByteTokenizer
from tools.bench_sglang import QUESTIONS, REGIMES
from tools.sglang_server import corpus_source

NEAR_TIE = 0.05  # nats: margins below this flipped under bf16/fp8 noise on SGLang
CHUNK = 256  # prefill chunk, as `corpusd pin`


def corpus_tokens(regime: str) -> list[int]:
    """The token stream bench_sglang pins for ``regime``: BOS, file header, text."""
    n_bytes, first = REGIMES[regime]
    with tempfile.TemporaryDirectory() as tmp:
        src = corpus_source(Path(tmp) / regime, n_bytes, first)
        return list(render(ingest(src), ByteTokenizer(), 1 << 20).tokens)


def prefill(model: DeepseekV32, tokens: list[int], capacity: int, dtype: torch.dtype) -> tuple[
    KVCache, torch.Tensor
]:  # fmt: skip
    """The cache after ``tokens`` and the float32 logits ``[len(tokens), vocab]``."""
    cache = KVCache(model.cfg, capacity, dtype, device=str(model_device(model)))
    t = torch.tensor(tokens, device=model_device(model))
    logits = [forward_tokens(model, t[i : i + CHUNK], cache) for i in range(0, len(t), CHUNK)]
    return cache, torch.cat([x for x in logits if x is not None])


def forced(model: DeepseekV32, cache: KVCache, suffix: list[int], ref: list[int]) -> list[int]:
    """Argmax at each step given ``suffix + ref[:j]`` (teacher forcing). Mutates ``cache``."""
    logits = forward_tokens(
        model, torch.tensor(suffix + ref[:-1], device=model_device(model)), cache
    )
    assert logits is not None
    return logits[len(suffix) - 1 :].argmax(-1).tolist()


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    regime: str
    prompts: int
    corpus_tokens: int
    corpus_nll: float
    corpus_argmax_agree: float
    corpus_margin_median: float
    corpus_margin_below_near_tie: float
    greedy_agree: float
    forced_agree: float
    margin_median: float
    margin_below_near_tie: float
    margin_min: float
    first_divergence: list[int]
    distinct_answers: int
    corpus_dependent: int  # answers that change when the corpus is dropped (question alone)
    greedy_text: list[str]  # the float32 run's answers, to see what the model does
    seconds: float


def measure(model_dir: str, regime: str, prompts: int, n: int, device: str = "cpu") -> Row:
    t0 = time.monotonic()
    corpus = corpus_tokens(regime)
    suffixes = [ByteTokenizer().encode(f"\n\nQ: {q}\nA:") for q in QUESTIONS[:prompts]]
    capacity = len(corpus) + max(map(len, suffixes)) + n
    ref_model = load_model(model_dir, dtype=torch.float32, device=device)
    low_model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    ref_cache, logits = prefill(ref_model, corpus, capacity, torch.float32)
    bare_cache, _ = prefill(ref_model, corpus[:1], capacity, torch.float32)  # BOS alone
    target = torch.tensor(corpus[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1], target)
    low_cache, low_logits = prefill(low_model, corpus, capacity, torch.bfloat16)
    top2 = logits.topk(2, dim=-1).values
    corpus_margins = (top2[:, 0] - top2[:, 1]).tolist()
    same = agree = total = dependent = 0
    margins: list[float] = []
    first_div: list[int] = []
    texts: list[str] = []
    answers: set[tuple[int, ...]] = set()
    for suffix in suffixes:
        ref, m = greedy(ref_model, copy.deepcopy(ref_cache), suffix, n)
        low, _ = greedy(low_model, copy.deepcopy(low_cache), suffix, n)
        teacher = forced(low_model, copy.deepcopy(low_cache), suffix, ref)
        bare, _ = greedy(ref_model, copy.deepcopy(bare_cache), suffix, n)
        dependent += bare != ref
        same += sum(a == b for a, b in zip(ref, low, strict=True))
        agree += sum(a == b for a, b in zip(ref, teacher, strict=True))
        total += n
        margins += m
        diverged = [i for i, (a, b) in enumerate(zip(ref, low, strict=True)) if a != b]
        first_div.append(diverged[0] if diverged else n)
        texts.append(ByteTokenizer().decode(ref))
        answers.add(tuple(ref))
    return Row(
        model=model_dir,
        regime=regime,
        prompts=len(suffixes),
        corpus_tokens=len(corpus),
        corpus_nll=float(nll),
        corpus_argmax_agree=float((logits.argmax(-1) == low_logits.argmax(-1)).float().mean()),
        corpus_margin_median=statistics.median(corpus_margins),
        corpus_margin_below_near_tie=sum(x < NEAR_TIE for x in corpus_margins) / len(corpus),
        greedy_agree=same / total,
        forced_agree=agree / total,
        margin_median=statistics.median(margins),
        margin_below_near_tie=sum(x < NEAR_TIE for x in margins) / len(margins),
        margin_min=min(margins),
        first_divergence=first_div,
        distinct_answers=len(answers),
        corpus_dependent=dependent,
        greedy_text=texts,
        seconds=time.monotonic() - t0,
    )


def table(rows: list[Row]) -> str:
    tie = f"<{NEAR_TIE}"
    head = (
        f"{'model':<16} {'regime':<7} {'nll':>6} {'greedy':>7} {'forced':>7} {'margin med':>10} "
        f"{tie:>6} {'answers':>7} {'on corpus':>9} | "
        f"{'corpus: agree':>13} {'margin med':>10} {tie:>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{Path(r.model).name[:16]:<16} {r.regime:<7} {r.corpus_nll:6.3f} "
            f"{r.greedy_agree:7.1%} {r.forced_agree:7.1%} {r.margin_median:10.3f} "
            f"{r.margin_below_near_tie:6.1%} {r.distinct_answers:>7} {r.corpus_dependent:>9} | "
            f"{r.corpus_argmax_agree:13.1%} {r.corpus_margin_median:10.3f} "
            f"{r.corpus_margin_below_near_tie:6.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="checkpoint directories")
    p.add_argument("--regimes", default="dense", help=f"comma-separated, of {sorted(REGIMES)}")
    p.add_argument("--prompts", type=int, default=8, help=f"questions, 1..{len(QUESTIONS)}")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--device", default="cpu", help="where to run both models (e.g. cuda:0)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    regimes = a.regimes.split(",")
    if not set(regimes) <= set(REGIMES):
        p.error(f"--regimes: unknown {sorted(set(regimes) - set(REGIMES))}")
    if not (1 <= a.prompts <= len(QUESTIONS) and a.tokens >= 1):
        p.error(f"--prompts must be in 1..{len(QUESTIONS)} and --tokens >= 1")
    rows = []
    for m in a.models:
        for r in regimes:
            rows.append(measure(m, r, a.prompts, a.tokens, a.device))
            print(f"{m} {r}: {rows[-1].seconds:.0f}s", flush=True)
    print(table(rows))
    if a.out:
        out: dict[str, Any] = {
            "what": f"float32 vs bfloat16 weights+cache, our model on {a.device}",
            "script": "tools/flip_proxy.py",
            "host": platform.node(),
            "torch": torch.__version__,
            "tokens_per_prompt": a.tokens,
            "near_tie_nats": NEAR_TIE,
            "rows": [asdict(r) for r in rows],
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
