"""What an SGLang process knows of corpusd: its corpora by name and by id, on one event loop.

SGLang's model forward is synchronous; corpusd's clients are asyncio. The catalog runs one event
loop on a daemon thread and blocks the caller on each call (:meth:`CorpusCatalog.run`), with a
timeout. It keeps:

- **names → bindings**: a request's corpus name resolved once against the coordinator
  (:func:`.binding.resolve`), and rechecked at most once a second (:meth:`recheck`), so a name
  unpinned or pinned anew is bound afresh;
- **corpus id → the fan-out engine's binding** (:class:`requester.fanout.CorpusBinding`, the
  same one corpusd's own worker uses): the page table, failover, and per layer the corpus's
  index keys (streamed once, then put through SGLang's fp8 format so the corpus's keys score at
  the precision of the request's own keys);
- the page tables those bindings follow (:mod:`.follow`): from the first host-path call on, a
  task on the loop re-reads them, and a changed view is adopted at the first layer of a
  forward, so every layer of one forward plans on one view.

The two executors read their corpora here: :class:`.host_path.HostPath` per layer,
:class:`.device_path.DevicePath` at a prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any, TypeVar

import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig
from indexer.fp8 import fp8_view
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding, Fanout
from requester.metrics import RequesterMetrics
from requester.plan import Geometry
from requester.sglang.binding import Binding, CorpusBindingError, PinnedCorpus, resolve
from requester.sglang.follow import follow
from requester.sglang.formats import holder_format
from requester.sglang.pages import engine_index_keys
from requester.sglang.resident import Resident, placement
from requester.table_refresh import Staged, adopt

log = logging.getLogger("corpusd.sglang")

T = TypeVar("T")

#: Admission re-reads the coordinator's corpora at most this often (seconds). An unpinned
#: corpus's frames go back to its holders' free lists at once and the next pin may take them;
#: from this long after an unpin no new request is served from them.
RECHECK_S = 1.0


class CorpusCatalog:
    """The corpora of the coordinator at ``coordinator`` as this SGLang process serves them
    through ``fanout``, its fan-out engine (whose holder connections live on this catalog's
    loop); see the module docstring. ``cfg`` is the served model's config; a corpus binds when
    it was pinned for ``fingerprint`` with ``page_size``-token pages. ``store``: a page store
    this process can read (``$CORPUSD_STORE``), or None; engine pins found there have their
    index keys scored as SGLang computed them. ``table_refresh_s``: how often bound page tables
    are re-read (0: the coordinator's lease / 3; -1: never)."""

    def __init__(
        self,
        fanout: Fanout,
        coordinator: str,
        cfg: ModelConfig,
        fingerprint: str,
        page_size: int,
        timeout: float = 60.0,
        store: str | None = None,
        table_refresh_s: float = 0.0,
    ) -> None:
        if not coordinator:
            raise ValueError(
                "corpusd plugin: no coordinator address; set CORPUSD_COORDINATOR=host:port"
            )
        assert table_refresh_s >= 0 or table_refresh_s == -1, f"{table_refresh_s=}"
        self.coordinator, self.fingerprint, self.page_size = coordinator, fingerprint, page_size
        self.timeout, self.table_refresh_s, self.fanout = timeout, table_refresh_s, fanout
        # float32: keys and partials as the holders send them (bf16 or fp32, widened exactly)
        self.geometry = Geometry.of_config(cfg, torch.float32)
        self.store = PageStore(store) if store and Path(store, "corpora").is_dir() else None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="corpusd-link"
        )
        self._thread.start()
        self._bindings: dict[str, Binding] = {}
        self._gone: dict[str, Binding] = {}  # bindings a recheck forgot (``bound``)
        self.corpora: dict[str, CorpusBinding] = {}
        self.staged: Staged = {}  # re-read views waiting for a forward's first layer (follow.py)
        self._following: asyncio.Task[None] | None = None
        self._first_layer = 1 << 30  # the lowest layer attended yet: where a forward starts
        self._keys: dict[tuple[str, int], torch.Tensor] = {}
        self._checked_at = 0.0  # time.monotonic() of the last recheck begun
        self._rechecking: Future[dict[str, str]] | None = None

    @property
    def metrics(self) -> RequesterMetrics:
        return self.fanout.metrics

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, run on the catalog's loop; raises its error, or TimeoutError."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def close(self) -> None:
        self.run(self._stop_following())
        self.run(self.fanout.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def client(self) -> CoordinatorClient:
        """A coordinator client (an async context manager), for use on the catalog's loop."""
        return CoordinatorClient(self.coordinator, timeout=self.timeout)

    # -- names ---------------------------------------------------------------------------------
    def bind(self, name: str) -> Binding:
        """The binding of corpus ``name`` (cached). Raises CorpusBindingError (unknown, not
        ready, pinned for another model or page size)."""
        b = self._bindings.get(name)  # (a recheck on the loop may drop it meanwhile)
        if b is None:
            corpora = self.run(self._list())
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
        async with self.client() as c:
            return [
                PinnedCorpus(
                    s.corpus_id,
                    s.name,
                    s.state,
                    s.tokens,
                    s.page_size,
                    s.model_fingerprint,
                    s.head_len,
                    s.head_digest,
                )
                for s in await c.list_corpora()
            ]

    def recheck(
        self, res: Resident | None, every_s: float = RECHECK_S, wait: bool = False
    ) -> dict[str, str]:
        """Forget what no longer holds, so the next request bound to it binds and loads afresh
        (or is refused, naming why): a bound name that no longer means its corpus (unpinned,
        retired, or a re-pin of changed content under the name), and on the device path a
        loaded corpus no longer ready or whose pages now sit in other frames (unpinned and
        pinned again). Without this both were served from frames their holders had freed,
        which the next pin may fill with another corpus's rows: wrong answers, no error.

        The coordinator is asked at most once per ``every_s`` seconds, on the loop, so the
        caller (admission, on SGLang's scheduler thread) never waits for it: a call applies
        the answer of the last one that is done (the arena is changed on the caller's thread)
        and starts the next when due; ``wait``: wait for the one it starts and apply it too.
        Returns corpus id → why, for those forgotten now. A coordinator that does not answer
        changes nothing (logged). Requests already running keep the tables their prefill
        recorded."""
        stale = self._apply_recheck(res)
        if self._rechecking is None and time.monotonic() - self._checked_at >= every_s:
            self._checked_at = time.monotonic()
            self._rechecking = asyncio.run_coroutine_threadsafe(self._recheck(res), self.loop)
            if wait:
                wait_for([self._rechecking], self.timeout)
                stale.update(self._apply_recheck(res))
        return stale

    def _apply_recheck(self, res: Resident | None) -> dict[str, str]:
        fut = self._rechecking
        if fut is None or not fut.done():
            return {}
        self._rechecking = None
        try:
            stale = fut.result()
        except Exception as e:  # keep serving what is bound; the next recheck tries again
            log.warning("corpusd plugin: could not re-check bound corpora with the coordinator "
                        "(%s: %s)", type(e).__name__, e)  # fmt: skip
            return {}
        for cid, why in stale.items():
            if res is not None:
                res.forget(cid)
            log.warning("corpusd plugin: corpus %s %s: forgotten; a request bound to it binds "
                        "anew", cid, why)  # fmt: skip
        return stale

    async def _recheck(self, res: Resident | None) -> dict[str, str]:
        listed = await self._list()
        stale: dict[str, str] = {}
        for name, b in list(self._bindings.items()):
            try:
                now: Binding | None = resolve(name, listed, self.fingerprint, self.page_size)
            except CorpusBindingError:
                now = None
            if now is None or now.corpus_id != b.corpus_id:
                self._gone[name] = self._bindings.pop(name)
                means = "nothing ready" if now is None else now.corpus_id
                stale.setdefault(b.corpus_id, f"(bound as {name!r}): the name now means {means}")
        ready = {c.corpus_id for c in listed if c.state == "ready"}
        loaded = list(res.corpora.values()) if res is not None else []  # one snapshot
        for c in loaded:
            if c.corpus_id not in ready:
                stale.setdefault(c.corpus_id, "is no longer pinned")
        placed = [c for c in loaded if c.corpus_id in ready]
        views = await asyncio.gather(*(self._page_table(c.corpus_id) for c in placed))
        for c, view in zip(placed, views, strict=True):
            if placement(view) != c.placement:
                stale.setdefault(c.corpus_id, "was placed anew (unpinned and pinned again)")
        if res is not None:  # the device path loads from the cached view: re-read it then
            for cid in stale:  # (the host path's views follow their tables: follow.py)
                self.corpora.pop(cid, None)
        return stale

    # -- corpora -------------------------------------------------------------------------------
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
                keys = self.run(self._index_keys(b.corpus_id, layer))
                self._keys[key] = fp8_view(keys, ue8m0).to(device)
        return self._keys[key]

    async def _index_keys(self, corpus_id: str, layer: int) -> torch.Tensor:
        return await (await self.corpus(corpus_id)).index_keys(layer)

    async def corpus(self, corpus_id: str) -> CorpusBinding:
        """The engine's binding of ``corpus_id`` (bound at the first call, on its page table)."""
        if corpus_id not in self.corpora:
            view = await self._page_table(corpus_id)
            self.corpora[corpus_id] = await self.fanout.bind(
                view, self.geometry, refresh=lambda: self._page_table(corpus_id)
            )
        return self.corpora[corpus_id]

    async def at_layer(self, corpus_id: str, layer: int) -> CorpusBinding:
        """The binding a host-path call at ``layer`` plans on. At a forward's first layer (0;
        the lowest attended, were the model split into stages) a view the re-read staged is
        adopted first; at any other layer it waits, so one forward plans on one view. Starts
        the re-read (host path only: the device path never plans per layer)."""
        c = await self.corpus(corpus_id)
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
        async with self.client() as c:
            return CorpusView.from_page_table(await c.page_table(corpus_id))

    def holder_formats(self) -> dict[str, str]:
        """Each registered holder's row format, address → ``plain`` or ``fp8_e4m3``."""
        return self.run(self._holder_formats())

    async def _holder_formats(self) -> dict[str, str]:
        async with self.client() as c:
            return {h.info.address: holder_format(h.info.dtype) for h in await c.list_holders()}
