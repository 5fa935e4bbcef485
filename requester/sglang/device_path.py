"""The device path's set-up: holders' pools mapped onto the server's GPU, corpora loaded.

The device path's per-layer executor (:func:`.device.corpus_partial`, captured in SGLang's
graphs) reads only tables on the GPU (:class:`.resident.Resident`). This module fills them,
eagerly and outside any graph: at start it maps the pools of the holders on this GPU (CUDA IPC,
the transport the device plan names ``cuda_ipc``) and of those on other GPUs of the host this one
reaches by peer access (the same mapping over NVLink, ``cuda_p2p``); at a request's admission or
prefill it loads the request's corpus, whose device plan (:mod:`requester.fanout_device`, built
from the page table the catalog's fan-out binding holds) says which holder and frame each page is
read from.
"""

from __future__ import annotations

import logging

import grpc
import torch

from corpusd.transport import cuda_ipc
from requester.corpus_view import CorpusView
from requester.fanout_device import device_transport
from requester.sglang import device_failover
from requester.sglang.binding import Binding, CorpusBindingError
from requester.sglang.catalog import CorpusCatalog
from requester.sglang.device_failover import HolderWatch
from requester.sglang.metrics import PluginMetrics
from requester.sglang.pages import engine_index_pages
from requester.sglang.resident import ArenaCorpus, Resident

log = logging.getLogger("corpusd.sglang")


class DevicePath:
    """Maps holders (:meth:`map_holders`) and loads corpora (:meth:`load_resident`) into a
    :class:`Resident`, reading coordinator, holders and corpora through ``catalog``. Blocking
    calls, for SGLang's scheduler thread; none runs inside a graph capture."""

    def __init__(self, catalog: CorpusCatalog) -> None:
        self.catalog = catalog

    def map_holders(self, res: Resident, device: torch.device, peer: bool = True) -> list[str]:
        """Map the pools of every registered holder on ``device`` into ``res`` (CUDA IPC), and,
        with ``peer``, of every holder on another GPU this one reaches by peer access (the same
        mapping, read over NVLink: ``cuda_p2p``); returns their addresses. Holders on other
        hosts or unreachable GPUs, on the CPU, with other pages or float32 rows are skipped
        (logged); bf16 and fp8 rows are mapped, and holders of both formats, or a pool FlashMLA
        cannot read, raise CorpusBindingError (``Resident.add_pool``)."""
        return self.catalog.run(self._map_holders(res, device, peer))

    async def _map_holders(self, res: Resident, device: torch.device, peer: bool) -> list[str]:
        async with self.catalog.client() as c:
            holders = [h.info for h in await c.list_holders()]
        here = cuda_ipc.device_uuid(device)
        mapped = []
        for h in holders:
            if not h.device.startswith("cuda") or h.address in res.holder_slot:
                continue
            try:
                shared, page_size, _, inc = await self.catalog.fanout.client(h.address).share_pool(
                    here, peer
                )
            except grpc.aio.AioRpcError as e:
                log.info("holder %s not mapped: %s", h.address, e.details())
                continue
            transport = device_transport(here, shared[0].device_uuid, peer)
            if transport is None:
                log.info(
                    "holder %s not mapped: its GPU %s is not one this process sees with peer "
                    "access from %s (another host, CUDA_VISIBLE_DEVICES, or no P2P); the host "
                    "path serves it", h.address, shared[0].device_uuid, here,
                )  # fmt: skip
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
            if transport == "cuda_ipc":
                layers = [cuda_ipc.open_shared(s) for s in shared]
            else:  # the holder's memory, mapped onto this GPU: read over the link
                layers = [cuda_ipc.open_shared(s, res.device.index or 0) for s in shared]
            res.add_pool(h.address, layers, transport)
            if isinstance(m := self.catalog.metrics, PluginMetrics):
                m.holder_transport.labels(h.address, transport).set(1)
            res.incarnation[h.address] = inc
            mapped.append(h.address)
        log.info("corpusd plugin: %d holder pools mapped onto %s (%s rows): %s", len(mapped),
                 res.device, res.kv_format,
                 {a: res.transport[a] for a in mapped})  # fmt: skip
        return mapped

    def watch_holders(self, res: Resident, every_s: float, metrics: PluginMetrics) -> HolderWatch:
        """Health-check ``res``'s mapped holders every ``every_s`` seconds on the catalog's loop
        and fail dead ones over between steps (:mod:`.device_failover`); returns the watch."""
        fanout = self.catalog.fanout

        async def alive(address: str, timeout: float) -> bool:
            return await fanout.client(address).alive(timeout)

        watch = HolderWatch(res, alive, metrics, every_s)
        device_failover.start(watch, self.catalog.loop)
        return watch

    def load_resident(self, b: Binding, res: Resident, admitted: bool = False) -> ArenaCorpus:
        """Corpus ``b`` in ``res``'s arena (loaded once: its device plan and every layer's
        index keys). Raises CorpusBindingError when it cannot be served from this GPU. Called
        at admission (:mod:`.binding_check`), on the scheduler's stream, possibly beside a forward
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
        view, keys = self.catalog.run(self._resident_inputs(b.corpus_id, res.n_layers, res))
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
        for group in res.plan(view).groups:  # raises for a holder not mapped here
            address, mapped = group.address, res.incarnation.get(group.address)
            if mapped is None:
                continue  # mapped without an incarnation (a test's pool)
            try:
                peer = res.transport.get(address) == "cuda_p2p"
                _, _, _, now = await self.catalog.fanout.client(address).share_pool(here, peer)
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
        c = await self.catalog.corpus(corpus_id)
        await self._same_pools(c.view, res)
        store = self.catalog.store
        keys = []
        for layer in range(n_layers):
            pages = engine_index_pages(store, corpus_id, layer) if store else None
            keys.append(pages if pages is not None else await c.index_keys(layer))
        return c.view, keys
