"""A random SGLang device-path resident on the GPU: in-process holder pools and loaded corpora
with seeded random rows, for the device tests and ``tools/diag_deepgemm_jit.py``."""

from __future__ import annotations

import math

import torch

from corpusd.kernels import fp8_cache as f8
from requester.corpus_view import CorpusView
from requester.sglang.resident import ArenaCorpus, Resident

SEED = 20261124


def random_resident(
    tokens: list[int], pools: int = 2, window: int = 4096, fp8: bool = False, seed: int = SEED
) -> tuple[Resident, list[ArenaCorpus]]:
    """A resident on CUDA with ``pools`` in-process pools of 200 pages each (bf16 rows, or
    ``fp8``: FlashMLA's fp8 rows quantized from random bf16 rows) and one loaded corpus of
    ``tokens[j]`` tokens per entry, its pages spread at random over the pools; returns it and
    the corpora, in the order of ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    res = Resident(
        n_layers=1, page_size=64, index_dim=128, arena_tokens=4 * window, window_tokens=window,
        device="cuda", ue8m0=False, req_slots=128,
    )  # fmt: skip
    for i in range(pools):
        rows = torch.randn(64 * 200, 576, generator=g).bfloat16()
        res.add_pool(f"h{i}", [(f8.quantize(rows) if fp8 else rows).cuda()])
    corpora = []
    for j, t in enumerate(tokens):
        n_pages = math.ceil(t / 64)
        holders = tuple(f"h{i}" for i in range(pools))
        ph = torch.randint(0, pools, (n_pages,), generator=g)
        pf = torch.randperm(200, generator=g)[:n_pages]
        reps = tuple(((int(h), int(f)),) for h, f in zip(ph, pf, strict=True))
        view = CorpusView(f"c{j}", t, 64, holders, ph, pf, reps)
        corpora.append(res.load(view, [torch.randn(t, 128, generator=g)]))
    return res, corpora
