"""The host path's executor: one layer call's corpus partial, planned and served by corpusd's
fan-out engine from the host, the holder calls in flight while SGLang computes its own partial.

Per call, the engine's steps (:mod:`requester.fanout`) with the plugin's two facts:

1. **plan**: the engine groups the selected positions by holder
   (:meth:`~requester.fanout.CorpusBinding.plan`) on the view the catalog adopted for this
   forward (:meth:`.catalog.CorpusCatalog.at_layer`);
2. **predicate**: per group the plugin's :class:`.choose.Chooser` picks route or fetch from what
   the page cache on the queries' GPU already holds (the engine's cost model and fallback rule);
3. **route** is the engine's (:meth:`~requester.fanout.CorpusBinding.serve`: the holder call,
   failover to replicas and the re-read page table, the decision recorded); **fetch** pulls the
   missing pages with the engine (:meth:`~requester.fanout.CorpusBinding.pull`) into the plugin's
   :class:`.page_cache.PageCache` and attends them there with :func:`.device.sparse_partial`; a
   fetch that fails, or brings pages the cache cannot hold, is routed instead (counted);
4. **merge**: one exact LSE merge of the groups (:func:`requester.plan.merge_groups`).

:meth:`HostPath.begin` sends every holder call and returns; :meth:`HostPath.finish` computes the
cached groups, waits for the calls and merges (issue 17: start the corpus call, compute SGLang's
partial, then wait). Partials over the page cache are computed on the caller's thread (SGLang's
stream), never on the catalog's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from corpusd.kernels.formats import TOPK_ALIGN
from corpusd.kernels.reference import PartialOut
from corpusd.rpc import StatusError
from requester.fanout import CorpusBinding, LayerCall
from requester.plan import GroupWork, merge_groups
from requester.predicate import Decision
from requester.sglang.binding import Binding
from requester.sglang.catalog import CorpusCatalog
from requester.sglang.choose import Chooser
from requester.sglang.device import sparse_partial
from requester.sglang.metrics import PluginMetrics
from requester.sglang.page_cache import PageCache, PageCacheFull, Plan

log = logging.getLogger("corpusd.sglang")

Work = tuple[GroupWork, Decision, Plan | None]  # a group, its decision, fetch's cache plan
Got = tuple[str, Any, float] | None  # a holder call's outcome (:meth:`HostPath._remote`)


@dataclass
class Pending:
    """An attend :meth:`HostPath.begin` started: its plan and its holder calls in flight."""

    c: CorpusBinding
    layer: int
    q: torch.Tensor
    scale: float
    base2: bool
    groups: list[GroupWork]
    work: list[Work]
    cache: PageCache | None
    before: dict[str, int]
    fut: concurrent.futures.Future[list[Got]]


class HostPath:
    """Serves host-path layer calls (see the module docstring) of the corpora in ``catalog``.
    ``chooser`` decides route or fetch per group; fetch keeps pages in a page cache of
    ``cache_bytes`` on the queries' device (0: no cache, route only), ``n_layers`` layers of
    ``page_size``-token pages. Calls block the caller (SGLang's forward thread)."""

    def __init__(
        self,
        catalog: CorpusCatalog,
        chooser: Chooser,
        metrics: PluginMetrics,
        n_layers: int,
        cache_bytes: int = 0,
    ) -> None:
        if chooser.force == "fetch" and cache_bytes <= 0:
            raise ValueError(
                "corpusd plugin: CORPUSD_SGLANG_PRIMITIVE=fetch needs a page cache; "
                "CORPUSD_SGLANG_PAGE_CACHE_MB is 0"
            )
        self.catalog, self.chooser, self.metrics = catalog, chooser, metrics
        self.n_layers, self.cache_bytes = n_layers, cache_bytes
        self.cache: PageCache | None = None
        self._wire_itemsize = 4  # a fetched page's bytes per value, learnt from the first fetch

    def new_step(self, rids: list[str] | tuple[str, ...], mode: str) -> None:
        """A forward step begins: pages pinned by the last one may go, decisions are numbered
        anew (``rids``: the batch's requests, for the trace)."""
        self.chooser.new_step(tuple(rids), mode)
        if self.cache is not None:
            self.cache.new_step()

    def attend(
        self,
        b: Binding,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        base2: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged ``(O [n, h, d_v] float32, LSE [n, h] natural, -inf empty)``, on ``q``'s
        device, of ``q [n, h, kv_dim]`` (corpusd's rope layout, full head count) over canonical
        ``positions [n, k]`` (-1 unused), scores scaled by ``scale`` (SGLang's
        ``layer.scaling``); ``base2``: the sparse kernel's LSE base on ``q``'s device (fetch's
        partial). Groups run concurrently; one LSE merge. :meth:`begin` then :meth:`finish`."""
        return self.finish(self.begin(b, layer, q, positions, scale, base2))

    def begin(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float,
        base2: bool = False,
    ) -> Pending:  # fmt: skip
        """:meth:`attend`'s first half: the groups planned and decided, every holder call sent.
        It returns with the calls in flight, so the caller computes its own partial meanwhile,
        and hands the result to :meth:`finish`, or to :meth:`abandon` if it gives up."""
        c = self.catalog.run(self.catalog.at_layer(b.corpus_id, layer))
        groups = c.plan(positions.to("cpu", torch.int64))
        h, kv_dim = q.shape[1], q.shape[2]
        cache = self._cache(q.device) if self.chooser.force != "route" else None
        before = cache.stats() if cache is not None else {}
        if cache is not None:
            self.chooser.measure_local(q.device, h, kv_dim, self.catalog.geometry.d_v, base2)
        work = [self._decide(c.corpus_id, layer, g, h, kv_dim, cache) for g in groups]
        q_cpu = q.detach().cpu() if any(d.pick == "route" for _, d, _ in work) else None
        fut = asyncio.run_coroutine_threadsafe(
            self._remote(c, layer, q_cpu, scale, work), self.catalog.loop
        )
        return Pending(c, layer, q, scale, base2, groups, work, cache, before, fut)

    def finish(self, p: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend`'s second half: the cached groups computed here, the holder calls
        waited for, every fetched group's time recorded (routes are recorded by the engine),
        one LSE merge."""
        try:
            results, took = self._serve(p)
        except BaseException:
            self.abandon(p)
            raise
        engine = self.catalog.fanout
        for (g, d, plan), t in zip(p.work, took, strict=True):
            if t >= 0:
                missing = len(plan.fill_pages) if plan is not None else 0
                engine.record(p.layer, g, d, t, self.chooser.forced, fetched_pages=missing)
        if p.cache is not None:
            self.metrics.cache_stats(p.before, p.cache.stats())
        p.c.rebalance()
        return merge_groups(p.q, self.catalog.geometry.d_v, p.groups, results, torch.float32)

    def abandon(self, p: Pending) -> None:
        """Give up a begun attend: its cache slots planned for pages that never came must not
        read as hits (the calls in flight run out unread)."""
        for _, _, plan in p.work:
            if plan is not None and p.cache is not None:
                p.cache.drop(p.layer, p.c.corpus_id, plan.fill_pages)

    def _serve(self, p: Pending) -> tuple[list[PartialOut], list[float]]:
        """Each group's partial and measured seconds (-1: recorded already, by the engine)."""
        cache, layer, q, scale, base2, work = p.cache, p.layer, p.q, p.scale, p.base2, p.work
        results: list[PartialOut | None] = [None] * len(work)
        took = [0.0] * len(work)
        for i, (g, _, plan) in enumerate(work):  # cached pages: computed while the RPCs run
            if plan is not None and not plan.fill_pages:
                results[i], took[i] = self._fetch_partial(layer, q, g, plan, scale, base2)
        for i, got in enumerate(p.fut.result(self.catalog.timeout)):
            g, d, plan = work[i]
            if got is None:
                continue
            kind, payload, seconds = got
            if kind == "route":
                results[i], took[i] = payload, seconds
            elif kind == "fetched" and plan is not None and cache is not None:
                cache.fill(layer, plan.fill_slots, payload)
                results[i], t = self._fetch_partial(layer, q, g, plan, scale, base2)
                took[i] = seconds + t
            else:  # the fetch failed: its pages are not cached, the group is routed instead
                assert plan is not None and cache is not None, kind
                cache.drop(layer, p.c.corpus_id, plan.fill_pages)
                self.metrics.fallbacks.labels("fetch", "route").inc()
                route = Decision("route", d.predicted_us, fallback="fetch")
                results[i] = self.catalog.run(self._route(p.c, layer, q.detach().cpu(), g,
                                                          scale, route))  # fmt: skip
                took[i] = -1.0
        assert all(r is not None for r in results), "a group was not served"
        return [r for r in results if r is not None], took

    def _cache(self, device: torch.device) -> PageCache | None:
        if self.cache_bytes <= 0:
            return None
        if self.cache is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # FlashMLA: bf16
            geo = self.catalog.geometry
            self.cache = PageCache(
                self.n_layers, self.catalog.page_size, geo.kv_dim, self.cache_bytes, dtype, device
            )
            log.info("corpusd plugin: fetch page cache, %d pages per layer on %s",
                     self.cache.slots, device)  # fmt: skip
        return self.cache

    def _decide(
        self, corpus_id: str, layer: int, g: GroupWork, h: int, kv_dim: int,
        cache: PageCache | None,
    ) -> Work:  # fmt: skip
        """The chooser's pick for group ``g`` and, for fetch, its cache plan (slots pinned)."""
        p = self.catalog.page_size
        pages = (g.canon[g.canon >= 0] // p).unique().tolist()
        missing = cache.missing(layer, corpus_id, pages) if cache is not None else len(pages)
        fits = cache is not None and len(pages) <= cache.slots
        page_bytes = p * kv_dim * self._wire_itemsize
        d = self.chooser.decide(g, h, kv_dim, self.catalog.geometry.d_v, missing, page_bytes, fits)
        if d.pick != "fetch":
            return g, d, None
        assert cache is not None
        try:
            return g, d, cache.plan(layer, corpus_id, g.canon)
        except PageCacheFull as e:  # pinned by another corpus's call of this step
            log.info("layer %d holder %s: fetch does not fit (%s); routing", layer, g.address, e)
            self.metrics.fallbacks.labels("fetch", "route").inc()
            return g, Decision("route", d.predicted_us, fallback="fetch"), None

    def _fetch_partial(
        self, layer: int, q: torch.Tensor, g: GroupWork, plan: Plan, scale: float, base2: bool
    ) -> tuple[PartialOut, float]:
        """The group's partial over the page cache on ``q``'s device, and its seconds."""
        assert self.cache is not None
        t0 = time.perf_counter()
        rows = pad_cols(plan.rows, TOPK_ALIGN).to(q.device)
        o, lse = sparse_partial(q[g.keep.to(q.device)], self.cache.kv(layer), rows, scale,
                                self.catalog.geometry.d_v, base2)  # fmt: skip
        # Rounded as a holder's reply is (O in q's dtype, holder/service.py), so route and fetch
        # give the same partial: on an H100 fetch's float32 O parted from route's bf16 O at 2 of
        # 64 teacher-forced near-ties (bench/results/sglang-predicate-h100.json). SGLang casts
        # the merged output to bf16 anyway.
        part = (o.to(q.dtype).float(), lse)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return part, time.perf_counter() - t0

    async def _route(
        self, c: CorpusBinding, layer: int, q: torch.Tensor, g: GroupWork, scale: float,
        d: Decision,
    ) -> PartialOut:  # fmt: skip
        """Group ``g`` routed by the engine (failover and the decision's record included)."""
        offsets = torch.zeros(len(q), dtype=torch.int64)  # SGLang's corpus sits at position 0
        return await c.serve(LayerCall(layer, q, offsets, scale), g, d, self.chooser.forced)

    async def _remote(
        self,
        c: CorpusBinding,
        layer: int,
        q: torch.Tensor | None,
        scale: float,
        work: list[Work],
    ) -> list[Got]:
        """Every group's holder call, concurrently: route's partial (``("route", partial,
        -1)``: the engine recorded it), or fetch's missing pages (``("fetched", latent [m, P,
        kv_dim], s)``; ``("failed", None, s)`` when the holder call failed or brought pages the
        cache cannot hold), or None (a fetch with every page cached)."""

        async def one(g: GroupWork, d: Decision, plan: Plan | None) -> Got:
            t0 = time.perf_counter()
            if plan is None:
                assert q is not None
                return "route", await self._route(c, layer, q, g, scale, d), -1.0
            if not plan.fill_pages:
                return None
            try:
                lat = await c.pull(layer, g.address, plan.fill_pages)
            except (grpc.aio.AioRpcError, StatusError) as e:
                code, detail = self.catalog.fanout.failed(e)
                log.warning("fetch from holder %s failed (%s: %s); routing its rows",
                            g.address, code.name, detail)  # fmt: skip
                return "failed", None, time.perf_counter() - t0
            want = (len(plan.fill_pages), self.catalog.page_size, self.catalog.geometry.kv_dim)
            if tuple(lat.shape) != want or not lat.is_floating_point():
                # e.g. a pin in FlashMLA's fp8 page format: not rows this cache can hold
                log.warning("fetch from holder %s: pages %s %s, want %s float rows; routing",
                            g.address, list(lat.shape), lat.dtype, list(want))  # fmt: skip
                return "failed", None, time.perf_counter() - t0
            self._wire_itemsize = lat.element_size()
            return "fetched", lat, time.perf_counter() - t0

        return list(await asyncio.gather(*(one(*w) for w in work)))


def pad_cols(rows: torch.Tensor, multiple: int) -> torch.Tensor:
    """``rows [n, k]`` with ``-1`` columns appended up to a multiple of ``multiple`` (at least
    one block: FlashMLA takes no empty top-k)."""
    k = rows.shape[1]
    width = max(multiple, -(-k // multiple) * multiple)
    return torch.cat([rows, rows.new_full((rows.shape[0], width - k), -1)], dim=1)
