"""A synchronous handle on corpusd for code that runs inside SGLang's forward pass.

SGLang's model forward is synchronous; corpusd's clients are asyncio. The link runs one event
loop on a daemon thread and blocks the caller on each call (``run_coroutine_threadsafe``), with a
timeout. Per corpus it caches the binding (resolved once against the coordinator) and, per layer,
the corpus's index keys (streamed once from its holders, then put through SGLang's fp8 format
so the corpus's keys score at the precision of the request's own keys).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from corpusd.coordinator.client import CoordinatorClient
from indexer.fp8 import fp8_view
from requester.client import Client
from requester.holder_client import HolderClient
from requester.sglang.binding import Binding, PinnedCorpus, resolve

T = TypeVar("T")


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

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def close(self) -> None:
        if self._client is not None:
            self._run(self._client.close())
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
        async with CoordinatorClient(self.coordinator, timeout=self.timeout) as c:
            table = await c.page_table(corpus_id)
        out: dict[int, torch.Tensor] = {}
        for holder_id in {h for page in table.pages for h, _ in page}:
            hc = HolderClient(table.address(holder_id))
            try:
                out.update(await hc.index_keys(corpus_id, layer))
            finally:
                await hc.close()
        missing = len(table.pages) - len(out)
        assert missing == 0, f"corpus {corpus_id}: index keys of {missing} pages missing"
        return out

    def attend(
        self, b: Binding, layer: int, q: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged ``(O [n, h, 512], LSE [n, h] natural, -inf empty)`` of ``q [n, h, 576]``
        (corpusd's rope layout, full head count) over canonical ``positions [n, k]`` (-1 unused),
        through an agent worker the coordinator picks (``requester.Client.attend``)."""
        return self._run(self._attend(b.corpus_id, layer, q, positions))

    async def _attend(
        self, corpus_id: str, layer: int, q: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._client is None:  # made on the link's loop: its channels belong to that loop
            self._client = Client(coordinator=self.coordinator, timeout=self.timeout)
        return await self._client.attend(corpus_id, layer, q, positions=positions)
