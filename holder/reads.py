"""What Fetch, IndexKeys and IndexTopK read out of the frame pool: whole pages of latent rows
and index keys, and the indexer's top-k over every token of a corpus held here.

These run on flow threads (``HolderService._run``) or, for IndexKeys, between the chunks of a
stream; the servicer has checked the corpus, layers and pages (``holder.requests``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from corpusd.kernels import fp8_cache
from holder.pool import FramePool
from holder.requests import TopKCall
from indexer import index_scores
from indexer.modes import local_topk

KEY_CHUNK_PAGES = 256  # pages per IndexKeys message


class PoolReads:
    """Reads of a corpus's pages. Caches each corpus's (pool rows, positions) until
    ``forget`` (call it whenever the corpus's pages change)."""

    def __init__(self, pool: FramePool) -> None:
        self.pool = pool
        self._rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forget(self, corpus_id: str) -> None:
        self._rows.pop(corpus_id, None)

    def _page_rows(self, frames: list[int]) -> torch.Tensor:
        """int64 ``[len(frames) · P]``: every pool row of ``frames``, in order."""
        p = self.pool.geo.page_size
        return (torch.tensor(frames, dtype=torch.int64)[:, None] * p + torch.arange(p)).flatten()

    def corpus_rows(self, corpus_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows and corpus positions (int64 ``[T_held]`` each) of every valid token held
        here, in position order."""
        cached = self._rows.get(corpus_id)
        if cached is not None:
            return cached
        held = self.pool.held(corpus_id)
        assert held is not None, f"{corpus_id=} is not held"
        p = self.pool.geo.page_size
        pages = sorted(held.pages)
        pos = torch.cat([torch.arange(pg * p, min((pg + 1) * p, held.token_count)) for pg in pages])
        frames = torch.tensor([held.pages[pg] for pg in pages]).repeat_interleave(
            torch.tensor([min(p, held.token_count - pg * p) for pg in pages])
        )
        self._rows[corpus_id] = (frames * p + pos % p, pos)
        return self._rows[corpus_id]

    def pages(
        self, frames: list[int], layers: list[int], index_keys: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, latent ``[len(frames), P, kv_dim]`` (fp8 rows dequantized) and (when
        ``index_keys``) index keys ``[len(frames), P, index_dim]`` of the pages in ``frames``."""
        geo, n = self.pool.geo, len(frames)
        rows, p = self._page_rows(frames), geo.page_size
        # explicit widths: no pages ([0, P, -1]) cannot be reshaped with an inferred one
        lat = [self.pool.latent[i][rows] for i in layers]
        if geo.fp8:  # a fetch ships the rows a route attends: dequantized, in the pool's dtype
            lat = [fp8_cache.dequantize(x, geo.dtype) for x in lat]
        lat = [x.view(n, p, geo.kv_dim) for x in lat]
        idx = (
            [self.pool.index_keys[i][rows].view(n, p, geo.index_dim) for i in layers]
            if index_keys
            else []
        )
        return lat, idx

    def index_key_chunks(
        self, corpus_id: str, layer: int
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """(pages, keys ``[len(pages), P, index_dim]``) of every held page in page order, at
        most ``KEY_CHUNK_PAGES`` at a time."""
        held = self.pool.held(corpus_id)
        assert held is not None, f"{corpus_id=} is not held"
        pages = sorted(held.pages)
        keys, p = self.pool.index_keys[layer], self.pool.geo.page_size
        for i in range(0, len(pages), KEY_CHUNK_PAGES):
            chunk = pages[i : i + KEY_CHUNK_PAGES]
            rows = self._page_rows([held.pages[pg] for pg in chunk])
            yield chunk, keys[rows].view(len(chunk), p, -1)

    def index_topk(self, call: TopKCall) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The indexer's exact top-k over the corpus's tokens held here, as a function for a
        flow thread (the corpus's rows are looked up now, on the caller's thread). It returns
        positions int64 ``[n, k]`` (-1 where fewer than k tokens lie below the row's limit) and
        their scores float32 ``[n, k]`` (-inf there)."""
        rows, pos = self.corpus_rows(call.corpus_id)
        keys = self.pool.index_keys[call.layer]
        scale = self.pool.geo.index_dim**-0.5

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            scores = index_scores(call.q, call.weights, keys[rows], scale, call.arith)
            return local_topk(scores, pos, call.limit, call.k)

        return compute
