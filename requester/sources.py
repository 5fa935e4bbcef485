"""Corpus rows held by the requester itself: fetched pages (fetch) and re-prefilled rows (local),
and the partial attention of queries over such canonical rows at any offset.

Rows here are canonical (``k_pe`` rotated at the token's corpus position ``j``). A session that
places the corpus at offset ``o`` attends them at logical position ``o + j``: the ``k_pe`` band
of the gathered rows is rotated by ``+o`` before attending (RoPE is relative, so this equals
routing with the query rotated by ``−o``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from corpusd.kernels import fp8_cache
from corpusd.kernels.formats import FP8
from corpusd.kernels.reference import partial_attention
from corpusd.model import DeepseekV32, KVCache, forward_tokens
from corpusd.model.rope import shift_band

Rows = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, canonical positions [u]) → [u, d]


class PageCache:
    """Fetched pages per ``(layer, page)``; least recently used go beyond ``capacity_bytes``."""

    def __init__(self, page_size: int, capacity_bytes: int) -> None:
        self.page_size, self.capacity = page_size, capacity_bytes
        self.pages: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def missing(self, layer: int, pages: list[int]) -> list[int]:
        return [p for p in pages if (layer, p) not in self.pages]

    def put(self, layer: int, pages: list[int], latent: torch.Tensor) -> None:
        """``latent [len(pages), P, d]`` as returned by Fetch."""
        for i, p in enumerate(pages):
            if (layer, p) not in self.pages:
                self.pages[(layer, p)] = latent[i]
                self.nbytes += latent[i].nbytes
        while self.nbytes > self.capacity and len(self.pages) > 1:
            _, old = self.pages.popitem(last=False)
            self.nbytes -= old.nbytes

    def rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows of canonical ``positions [u]``; every page must be present (KeyError if not)."""
        p = self.page_size
        pages = (positions // p).unique()
        for pg in pages.tolist():
            self.pages.move_to_end((layer, pg))
        block = torch.stack([self.pages[(layer, pg)] for pg in pages.tolist()])  # [u_p, P, d]
        return block[torch.searchsorted(pages, positions // p), positions % p]


class LocalRows:
    """The corpus's cache re-prefilled on the requester from its tokens, grown on demand.

    A canonical chunk's rows depend on the chunk's tokens before them, so rows up to position
    ``e`` need the prefill of tokens ``0 … e``; ``ensure`` extends what is computed. For a
    corpus pinned in fp8 rows (``kv_format``), ``rows`` returns the computed rows quantized and
    dequantized as pin stored them, so a recomputed chunk attends the holders' keys.
    """

    def __init__(
        self, model: DeepseekV32, tokens: torch.Tensor, chunk: int = 256, kv_format: str = "plain"
    ) -> None:
        self.model, self.tokens, self.chunk = model, tokens, chunk
        self.kv_format = kv_format
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(model.cfg, min(len(tokens), 1024), dtype)

    @property
    def computed(self) -> int:
        return self.cache.length

    def ensure(self, end: int) -> int:
        """Prefill through position ``end − 1`` (blocking; run it off the event loop). Returns
        the number of tokens computed by this call."""
        start = self.cache.length
        end = min(end, len(self.tokens))
        for s in range(start, end, self.chunk):
            forward_tokens(self.model, self.tokens[s : min(s + self.chunk, end)], self.cache, False)
        return max(0, end - start)

    def load(self, latent: list[torch.Tensor], index_keys: list[torch.Tensor]) -> None:
        """Take a complete cache (the monolithic baseline: rows read from the page store)."""
        n = latent[0].shape[0]
        self.cache.reserve(n)
        for li in range(len(latent)):
            self.cache.latent[li][:n] = latent[li]
            self.cache.index_keys[li][:n] = index_keys[li]
        self.cache.length = n

    def rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        assert positions.numel() == 0 or int(positions.max()) < self.cache.length, (
            f"rows up to {int(positions.max())} asked, {self.cache.length} computed"
        )
        rows = self.cache.latent[layer][positions]
        if self.kv_format == FP8:
            rows = fp8_cache.dequantize(fp8_cache.quantize(rows), rows.dtype)
        return rows


def attend_canonical(
    q: torch.Tensor,
    canon: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    uniq: torch.Tensor,
    shift: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    d_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of ``q [m, h, d]`` over canonical corpus rows at per-row offsets.

    Args:
        canon: int64 ``[m, k]`` canonical positions (``-1`` unused), all within ``uniq``.
        offsets: int64 ``[m]`` where each row's session placed the corpus.
        rows: ``[u, d]`` the rows of ``uniq`` (sorted unique canonical positions).
        shift: ``Rotary.shift``; the band ``[d_v, d)`` of the rows is rotated by the offset.

    Returns:
        ``(O [m, h, d_v], LSE [m, h])`` as :func:`partial_attention`.
    """
    valid = canon >= 0
    idx = torch.where(valid, torch.searchsorted(uniq, canon.clamp(min=0)), -1)
    o = q.new_zeros(q.shape[0], q.shape[1], d_v)
    lse = torch.full(q.shape[:2], float("-inf"))
    for off in offsets.unique().tolist():
        sel = offsets == off
        kv = rows
        if off:
            cos, sin = shift(torch.full((rows.shape[0],), off))
            kv = shift_band(rows, d_v, rows.shape[1] - d_v, cos, sin)
        o[sel], lse[sel] = partial_attention(q[sel], kv, idx[sel], scale, d_v)
    return o, lse
