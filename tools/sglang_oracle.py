"""An absolute reference for the SGLang bench's teacher-forced figures (issue 36): corpusd's own
model, which matches transformers' ``DeepseekV32ForCausalLM`` (``tests/unit/test_model_oracle.py``),
run in float64 on the same checkpoint, corpus, questions and stock answers.

The noise floor compares stock with stock. Two stock runs share almost all of their arithmetic
(the same kernels, the same bf16 roundings of the same tensors), so their difference can be far
smaller than either run's error; route, whose corpus partial is another kernel merged by LSE,
errs independently of stock, and route against stock then reads as a multiple of the floor even
when route is as exact as stock. Each run against the float64 model says which is nearer the
exact answer: ``vs_oracle[mode]`` (``sglang_compare.forced_compare`` with the oracle as the
reference), and ``route_over_stock``, route's max / mean |Δ log-prob| over stock's.

The selection is the model config's (``index_arith``: ``fp8`` emulates SGLang's fp8 index
arithmetic); where its top-k parts from a server's at a near-tie, that row's difference is
the selection's, as it is between the servers.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from corpusd.model import load_model
from corpusd.model.model import KVCache, forward_tokens
from tools.sglang_compare import forced_compare

CHUNK = 512  # prefill rows per forward: the reference attention's float64 scores stay ~0.5 GB


def oracle_forced(
    model_dir: str | Path,
    corpus: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    steps: int,
    device: str | None = None,
    dtype: torch.dtype = torch.float64,
) -> list[list[list[float]]]:
    """``[request][step][vocab]``: the log-softmax of the next token after ``corpus +
    suffixes[i] + answers[i][:j]`` for ``j < steps``, as the bench's ``teacher_forced`` asks
    the servers, from corpusd's model in ``dtype`` on ``device`` (a GPU when there is one). The
    corpus is prefilled once; each request continues from a copy of its cache."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(model_dir, dtype=dtype, device=dev).eval()
    longest = max(len(s) for s in suffixes) + steps
    base = KVCache(model.cfg, len(corpus) + longest, dtype, dev)
    toks = torch.tensor(list(corpus), dtype=torch.int64, device=dev)
    out: list[list[list[float]]] = []
    with torch.no_grad():
        for i in range(0, len(toks), CHUNK):
            forward_tokens(model, toks[i : i + CHUNK], base, want_logits=False)
        for sfx, ans in zip(suffixes, answers, strict=True):
            cache = copy.deepcopy(base)
            rest = list(sfx) + list(ans[: steps - 1])
            logits = forward_tokens(model, torch.tensor(rest, dtype=torch.int64, device=dev), cache)
            assert logits is not None
            at = len(sfx) - 1  # the row after the question predicts the answer's first token
            rows = logits[at : at + steps].double().log_softmax(dim=-1)
            out.append(rows.cpu().tolist())
    return out


def vs_oracle(oracle: list[list[list[float]]], runs: dict[str, Any]) -> dict[str, Any]:
    """Each teacher-forced run in ``runs`` (name → ``[request][step][vocab]``, None skipped)
    against the oracle, and route's figures over stock's where both are there."""
    out: dict[str, Any] = {name: forced_compare(oracle, run) for name, run in runs.items() if run}
    if "stock" in out and "route" in out:
        s, r = out["stock"], out["route"]
        out["route_over_stock"] = {
            k: (r[k] / s[k] if s[k] > 0 else float("inf"))
            for k in ("logprob_max_abs_diff", "logprob_mean_abs_diff")
        }
    return out
