"""The indexer's corpus side of a :class:`~requester.fanout.CorpusBinding`: the two modes by
which a requester finds a row's top-k corpus positions. **Replica**: the corpus's index keys,
streamed once from as few live holders as cover every page and kept (:meth:`index_keys`), then
scored here. **Distributed**: each live holder's own top-k, merged exactly (:meth:`holder_topk`).
A holder that fails an indexer call is failed over as a failed attention call is (:meth:`_lost`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
import torch

from indexer import index_scores
from indexer.modes import local_topk
from indexer.select import merge_topk, select_topk
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.holder_client import HolderClient
from requester.metrics import RequesterMetrics
from requester.plan import Geometry, failure


class Engine(Protocol):
    """What the indexer side uses of :class:`~requester.fanout.Fanout` (named here, not
    imported: fanout.py imports this module)."""

    metrics: RequesterMetrics
    offload: Callable[..., Awaitable[Any]]

    def client(self, address: str) -> HolderClient: ...


log = logging.getLogger("corpusd.requester")


class CorpusIndexer:
    """Mixed into CorpusBinding, which sets these."""

    engine: Engine
    view: CorpusView
    geo: Geometry
    keys: dict[int, torch.Tensor]  # replica indexer: layer → [T, D_I]
    dead: set[int]
    _failing: asyncio.Lock
    #: ``(layer, pages) → [len(pages), P, D_I]`` index keys from the page store, or None
    stored_keys: Callable[[int, list[int]], torch.Tensor] | None

    @property
    def corpus_id(self) -> str:
        return self.view.corpus_id

    async def index_keys(self, layer: int) -> torch.Tensor:
        """``[T, D_I]`` index keys of ``layer`` (in the geometry's dtype), streamed once and
        kept: from as few holders as cover every page (a replica's copy is not streamed again),
        skipping holders that fail (they are failed over, as for attention). Raises
        CorpusUnavailable when the live holders do not hold every page."""
        if layer not in self.keys:
            view, p = self.view, self.view.page_size
            keys = torch.empty(view.n_pages * p, self.geo.index_dim, dtype=self.geo.dtype)
            got: set[int] = set()
            for i, address in enumerate(view.holders):
                held = {pg for pg, reps in enumerate(view.replicas) for h, _ in reps if h == i}
                if i in self.dead or held <= got:
                    continue
                try:
                    pages = await self.engine.client(address).index_keys(view.corpus_id, layer)
                except grpc.aio.AioRpcError as e:
                    await self._lost(i, e, "index keys")
                    continue
                for page, k in pages.items():
                    keys[page * p : (page + 1) * p] = k
                    got.add(page)
            if len(got) < view.n_pages:
                lost = sorted(set(range(view.n_pages)) - got)
                raise CorpusUnavailable(
                    f"corpus {view.corpus_id}: no live holder has the index keys of pages "
                    f"{lost[:8]} (of {view.n_pages}); failed: "
                    f"{sorted(view.holders[h] for h in self.dead)}"
                )
            self.keys[layer] = keys[: view.token_count]
        return self.keys[layer]

    async def holder_topk(
        self, layer: int, iq: torch.Tensor, iw: torch.Tensor, limit: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Distributed indexer, phase one: each live holder's local top-``index_topk``
        ``(positions, scores)`` of ``iq [n, H_I, D_I]`` / ``iw [n, H_I]`` over canonical
        positions below ``limit [n]``. The global top-k is a subset of their union, which
        still holds when a holder fails, as long as the others hold a replica of each of its
        pages (else CorpusUnavailable)."""
        g = self.geo
        live = [(i, a) for i, a in enumerate(self.view.holders) if i not in self.dead]
        parts = await asyncio.gather(
            *(
                self.engine.client(a).index_topk(
                    self.corpus_id, layer, iq, iw, limit, g.index_topk, g.index_arith
                )
                for _, a in live
            ),
            return_exceptions=True,
        )
        for (i, _), part in zip(live, parts, strict=True):
            if isinstance(part, grpc.aio.AioRpcError):
                await self._lost(i, part, "index top-k")
            elif isinstance(part, BaseException):
                raise part
        got = [part for part in parts if not isinstance(part, BaseException)]
        orphans = self._orphans()
        if orphans:
            got.append(await self._stored_topk(layer, orphans, iq, iw, limit))
        return got

    def _orphans(self) -> list[int]:
        """Pages no live holder has a replica of (their holders failed, none took them)."""
        return [
            p for p, reps in enumerate(self.view.replicas)
            if all(h in self.dead for h, _ in reps)
        ]  # fmt: skip

    async def _stored_topk(
        self, layer: int, pages: list[int], iq: torch.Tensor, iw: torch.Tensor, limit: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The local top-k over ``pages`` scored here from the page store's index keys, as a
        holder of them would (same arithmetic), so that a failed holder's pages stay candidates
        (a selection without them decodes other tokens). Raises CorpusUnavailable without a page
        store to read."""
        view, g = self.view, self.geo
        if self.stored_keys is None:
            raise CorpusUnavailable(
                f"corpus {view.corpus_id}: pages {pages[:8]} have no live holder and no page "
                "store here to score their index keys from"
            )
        stored_keys = self.stored_keys

        def score() -> tuple[torch.Tensor, torch.Tensor]:
            p = view.page_size
            keys = stored_keys(layer, pages).reshape(len(pages) * p, -1).to(g.dtype)
            pos = (torch.tensor(pages)[:, None] * p + torch.arange(p)[None, :]).reshape(-1)
            keep = pos < view.token_count
            keys, pos = keys[keep], pos[keep]
            scores = index_scores(iq, iw, keys, g.index_dim**-0.5, g.index_arith).float()
            return local_topk(scores, pos, limit, g.index_topk)

        self.engine.metrics.fallbacks.labels("index", "store").inc()
        return await self.engine.offload(score)

    async def _lost(self, holder: int, e: grpc.aio.AioRpcError, what: str) -> None:
        """A holder failed an indexer call: fail it over, as a failed attention call is. Raises
        CorpusUnavailable when some page then has no live replica."""
        code, detail = failure(e)
        self.engine.metrics.errors.labels(code.name).inc()
        async with self._failing:
            if holder in self.dead:
                return
            self.dead.add(holder)
            log.warning(
                "holder %s failed (%s: %s) during %s; failing it over",
                self.view.holders[holder], code.name, detail, what,
            )  # fmt: skip
            try:
                self.view = self.view.failover(self.dead)
            except CorpusUnavailable:
                if self.stored_keys is None:
                    raise
                return  # pages left with no replica are scored from the store (_stored_topk)
            self.engine.metrics.fallbacks.labels("index", "replica").inc()

    async def topk(self, layer: int, iq: torch.Tensor, iw: torch.Tensor) -> torch.Tensor:
        """The exact top-``index_topk`` canonical positions ``[n, k]`` of the whole corpus for
        index queries ``iq [n, H_I, D_I]`` and head weights ``iw [n, H_I]`` (ties: lowest
        position first): over the replica keys when this binding keeps them, else merged from
        the holders' own top-k."""
        g = self.geo
        iq, iw = iq.to(g.dtype), iw.to(g.dtype)
        if self.keys:
            keys = await self.index_keys(layer)
            scale = g.index_dim**-0.5
            return await self.engine.offload(
                lambda: select_topk(index_scores(iq, iw, keys, scale, g.index_arith), g.index_topk)
            )
        limit = torch.full((len(iq),), self.view.token_count, dtype=torch.int64)
        parts = await self.holder_topk(layer, iq, iw, limit)
        positions = torch.cat([p for p, _ in parts], 1)
        return merge_topk(positions, torch.cat([s for _, s in parts], 1), g.index_topk)
