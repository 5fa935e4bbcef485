"""bench_fanin's requester: Attend calls routed by the page table's view the way corpusd's
fan-out routes them (grouped by the holder of each page, one call per holder, the exact LSE
merge), re-reading the table on demand, each call timed per holder."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from corpusd.coordinator.client import CoordinatorClient, PageTable
from requester.balance import HolderSpeed
from requester.corpus_view import CorpusView
from requester.holder_client import HolderClient
from requester.plan import holder_groups, merge_groups


class Requester:
    """Routes Attend calls by the page table's view, re-read every ``refresh_s``."""

    def __init__(
        self, cc: CoordinatorClient, table: PageTable, scale: float, d_v: int, spread: str
    ) -> None:
        self.cc, self.scale, self.d_v = cc, scale, d_v
        # "speed": replicated pages spread by measured holder speed, as the fan-out does
        # (requester/balance.py); "page": page p on replica p mod n
        self.speed = HolderSpeed() if spread == "speed" else None
        self.rebalances: list[tuple[float, dict[str, float]]] = []  # (at, holder → weight)
        self.cid = table.corpus.corpus_id
        self.view = CorpusView.from_page_table(table)
        self.clients: dict[str, HolderClient] = {}
        self.compute_s = 0.0  # the last call's longest holder compute
        self.calls: list[tuple[float, str, float, float]] = []  # (done at, holder, wall, compute)

    def client(self, address: str) -> HolderClient:
        if address not in self.clients:
            self.clients[address] = HolderClient(address)
        return self.clients[address]

    async def refresh(self) -> int:
        """Re-read the page table; returns the most replicas any page has."""
        table = await self.cc.page_table(self.cid)
        view = CorpusView.from_page_table(table)
        if view.holders == self.view.holders:
            view = view.reweighted(self.view.weights)  # the table changes, the speeds do not
        self.view = view
        return max(len(r) for r in table.pages)

    async def attend(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The requester's plan: positions grouped by the holder of their page, compacted (each
        holder gets only its own rows), one Attend per holder, the exact merge."""
        groups = holder_groups(self.view, positions)

        async def call(g: Any) -> Any:
            t = time.perf_counter()
            p = await self.client(g.address).attend_rows(self.cid, 0, q[g.keep], g.rows, self.scale)
            done = time.perf_counter()
            self.calls.append((done, g.address, done - t, p.compute_us / 1e6))
            if self.speed is not None:
                self.speed.observe(g.address, int((g.rows >= 0).sum()), done - t)
            return p

        parts = await asyncio.gather(*(call(g) for g in groups))
        if self.speed is not None and self.view.shared_pages():
            w = self.speed.due(self.view.holders, self.view.weights)
            if w is not None:
                self.view = self.view.reweighted(w)
                named = dict(zip(self.view.holders, (round(x, 3) for x in w), strict=True))
                self.rebalances.append((time.perf_counter(), named))
        self.compute_s = max(p.compute_us for p in parts) / 1e6
        return merge_groups(q, self.d_v, groups, [(p.o, p.lse) for p in parts])[0]

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()
