"""The device path's half of :class:`.link.CorpusLink`: mapping the pools of the holders on the
server's GPU (CUDA IPC) and loading a bound corpus into the arena (``resident.py``). A mixin of
the link, kept apart because it is the device path's set-up, run eagerly at start and at a
prefill, never per layer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.corpus.store import PageStore
from corpusd.transport import cuda_ipc
from requester.corpus_view import CorpusView
from requester.fanout import CorpusBinding, Fanout
from requester.sglang.binding import Binding, CorpusBindingError, PinnedCorpus, resolve
from requester.sglang.pages import engine_index_pages
from requester.sglang.resident import ArenaCorpus, Resident, placement

log = logging.getLogger("corpusd.sglang")

T = TypeVar("T")

#: Admission re-reads the coordinator's corpora at most this often (seconds). An unpinned
#: corpus's frames go back to its holders' free lists at once and the next pin may take them;
#: from this long after an unpin no new request is served from them.
RECHECK_S = 1.0


class DeviceLink:
    """``map_holders`` and ``load_resident``, over the link's coordinator, fan-out and loop."""

    if TYPE_CHECKING:  # provided by CorpusLink
        coordinator: str
        timeout: float
        fanout: Fanout
        store: PageStore | None
        fingerprint: str
        page_size: int
        _bindings: dict[str, Binding]
        _gone: dict[str, Binding]
        corpora: dict[str, CorpusBinding]

        _loop: asyncio.AbstractEventLoop

        def _run(self, coro: Coroutine[Any, Any, T]) -> T: ...

        async def _corpus(self, corpus_id: str) -> CorpusBinding: ...

        async def _list(self) -> list[PinnedCorpus]: ...

        async def _page_table(self, corpus_id: str) -> CorpusView: ...

    _checked_at = 0.0  # time.monotonic() of the last recheck begun
    _rechecking: Future[dict[str, str]] | None = None

    def recheck(
        self, res: Resident | None, every_s: float = RECHECK_S, wait: bool = False
    ) -> dict[str, str]:
        """Forget what no longer holds, so the next request bound to it binds and loads afresh
        (or is refused, naming why): a bound name that no longer means its corpus (unpinned,
        retired, or a re-pin of changed content under the name), and on the device path a
        loaded corpus no longer ready or whose pages now sit in other frames (unpinned and
        pinned again). Without this both were served from frames their holders had freed,
        which the next pin may fill with another corpus's rows: wrong answers, no error.

        The coordinator is asked at most once per ``every_s`` seconds, on the link's loop, so
        the caller (admission, on SGLang's scheduler thread) never waits for it: a call applies
        the answer of the last one that is done (the arena is changed on the caller's thread)
        and starts the next when due; ``wait``: wait for the one it starts and apply it too.
        Returns corpus id → why, for those forgotten now. A coordinator that does not answer
        changes nothing (logged). Requests already running keep the tables their prefill
        recorded."""
        stale = self._apply_recheck(res)
        if self._rechecking is None and time.monotonic() - self._checked_at >= every_s:
            self._checked_at = time.monotonic()
            self._rechecking = asyncio.run_coroutine_threadsafe(self._recheck(res), self._loop)
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

    def map_holders(self, res: Resident, device: torch.device) -> list[str]:
        """Map the pools of every registered holder on ``device`` into ``res`` (CUDA IPC);
        returns their addresses. Holders elsewhere, on the CPU, with other pages or float32
        rows are skipped (logged); bf16 and fp8 rows are mapped, and holders of both formats,
        or a pool FlashMLA cannot read, raise CorpusBindingError (``Resident.add_pool``)."""
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
                shared, page_size, _, inc = await self.fanout.client(h.address).share_pool(here)
            except grpc.aio.AioRpcError as e:
                log.info("holder %s not mapped: %s", h.address, e.details())
                continue
            if page_size != res.page_size or shared[0].dtype not in ("bfloat16", "uint8"):
                log.warning(
                    "holder %s not mapped: %d-token %s pages (the device path needs %d-token "
                    "bfloat16 or fp8 pages)", h.address, page_size, shared[0].dtype, res.page_size,
                )  # fmt: skip
                continue
            meta = [torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta")
                    for s in shared]  # fmt: skip
            res.pool_format(h.address, meta)  # a bad shape raises before anything is mapped
            res.add_pool(h.address, [cuda_ipc.open_shared(s) for s in shared])
            res.incarnation[h.address] = inc
            mapped.append(h.address)
        log.info("corpusd plugin: %d holder pools on this GPU mapped (%s rows): %s",
                 len(mapped), res.kv_format, mapped)  # fmt: skip
        return mapped

    def load_resident(self, b: Binding, res: Resident, admitted: bool = False) -> ArenaCorpus:
        """Corpus ``b`` in ``res``'s arena (loaded once: its page table and every layer's
        index keys). Raises CorpusBindingError when it cannot be served from this GPU. Called
        at admission (:mod:`.admission`), on the scheduler's stream, possibly beside a forward
        on another: the arena's writes are done when it returns. ``admitted`` (the forward, for
        a request admission loaded): a corpus a recheck has forgotten since is loaded again
        (placed anew: its new frames), or, when that fails (unpinned), served as it was loaded,
        so a recheck never makes the forward raise."""
        if b.corpus_id in res.corpora:
            return res.corpora[b.corpus_id]
        if admitted and b.corpus_id in res.retired:
            try:
                return self.load_resident(b, res)
            except Exception as e:
                log.warning("corpusd plugin: corpus %s, forgotten after its requests were "
                            "admitted, cannot be loaded again (%s: %s); they read it as loaded",
                            b.corpus_id, type(e).__name__, e)  # fmt: skip
                return res.retired[b.corpus_id]
        res.check(b.corpus_id, b.tokens)
        view, keys = self._run(self._resident_inputs(b.corpus_id, res.n_layers, res))
        placed = res.load(view, keys)
        if res.device.type == "cuda":
            torch.cuda.synchronize(res.device)
        return placed

    async def _same_pools(self, view: CorpusView, res: Resident) -> None:
        """Raise CorpusBindingError when a holder the corpus's pages are read from is no longer
        the process whose pools this server mapped: a holder restarted with the same address and
        state restores its pages into a new pool, and a corpus pinned after that lives only
        there, while this server (and its decode graphs) reads the old pool's frames. Corpora
        loaded before the restart go on reading the old mapping (which outlives its process);
        one not yet loaded is refused, pinned before the restart or not, since nothing here
        tells which frames the old pool still holds."""
        here = cuda_ipc.device_uuid(res.device)
        for address in sorted({view.holders[r[0][0]] for r in view.replicas}):
            mapped = res.incarnation.get(address)
            if mapped is None:
                continue  # not mapped here: Resident.check says so
            try:
                _, _, _, now = await self.fanout.client(address).share_pool(here)
            except grpc.aio.AioRpcError as e:
                raise CorpusBindingError(
                    f"corpus {view.corpus_id}: holder {address} does not answer "
                    f"({e.code().name}: {e.details()}); its pages cannot be checked"
                ) from e
            if now != mapped:
                raise CorpusBindingError(
                    f"corpus {view.corpus_id}: holder {address} restarted after this SGLang "
                    "server mapped its pool, and this server's CUDA graphs read only the old "
                    "pool; restart the SGLang server to serve corpora pinned since"
                )

    async def _resident_inputs(
        self, corpus_id: str, n_layers: int, res: Resident
    ) -> tuple[CorpusView, list[torch.Tensor]]:
        c = await self._corpus(corpus_id)
        await self._same_pools(c.view, res)
        keys = []
        for layer in range(n_layers):
            pages = engine_index_pages(self.store, corpus_id, layer) if self.store else None
            keys.append(pages if pages is not None else await c.index_keys(layer))
        return c.view, keys
