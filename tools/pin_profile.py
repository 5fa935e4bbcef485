"""The pin prefill's phases, timed (``python -m tools.bench_pin --profile N``, which runs
:func:`profile` in a fresh child process): indexer scores, top-k, projections, attention output
and MLPs, each call wrapped and, on CUDA, synchronised before and after."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

from corpusd.model import ModelConfig


def profile(
    tar: str, model_dir: str, tokens: int, chunk: int, device: str = "cpu", dtype: str = "float32",
    kernels: str = "auto",
) -> dict[str, float]:  # fmt: skip
    """Seconds per prefill phase over the tar's first ``tokens`` tokens. On CUDA every timed call
    is synchronised before and after, so each phase owns its kernels' time (the total then
    includes those waits)."""
    from corpusd.corpus.ingest import ingest
    from corpusd.corpus.layout import render
    from corpusd.model import KVCache, load_model
    from corpusd.model import model as mm
    from corpusd.model.prefill_kernels import Kernels, choose
    from corpusd.tokenizer import load_tokenizer

    cfg = ModelConfig.from_dir(model_dir)
    tok = load_tokenizer(model_dir, cfg.bos_token_id, cfg.eos_token_id)
    t0 = time.perf_counter()
    ids = render(ingest(tar), tok, 1 << 30).tokens[:tokens]
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    spent["tokenize"] = time.perf_counter() - t0
    model = load_model(model_dir, dtype=getattr(torch, dtype), device=device)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[name] += time.perf_counter() - t
            return out

        return wrapper

    chosen = choose(cfg, device, getattr(torch, dtype), kernels)
    if device != "cpu":
        from corpusd.corpus.pin import warm_up

        warm_up(model, chosen)
    timed_kernels = Kernels(
        timed("indexer scores", chosen.scores), timed("sparse attention", chosen.attend),
        chosen.describe,
    )  # fmt: skip
    saved = mm.select_topk
    mm.select_topk = timed("top-k", mm.select_topk)
    for layer in model.layers:
        layer.project = timed("projections (q, latent, index q/k)", layer.project)  # type: ignore[method-assign]
        attn, mlp = layer.self_attn, layer.mlp
        attn.output = timed("attention output (W_UV, o_proj)", attn.output)  # type: ignore[method-assign]
        mlp.forward = timed(f"mlp ({type(mlp).__name__})", mlp.forward)
    from corpusd.corpus.pin import cpu_threads

    torch.set_num_threads(cpu_threads())  # as pin's prefill does
    spent["threads"] = torch.get_num_threads()
    try:
        tensor = torch.tensor(ids, device=device)
        cache = KVCache(cfg, len(ids), getattr(torch, dtype), device=device)
        sync()
        t0 = time.perf_counter()
        for start in range(0, len(ids), chunk):
            piece = tensor[start : start + chunk]
            mm.forward_tokens(model, piece, cache, False, timed_kernels)
        sync()
        spent["prefill (total)"] = time.perf_counter() - t0
    finally:
        mm.select_topk = saved
    spent["tokens"] = len(ids)
    return {k: round(v, 3) for k, v in spent.items()}
