"""A synchronous handle on corpusd for code that runs inside SGLang's forward pass.

SGLang's model forward is synchronous; corpusd's clients are asyncio. The link runs one event
loop on a daemon thread and blocks the caller on each call (``run_coroutine_threadsafe``), with a
timeout. Per corpus it caches the binding (resolved once against the coordinator), the page
table (which holder holds which page: attention calls go straight to those holders) and, per
layer, the corpus's index keys (streamed once from its holders, then put through SGLang's fp8
format so the corpus's keys score at the precision of the request's own keys).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from indexer.fp8 import fp8_view
from requester.client import Client
from requester.corpus_view import CorpusView
from requester.holder_client import HolderClient
from requester.sglang.binding import Binding, PinnedCorpus, resolve
from requester.sglang.positions import ROPE_START  # = kv_lora_rank: O's width
from requester.worker import holder_groups, merge_groups

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
    def __init__(
        self, coordinator: str, fingerprint: str, page_size: int, timeout: float = 60.0
    ) -> None:
        if not coordinator:
            raise ValueError(
                "corpusd plugin: no coordinator address; set CORPUSD_COORDINATOR=host:port"
            )
        self.coordinator, self.fingerprint, self.page_size = coordinator, fingerprint, page_size
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="corpusd-link"
        )
        self._thread.start()
        self._bindings: dict[str, Binding] = {}
        self._keys: dict[tuple[str, int], torch.Tensor] = {}
        self._client: Client | None = None
        self._views: dict[str, CorpusView] = {}
        self.timings = Timings()
        self._holders: dict[str, HolderClient] = {}

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def close(self) -> None:
        if self._client is not None:
            self._run(self._client.close())
        for h in self._holders.values():
            self._run(h.close())
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
        """float32 ``[T, 128]`` on ``device``: the corpus's index keys for ``layer`` as SGLang's
        indexer scores its own (rotated, fp8 round trip, per-token scales; cached). The same
        values as its pages (:func:`..pagehash.index_k_page`), without the bytes."""
        key = (b.corpus_id, layer)
        if key not in self._keys:
            pages = self._run(self._fetch_keys(b.corpus_id, layer))
            keys = torch.cat([pages[p] for p in sorted(pages)])[: b.tokens]
            self._keys[key] = fp8_view(keys, ue8m0).to(device)
        return self._keys[key]

    async def _fetch_keys(self, corpus_id: str, layer: int) -> dict[int, torch.Tensor]:
        view = await self._view(corpus_id)
        out: dict[int, torch.Tensor] = {}
        for address in view.holders:
            out.update(await self._holder(address).index_keys(corpus_id, layer))
        missing = view.n_pages - len(out)
        assert missing == 0, f"corpus {corpus_id}: index keys of {missing} pages missing"
        return out

    def attend(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged ``(O [n, h, 512] float32, LSE [n, h] natural, -inf empty)`` of ``q [n, h, 576]``
        (corpusd's rope layout, full head count) over canonical ``positions [n, k]`` (-1 unused),
        scores scaled by ``scale`` (SGLang's ``layer.scaling``).

        Straight to the holders (one call per holder holding selected pages, concurrently,
        merged here). If a holder call fails, the page table is dropped and this call goes
        through an agent worker the coordinator picks (``requester.Client.attend``), which
        serves a failed holder's rows from replicas."""
        return self._run(self._attend(b.corpus_id, layer, q, positions, scale))

    async def _attend(
        self, corpus_id: str, layer: int, q: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            view = await self._view(corpus_id)
            groups = holder_groups(view, positions)
            results = await asyncio.gather(
                *(
                    self._holder(view.holders[g.holder]).attend(
                        corpus_id, layer, q[g.keep], g.prow, scale
                    )
                    for g in groups
                )
            )
            return merge_groups(q.float(), ROPE_START, groups, [(p.o, p.lse) for p in results])
        except grpc.aio.AioRpcError as e:
            log.warning(
                "corpusd plugin: a holder call failed (%s: %s); through an agent worker",
                e.code().name,
                e.details(),
            )
            self._views.pop(corpus_id, None)
        if self._client is None:  # made on the link's loop: its channels belong to that loop
            self._client = Client(coordinator=self.coordinator, timeout=self.timeout)
        o, lse = await self._client.attend(corpus_id, layer, q, positions=positions, scale=scale)
        return o.float(), lse

    async def _view(self, corpus_id: str) -> CorpusView:
        if corpus_id not in self._views:
            async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
                self._views[corpus_id] = CorpusView.from_page_table(await c.page_table(corpus_id))
        return self._views[corpus_id]

    def _holder(self, address: str) -> HolderClient:
        if address not in self._holders:  # made on the link's loop, as the client
            self._holders[address] = HolderClient(address)
        return self._holders[address]
