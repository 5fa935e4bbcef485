"""A synchronous handle on corpusd for code that runs inside SGLang's forward pass.

SGLang's model forward is synchronous; corpusd's clients are asyncio. The link runs one event
loop on a daemon thread and blocks the caller on each call (``run_coroutine_threadsafe``), with a
timeout. Per corpus it keeps the name's resolution (once, against the coordinator) and a
:class:`~requester.fanout.CorpusBinding` of corpusd's fan-out engine, the same one corpusd's own
worker uses: the page table (attention calls go straight to the holders of the selected pages),
failover (replicas, then the page table as the coordinator says now), and per layer the
corpus's index keys (streamed once, then put through SGLang's fp8 format so the corpus's keys
score at the precision of the request's own keys).

``attend`` serves each holder group of a layer call by route or fetch, as the plugin's
:class:`~.choose.Chooser` decides: fetched pages live in a :class:`~.page_cache.PageCache` on the
queries' GPU and are attended there (NOTES.md, "Route or fetch").

Bound corpora follow their page tables (:mod:`.follow`): from the first ``attend`` on, a task on
the loop re-reads them, and a changed view is adopted at the first layer of a forward, so every
layer of one forward plans on one view.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import PartialOut as Partial
from corpusd.model import ModelConfig
from indexer.fp8 import fp8_view
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding, Fanout
from requester.plan import Geometry, GroupWork, failure, holder_groups, merge_groups
from requester.predicate import Decision, Predicate, Profile
from requester.sglang.binding import Binding, PinnedCorpus, resolve
from requester.sglang.choose import Chooser
from requester.sglang.device import sparse_partial
from requester.sglang.follow import follow
from requester.sglang.formats import holder_format
from requester.sglang.link_device import DeviceLink
from requester.sglang.metrics import PluginMetrics, Timings
from requester.sglang.page_cache import PageCache, PageCacheFull, Plan
from requester.sglang.pages import engine_index_keys
from requester.table_refresh import Staged, adopt

log = logging.getLogger("corpusd.sglang")

T = TypeVar("T")


class _Fanout(Fanout):
    """corpusd's fan-out engine for the link's route calls. The plugin's predicate decides and
    records each group itself (:class:`.choose.Chooser`), so the engine's own record, which
    would count every group a second time as a forced route, is off."""

    def record(self, *args: Any, **kw: Any) -> None:
        pass


#: FlashMLA's sparse kernel takes top-k in multiples of 128 on SM90 (corpusd/kernels/flashmla.py)
TOPK_ALIGN = 128


class CorpusLink(DeviceLink):
    """corpusd as SGLang's model sees it: ``bind`` a corpus name, then per layer ``index_keys``
    and ``attend``. ``cfg`` is the served model's config (widths, indexer); the corpus must
    have been pinned for ``fingerprint`` with ``page_size``-token pages. ``chooser`` picks route
    or fetch per (layer, holder group) (default: route, the defaults' profile); fetch keeps
    pages in a page cache of ``cache_bytes`` on the queries' device. ``table_refresh_s``: how
    often bound page tables are re-read (0: the coordinator's lease / 3; -1: never)."""

    def __init__(
        self,
        coordinator: str,
        cfg: ModelConfig,
        fingerprint: str,
        page_size: int,
        timeout: float = 60.0,
        chooser: Chooser | None = None,
        cache_bytes: int = 0,
        store: str | None = None,
        table_refresh_s: float = 0.0,
    ) -> None:
        """``store``: a page store this process can read (``$CORPUSD_STORE``), or None; engine
        pins found there have their index keys scored as SGLang computed them."""
        if not coordinator:
            raise ValueError(
                "corpusd plugin: no coordinator address; set CORPUSD_COORDINATOR=host:port"
            )
        self.coordinator, self.fingerprint, self.page_size = coordinator, fingerprint, page_size
        self.timeout = timeout
        assert table_refresh_s >= 0 or table_refresh_s == -1, f"{table_refresh_s=}"
        self.table_refresh_s = table_refresh_s
        # float32: keys and partials as the holders send them (bf16 or fp32, widened exactly)
        self.geometry = Geometry.of_config(cfg, torch.float32)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="corpusd-link"
        )
        self._thread.start()
        self.metrics = chooser.metrics if chooser is not None else PluginMetrics()
        self.chooser = chooser or Chooser(Predicate(Profile(), "route"), self.metrics)
        if self.chooser.force == "fetch" and cache_bytes <= 0:
            raise ValueError(
                "corpusd plugin: CORPUSD_SGLANG_PRIMITIVE=fetch needs a page cache; "
                "CORPUSD_SGLANG_PAGE_CACHE_MB is 0"
            )
        self.n_layers, self.cache_bytes = cfg.num_hidden_layers, cache_bytes
        self.cache: PageCache | None = None
        self._wire_itemsize = 4  # a fetched page's bytes per value, learnt from the first fetch
        # The engine's predicate is never asked (the chooser decides): its groups are routes.
        self.fanout = _Fanout(
            Predicate(Profile(), "route"), self.metrics, transport="grpc", rpc_timeout_s=timeout
        )
        self._bindings: dict[str, Binding] = {}
        self._gone: dict[str, Binding] = {}  # bindings a recheck forgot (``bound``)
        self.corpora: dict[str, CorpusBinding] = {}
        self.staged: Staged = {}  # re-read views waiting for a forward's first layer (follow.py)
        self._following: asyncio.Task[None] | None = None
        self._first_layer = 1 << 30  # the lowest layer attended yet: where a forward starts
        self._keys: dict[tuple[str, int], torch.Tensor] = {}
        self.store = PageStore(store) if store and Path(store, "corpora").is_dir() else None
        self.timings = Timings()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def close(self) -> None:
        self.chooser.close()
        self._run(self._stop_following())
        self._run(self.fanout.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def bind(self, name: str) -> Binding:
        """The binding of corpus ``name`` (cached). Raises CorpusBindingError (unknown, not
        ready, pinned for another model or page size)."""
        b = self._bindings.get(name)  # (a recheck on the link's loop may drop it meanwhile)
        if b is None:
            corpora = self._run(self._list())
            b = self._bindings[name] = resolve(name, corpora, self.fingerprint, self.page_size)
        return b

    def bound(self, name: str) -> Binding:
        """The binding a forward uses for a request admission bound to ``name``: as admission
        bound it, also when a recheck has since forgotten the name (admission refuses new
        requests to it; the ones already admitted run on), so the forward asks nothing and
        raises nothing a recheck caused."""
        b = self._bindings.get(name) or self._gone.get(name)
        return b if b is not None else self.bind(name)

    async def _list(self) -> list[PinnedCorpus]:
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            return [
                PinnedCorpus(
                    s.corpus_id, s.name, s.state, s.tokens, s.page_size, s.model_fingerprint
                )
                for s in await c.list_corpora()
            ]

    def index_keys(self, b: Binding, layer: int, device: torch.device, ue8m0: bool) -> torch.Tensor:
        """float32 ``[T, D_I]`` on ``device``: the corpus's index keys for ``layer`` as SGLang's
        indexer scores its own (rotated, fp8 round trip, per-token scales; cached). The same
        values as its pages (:func:`..pagehash.index_k_page`), without the bytes; an engine pin
        in this process's store: the values of the pages SGLang computed."""
        key = (b.corpus_id, layer)
        if key not in self._keys:
            exact = engine_index_keys(self.store, b.corpus_id, layer) if self.store else None
            if exact is not None:  # an engine pin: its keys as SGLang holds them
                self._keys[key] = exact.to(device)
            else:
                keys = self._run(self._index_keys(b.corpus_id, layer))
                self._keys[key] = fp8_view(keys, ue8m0).to(device)
        return self._keys[key]

    async def _index_keys(self, corpus_id: str, layer: int) -> torch.Tensor:
        return await (await self._corpus(corpus_id)).index_keys(layer)

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
        ``layer.scaling``). Per holder group the chooser picks: **route** (the group's rows to
        the holder over gRPC, failed over as corpusd's worker's are) or **fetch** (missing pages
        pulled into the page cache, then :func:`.device.sparse_partial` over cache rows on
        ``q``'s device; ``base2``: that kernel's LSE base). Groups run concurrently; one LSE
        merge. :meth:`begin` then :meth:`finish`, with nothing between."""
        return self.finish(self.begin(b, layer, q, positions, scale, base2))

    def begin(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float,
        base2: bool = False,
    ) -> Pending:  # fmt: skip
        """:meth:`attend`'s first half: the groups decided and every holder call sent. It
        returns with the calls in flight, so the caller computes its own partial meanwhile
        (issue 17: start the corpus call, compute SGLang's partial, then wait), and hands the
        result to :meth:`finish`, or to :meth:`abandon` if it gives up."""
        c = self._run(self._bound(b.corpus_id, layer))
        groups = holder_groups(c.view, positions.to("cpu", torch.int64))
        h, kv_dim = q.shape[1], q.shape[2]
        cache = self._cache(q.device) if self.chooser.force != "route" else None
        before = cache.stats() if cache is not None else {}
        if cache is not None:
            self.chooser.measure_local(q.device, h, kv_dim, self.geometry.d_v, base2)
        work = [self._decide(c.corpus_id, layer, g, h, kv_dim, cache) for g in groups]
        q_cpu = q.detach().cpu() if any(d.pick == "route" for _, d, _ in work) else None
        fut = asyncio.run_coroutine_threadsafe(
            self._remote(c, layer, q_cpu, scale, work), self._loop
        )
        return Pending(c, layer, q, scale, base2, groups, work, cache, before, fut)

    def finish(self, p: Pending) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend`'s second half: the cached groups computed here, the holder calls
        waited for, every group's time recorded, one LSE merge."""
        try:
            results, took = self._serve(p)
        except BaseException:
            self.abandon(p)
            raise
        for (g, d, plan), t in zip(p.work, took, strict=True):
            if t >= 0:
                missing = len(plan.fill_pages) if plan is not None else 0
                self.chooser.record(p.layer, g, d, t, fetched_pages=missing)
        if p.cache is not None:
            self.metrics.cache_stats(p.before, p.cache.stats())
        return merge_groups(p.q, self.geometry.d_v, p.groups, results, torch.float32)

    def abandon(self, p: Pending) -> None:
        """Give up a begun attend: its cache slots planned for pages that never came must not
        read as hits (the calls in flight run out unread)."""
        for _, _, plan in p.work:
            if plan is not None and p.cache is not None:
                p.cache.drop(p.layer, p.c.corpus_id, plan.fill_pages)

    def _serve(self, p: Pending) -> tuple[list[Partial], list[float]]:
        """Each group's partial and measured seconds (-1: a failed fetch, routed instead)."""
        cache, layer, q, scale, base2, work = p.cache, p.layer, p.q, p.scale, p.base2, p.work
        results: list[Partial | None] = [None] * len(work)
        took = [0.0] * len(work)
        for i, (g, _, plan) in enumerate(work):  # cached pages: computed while the RPCs run
            if plan is not None and not plan.fill_pages:
                results[i], took[i] = self._fetch_partial(layer, q, g, plan, scale, base2)
        for i, got in enumerate(p.fut.result(self.timeout)):
            g, _, plan = work[i]
            if got is None:
                continue
            kind, payload, seconds = got
            if kind == "route":
                results[i], took[i] = payload, seconds
            elif kind == "fetched" and plan is not None and cache is not None:
                cache.fill(layer, plan.fill_slots, payload)
                self.metrics.fetched_bytes.inc(payload.nbytes)
                results[i], t = self._fetch_partial(layer, q, g, plan, scale, base2)
                took[i] = seconds + t
            else:  # the fetch failed: its pages are not cached, the holder call fails over
                assert plan is not None and cache is not None, kind
                cache.drop(layer, p.c.corpus_id, plan.fill_pages)
                self.metrics.fallbacks.labels("fetch", "route").inc()
                again = p.c.attend(layer, q.detach().cpu()[g.keep], g.canon, scale=scale,
                                   dtype=torch.float32)  # fmt: skip
                results[i], took[i] = self._run(again), -1.0  # -1: not recorded
        assert all(r is not None for r in results), "a group was not served"
        return [r for r in results if r is not None], took

    def _cache(self, device: torch.device) -> PageCache | None:
        if self.cache_bytes <= 0:
            return None
        if self.cache is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # FlashMLA: bf16
            self.cache = PageCache(
                self.n_layers, self.page_size, self.geometry.kv_dim, self.cache_bytes, dtype,
                device,
            )  # fmt: skip
            log.info("corpusd plugin: fetch page cache, %d pages per layer on %s",
                     self.cache.slots, device)  # fmt: skip
        return self.cache

    def _decide(
        self, corpus_id: str, layer: int, g: GroupWork, h: int, kv_dim: int,
        cache: PageCache | None,
    ) -> tuple[GroupWork, Decision, Plan | None]:  # fmt: skip
        """The chooser's pick for group ``g`` and, for fetch, its cache plan (slots pinned)."""
        pages = (g.canon[g.canon >= 0] // self.page_size).unique().tolist()
        missing = cache.missing(layer, corpus_id, pages) if cache is not None else len(pages)
        fits = cache is not None and len(pages) <= cache.slots
        page_bytes = self.page_size * kv_dim * self._wire_itemsize
        d = self.chooser.decide(g, h, kv_dim, self.geometry.d_v, missing, page_bytes, fits)
        if d.pick != "fetch":
            return g, d, None
        assert cache is not None
        try:
            return g, d, cache.plan(layer, corpus_id, g.canon)
        except PageCacheFull as e:  # pinned by another corpus's call of this step
            log.info("layer %d holder %s: fetch does not fit (%s); routing", layer, g.address, e)
            self.metrics.fallbacks.labels("fetch", "route").inc()
            return g, Decision("route", d.predicted_us), None

    def _fetch_partial(
        self, layer: int, q: torch.Tensor, g: GroupWork, plan: Plan, scale: float, base2: bool
    ) -> tuple[Partial, float]:
        """The group's partial over the page cache on ``q``'s device, and its seconds."""
        assert self.cache is not None
        t0 = time.perf_counter()
        rows = pad_cols(plan.rows, TOPK_ALIGN).to(q.device)
        o, lse = sparse_partial(q[g.keep.to(q.device)], self.cache.kv(layer), rows, scale,
                                self.geometry.d_v, base2)  # fmt: skip
        # Rounded as a holder's reply is (O in q's dtype, holder/service.py), so route and fetch
        # give the same partial: on an H100 fetch's float32 O parted from route's bf16 O at 2 of
        # 64 teacher-forced near-ties (bench/results/sglang-predicate-h100.json). SGLang casts
        # the merged output to bf16 anyway.
        part = (o.to(q.dtype).float(), lse)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return part, time.perf_counter() - t0

    async def _remote(
        self,
        c: CorpusBinding,
        layer: int,
        q: torch.Tensor | None,
        scale: float,
        work: list[tuple[GroupWork, Decision, Plan | None]],
    ) -> list[tuple[str, Any, float] | None]:
        """Every group's holder call, concurrently: route's partial, or fetch's missing pages
        (``("fetched", latent [m, P, kv_dim], s)``; ``("failed", None, s)`` when the holder
        call failed), or None (a fetch with every page cached)."""

        Got = tuple[str, Any, float] | None

        async def one(g: GroupWork, d: Decision, plan: Plan | None) -> Got:
            t0 = time.perf_counter()
            if plan is None:
                assert q is not None
                part = await c.attend(layer, q[g.keep], g.canon, scale=scale, dtype=torch.float32)
                return "route", part, time.perf_counter() - t0
            if not plan.fill_pages:
                return None
            try:
                lat, _ = await self.fanout.client(g.address).fetch(
                    c.corpus_id, plan.fill_pages, layers=[layer]
                )
            except grpc.aio.AioRpcError as e:
                code, detail = failure(e)
                self.metrics.errors.labels(code.name).inc()
                log.warning("fetch from holder %s failed (%s: %s); routing its rows",
                            g.address, code.name, detail)  # fmt: skip
                return "failed", None, time.perf_counter() - t0
            want = (len(plan.fill_pages), self.page_size, self.geometry.kv_dim)
            if tuple(lat[0].shape) != want or not lat[0].is_floating_point():
                # e.g. a pin in FlashMLA's fp8 page format: not rows this cache can hold
                log.warning("fetch from holder %s: pages %s %s, want %s float rows; routing",
                            g.address, list(lat[0].shape), lat[0].dtype, list(want))  # fmt: skip
                return "failed", None, time.perf_counter() - t0
            self._wire_itemsize = lat[0].element_size()
            return "fetched", lat[0], time.perf_counter() - t0

        return list(await asyncio.gather(*(one(*w) for w in work)))

    async def _corpus(self, corpus_id: str) -> CorpusBinding:
        if corpus_id not in self.corpora:
            view = await self._page_table(corpus_id)
            self.corpora[corpus_id] = await self.fanout.bind(
                view, self.geometry, refresh=lambda: self._page_table(corpus_id)
            )
        return self.corpora[corpus_id]

    async def _bound(self, corpus_id: str, layer: int) -> CorpusBinding:
        """The binding an attend at ``layer`` plans on. At a forward's first layer (0; the
        lowest this link attends, were its model split into stages) a view the re-read staged
        is adopted first; at any other layer it waits, so one forward plans on one view. Starts
        the re-read (host path only: the device path never attends through the link)."""
        c = await self._corpus(corpus_id)
        if self._following is None and self.table_refresh_s != -1:
            self._following = asyncio.create_task(
                follow(self, self.coordinator, self.table_refresh_s, self.timeout)
            )
        self._first_layer = min(self._first_layer, layer)
        if layer == self._first_layer and adopt(self.corpora, self.staged, only=corpus_id):
            log.info("corpus %s: layer %d adopts its re-read page table (%d holders)",
                     corpus_id[:12], layer, len(c.view.holders))  # fmt: skip
        return c

    async def _stop_following(self) -> None:
        if self._following is not None:
            self._following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._following
            self._following = None

    async def _page_table(self, corpus_id: str) -> CorpusView:
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            return CorpusView.from_page_table(await c.page_table(corpus_id))

    def holder_formats(self) -> dict[str, str]:
        """Each registered holder's row format, address → ``plain`` or ``fp8_e4m3``."""
        return self._run(self._holder_formats())

    async def _holder_formats(self) -> dict[str, str]:
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            return {h.info.address: holder_format(h.info.dtype) for h in await c.list_holders()}


@dataclass
class Pending:
    """An attend :meth:`CorpusLink.begin` started: its plan and its holder calls in flight."""

    c: CorpusBinding
    layer: int
    q: torch.Tensor
    scale: float
    base2: bool
    groups: list[GroupWork]
    work: list[tuple[GroupWork, Decision, Plan | None]]
    cache: PageCache | None
    before: dict[str, int]
    fut: concurrent.futures.Future[list[tuple[str, Any, float] | None]]


def pad_cols(rows: torch.Tensor, multiple: int) -> torch.Tensor:
    """``rows [n, k]`` with ``-1`` columns appended up to a multiple of ``multiple`` (at least
    one block: FlashMLA takes no empty top-k)."""
    k = rows.shape[1]
    width = max(multiple, -(-k // multiple) * multiple)
    return torch.cat([rows, rows.new_full((rows.shape[0], width - k), -1)], dim=1)
