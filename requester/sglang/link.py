"""A synchronous handle on corpusd for code that runs inside SGLang's forward pass.

SGLang's model forward is synchronous; corpusd's clients are asyncio. The link runs one event
loop on a daemon thread and blocks the caller on each call (``run_coroutine_threadsafe``), with a
timeout. Per corpus it keeps the name's resolution (once, against the coordinator) and a
:class:`~requester.fanout.CorpusBinding` of corpusd's fan-out engine, the same one corpusd's own
worker uses: the page table (attention calls go straight to the holders of the selected pages),
failover (replicas, then the page table as the coordinator says now), and per layer the
corpus's index keys (streamed once, then put through SGLang's fp8 format so the corpus's keys
score at the precision of the request's own keys).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig
from corpusd.transport import cuda_ipc
from indexer.fp8 import fp8_view
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding, Fanout
from requester.metrics import RequesterMetrics
from requester.plan import Geometry
from requester.predicate import Predicate, Profile
from requester.sglang.binding import Binding, PinnedCorpus, resolve
from requester.sglang.pages import engine_index_keys, engine_index_pages
from requester.sglang.resident import ArenaCorpus, Resident

log = logging.getLogger("corpusd.sglang")

T = TypeVar("T")


class Timings:
    """Where the plugin's time goes, logged every ``every_s`` seconds as mean ms per call of each
    stage (the SGLang log is where a user looks; SGLang's own metrics time the whole step)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._since = time.monotonic()
        self._sums: dict[str, list[float]] = {}

    def add(self, stage: str, seconds: float) -> None:
        acc = self._sums.setdefault(stage, [0.0, 0.0])
        acc[0] += seconds
        acc[1] += 1
        if time.monotonic() - self._since >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self._sums:
            parts = [f"{k} {1e3 * s / n:.2f} ms × {n:.0f}" for k, (s, n) in self._sums.items()]
            log.info("corpusd plugin, per call: %s", ", ".join(parts))
        self._sums, self._since = {}, time.monotonic()


class CorpusLink:
    """corpusd as SGLang's model sees it: ``bind`` a corpus name, then per layer ``index_keys``
    and ``attend``. ``cfg`` is the served model's config (widths, indexer); the corpus must
    have been pinned for ``fingerprint`` with ``page_size``-token pages."""

    def __init__(
        self,
        coordinator: str,
        cfg: ModelConfig,
        fingerprint: str,
        page_size: int,
        timeout: float = 60.0,
        store: str | None = None,
    ) -> None:
        """``store``: a page store this process can read (``$CORPUSD_STORE``), or None; engine
        pins found there have their index keys scored as SGLang computed them."""
        if not coordinator:
            raise ValueError(
                "corpusd plugin: no coordinator address; set CORPUSD_COORDINATOR=host:port"
            )
        self.coordinator, self.fingerprint, self.page_size = coordinator, fingerprint, page_size
        self.timeout = timeout
        # float32: keys and partials as the holders send them (bf16 or fp32, widened exactly)
        self.geometry = Geometry.of_config(cfg, torch.float32)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="corpusd-link"
        )
        self._thread.start()
        # Route only: the plugin has no page cache of its own yet (issue 17 adds one).
        self.fanout = Fanout(
            Predicate(Profile(), "route"), RequesterMetrics(), transport="grpc",
            rpc_timeout_s=timeout,
        )  # fmt: skip
        self._bindings: dict[str, Binding] = {}
        self._corpora: dict[str, CorpusBinding] = {}
        self._keys: dict[tuple[str, int], torch.Tensor] = {}
        self.store = PageStore(store) if store and Path(store, "corpora").is_dir() else None
        self.timings = Timings()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def close(self) -> None:
        self._run(self.fanout.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def bind(self, name: str) -> Binding:
        """The binding of corpus ``name`` (cached). Raises CorpusBindingError (unknown, not
        ready, pinned for another model or page size)."""
        if name not in self._bindings:
            corpora = self._run(self._list())
            self._bindings[name] = resolve(name, corpora, self.fingerprint, self.page_size)
        return self._bindings[name]

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

    def attend(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged ``(O [n, h, d_v] float32, LSE [n, h] natural, -inf empty)`` of
        ``q [n, h, kv_dim]`` (corpusd's rope layout, full head count) over canonical
        ``positions [n, k]`` (-1 unused), scores scaled by ``scale`` (SGLang's
        ``layer.scaling``): one call per holder holding selected pages, concurrently, merged
        here; a failed holder's rows fail over as corpusd's worker's do."""
        return self._run(self._attend(b.corpus_id, layer, q, positions, scale))

    async def _attend(
        self, corpus_id: str, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = await self._corpus(corpus_id)
        return await c.attend(layer, q, positions, scale=scale, dtype=torch.float32)

    async def _corpus(self, corpus_id: str) -> CorpusBinding:
        if corpus_id not in self._corpora:
            view = await self._page_table(corpus_id)
            self._corpora[corpus_id] = await self.fanout.bind(
                view, self.geometry, refresh=lambda: self._page_table(corpus_id)
            )
        return self._corpora[corpus_id]

    async def _page_table(self, corpus_id: str) -> CorpusView:
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            return CorpusView.from_page_table(await c.page_table(corpus_id))

    # -- the device path (requester/sglang/resident.py) -------------------------------------------
    def map_holders(self, res: Resident, device: torch.device) -> list[str]:
        """Map the pools of every registered holder on ``device`` into ``res`` (CUDA IPC);
        returns their addresses. Holders elsewhere, or on the CPU, are skipped (logged)."""
        return self._run(self._map_holders(res, device))

    async def _map_holders(self, res: Resident, device: torch.device) -> list[str]:
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            holders = [h.info for h in await c.list_holders()]
        here = cuda_ipc.device_uuid(device)
        mapped = []
        for h in holders:
            if not h.device.startswith("cuda") or h.address in res.holder_slot:
                continue
            try:
                shared, page_size, _ = await self.fanout.client(h.address).share_pool(here)
            except grpc.aio.AioRpcError as e:
                log.info("holder %s not mapped: %s", h.address, e.details())
                continue
            if page_size != res.page_size or shared[0].dtype != "bfloat16":
                log.warning(
                    "holder %s not mapped: %d-token %s pages (the device path needs %d-token "
                    "bfloat16 pages)", h.address, page_size, shared[0].dtype, res.page_size,
                )  # fmt: skip
                continue
            res.add_pool(h.address, [cuda_ipc.open_shared(s) for s in shared])
            mapped.append(h.address)
        log.info("corpusd plugin: %d holder pools on this GPU mapped: %s", len(mapped), mapped)
        return mapped

    def load_resident(self, b: Binding, res: Resident) -> ArenaCorpus:
        """Corpus ``b`` in ``res``'s arena (loaded once: its page table and every layer's
        index keys). Raises CorpusBindingError when it cannot be served from this GPU."""
        if b.corpus_id in res.corpora:
            return res.corpora[b.corpus_id]
        res.check(b.corpus_id, b.tokens)
        view, keys = self._run(self._resident_inputs(b.corpus_id, res.n_layers))
        return res.load(view, keys)

    async def _resident_inputs(
        self, corpus_id: str, n_layers: int
    ) -> tuple[CorpusView, list[torch.Tensor]]:
        c = await self._corpus(corpus_id)
        keys = []
        for layer in range(n_layers):
            pages = engine_index_pages(self.store, corpus_id, layer) if self.store else None
            keys.append(pages if pages is not None else await c.index_keys(layer))
        return c.view, keys
