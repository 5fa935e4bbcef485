"""``select_rows`` on a chunk whose first rows see at most ``index_topk`` keys (a pin's first
chunk): those rows select every key they see without being scored, and the whole selection
equals the definition (score every row, exact top-k)."""

from __future__ import annotations

from dataclasses import replace

import torch

from corpusd.kernels.reference import partial_attention
from corpusd.model.mla import Projections
from corpusd.model.model import select_rows
from corpusd.model.prefill_kernels import Kernels
from corpusd.model.tiny import preset_config
from indexer import index_scores
from indexer.select import select_topk_exact


def _proj(n: int, heads: int, d: int, g: torch.Generator) -> Projections:
    empty = torch.zeros(n, 0)
    return Projections(
        q=empty, cache_row=empty, index_key=torch.zeros(n, d),
        index_q=torch.randn(n, heads, d, generator=g),
        index_w=torch.randn(n, heads, generator=g) * heads**-0.5,
    )  # fmt: skip


def test_rows_within_topk_are_not_scored_and_the_selection_is_the_definitions() -> None:
    cfg = replace(preset_config("cpu"), index_topk=16)
    heads, d = cfg.index_n_heads, cfg.index_head_dim
    g = torch.Generator().manual_seed(3)
    scored_rows: list[int] = []

    def spy(q: torch.Tensor, *args, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
        scored_rows.append(q.shape[0])
        return index_scores(q, *args, **kw)

    kernels = Kernels(spy, partial_attention, "spy")
    for start, n in ((0, 40), (5, 30), (20, 10), (0, 16)):
        keys = torch.randn(start + n, d, generator=g)
        proj = _proj(n, heads, d, g)
        positions = torch.arange(start, start + n)
        scored_rows.clear()
        got = select_rows(cfg, proj, keys, positions, kernels)
        limit = positions + 1
        want_scored = int((limit > cfg.index_topk).sum())
        assert scored_rows == ([want_scored] if want_scored else []), (start, n, scored_rows)
        scores = index_scores(proj.index_q, proj.index_w, keys, d**-0.5, limit=limit)
        want = select_topk_exact(scores, min(cfg.index_topk, start + n), limit)
        assert torch.equal(got, want), (start, n)
