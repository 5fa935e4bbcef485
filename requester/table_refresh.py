"""Bound corpora follow their page tables: a worker re-reads each one every ``every_s`` (the
coordinator's lease / 3 by default) and, when its replicas changed, stages a new view that the
worker adopts between decode steps (:meth:`requester.worker.Worker.adopt_views`), never inside
one: a step plans every layer on one view.

Why: the coordinator adds a load replica of a hot holder's pages while sessions decode
(``corpusd/coordinator/replicas.py``); without a re-read only bindings made afterwards route to
the copy. The coordinator releases a removed copy two re-reads after it leaves the table
(``--release-grace-s``), so a worker that re-reads this often reaches a released copy only when
a step or a read outlasts a re-read interval (and then fails over to the source).

Cheap when nothing changed: one PageTable call per bound corpus and a comparison of the holder
addresses and replicas (failover changes only which replica is chosen, so it is not mistaken
for a change). Failover is kept: holders a binding marked failed stay failed in the new view
(their pages served by other replicas when there are any), and a binding whose coordinator is
down keeps the view it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.worker import Worker

log = logging.getLogger("corpusd.requester")


class TableRefresh:
    """Re-reads the page table of every corpus bound to ``worker`` (``run``); counts
    ``corpusd_requester_table_rereads_total{result}``: unchanged, changed, failed."""

    def __init__(self, worker: Worker, coordinator: CoordinatorClient) -> None:
        self.worker, self.coordinator = worker, coordinator

    async def once(self) -> int:
        """One re-read of every bound corpus; returns how many new views were staged."""
        staged = 0
        for cid, b in list(self.worker.corpora.items()):
            if b.force is not None:  # the monolithic baseline: no holders to follow
                continue
            try:
                view = CorpusView.from_page_table(await self.coordinator.page_table(cid))
            except (CoordinatorError, CorpusUnavailable) as e:  # unpinned, or coordinator down
                log.debug("re-reading corpus %s's page table: %s", cid[:12], e)
                self.worker.metrics.rereads.labels("failed").inc()
                continue
            if self.worker.corpora.get(cid) is not b:  # unbound meanwhile
                continue
            pending = self.worker.staged.get(cid)
            current = pending[1] if pending is not None and pending[0] is b else b.view
            if view.same_table(current):
                self.worker.metrics.rereads.labels("unchanged").inc()
                continue
            for address in view.holders:  # route transports set up now, not inside a step
                await self.worker.fanout.route(address)
            self.worker.staged[cid] = (b, view)
            self.worker.metrics.rereads.labels("changed").inc()
            log.info(
                "corpus %s's page table changed (%d holders, %d page replicas); adopted at the "
                "next step",
                cid[:12],
                len(view.holders),
                sum(len(r) for r in view.replicas),
            )
            staged += 1
        return staged

    async def run(self, every_s: Callable[[], float]) -> None:
        """Until cancelled: ``once`` every ``every_s()`` seconds (read each round: the lease the
        coordinator gives may change). A failed round is logged and the next one tries again."""
        while True:
            await asyncio.sleep(every_s())
            try:
                await self.once()
            except Exception:  # the loop must outlive one bad round; sessions keep their view
                log.exception("re-reading page tables failed")
