"""Bound corpora follow their page tables: a requester re-reads each one every ``every_s`` (the
coordinator's lease / 3 by default) and, when its replicas changed, stages a new view that it
adopts at a step boundary (:func:`adopt`), never inside a step: a step plans every layer on one
view. Two requesters do this: corpusd's agent worker (:meth:`requester.worker.Worker.adopt_views`,
between decode steps) and the SGLang plugin's link (:class:`requester.sglang.link.CorpusLink`, at
the first layer of a forward).

Why: the coordinator adds a load replica of a hot holder's pages while sessions decode
(``corpusd/coordinator/replicas.py``); without a re-read only bindings made afterwards route to
the copy. The coordinator releases a removed copy two re-reads after it leaves the table
(``--release-grace-s``), so a requester that re-reads this often reaches a released copy only
when a step or a read outlasts a re-read interval (and then fails over to the source).

Cheap when nothing changed: one PageTable call per bound corpus and a comparison of the holder
addresses and replicas (failover changes only which replica is chosen, so it is not mistaken
for a change). Failover is kept: holders a binding marked failed stay failed in the new view
(their pages served by other replicas when there are any), and a binding whose coordinator is
down keeps the view it has. Until REVIVE_S after its failure: a holder the table then shows with
a live lease (restarted, or only slow past ``--holder-deadline-s`` for a moment) is used again,
and the re-read stages the view that brings it back even when the table itself is unchanged.
Otherwise a binding would avoid it for as long as it lives, and a restarted holder's pages would
be served from one replica, or read from the page store, for days.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from requester.corpus_view import CorpusUnavailable, CorpusView
from requester.fanout import CorpusBinding
from requester.metrics import RequesterMetrics
from requester.routes import Connections

log = logging.getLogger("corpusd.requester")

#: corpus id → (the binding a re-read was for, its new view), waiting for a step boundary
Staged = dict[str, tuple[CorpusBinding, CorpusView]]

#: a holder a binding marked failed is tried again this long after, if its lease is live by then
#: (the coordinator's lease is 10 s by default: a dead or stopped holder's has lapsed by then)
REVIVE_S = 30.0


def still_failed(b: CorpusBinding, view: CorpusView, now: float | None = None) -> set[str]:
    """The addresses of holders ``b`` marked failed that stay failed in ``view`` (a fresh read
    of the table): those that failed under REVIVE_S ago, and those whose lease ``view`` shows
    lapsed (excluded); one with no time of failure on record stays failed."""
    now = time.monotonic() if now is None else now
    failed_at: dict[str, float] = getattr(b, "failed_at", {})
    index = {a: i for i, a in enumerate(view.holders)}
    return {
        address
        for address in {b.view.holders[i] for i in b.dead}
        if now - failed_at.get(address, now) < REVIVE_S or index.get(address) in view.excluded
    }


class Follower(Protocol):
    """A requester whose bound corpora follow their page tables: its bindings by corpus id,
    the views staged for them, its holder connections and its metrics (``rereads``)."""

    @property
    def corpora(self) -> Mapping[str, CorpusBinding]: ...

    @property
    def staged(self) -> Staged: ...

    @property
    def fanout(self) -> Connections: ...

    @property
    def metrics(self) -> RequesterMetrics: ...


def adopt(corpora: Mapping[str, CorpusBinding], staged: Staged, only: str | None = None) -> int:
    """Give bindings the views staged for them (every corpus, or just ``only``), keeping the
    holders each marked failed; a view staged for a binding since unbound is dropped. Removes
    what it adopted from ``staged``; returns how many views were adopted. The caller calls it at
    a step boundary only."""
    n = 0
    for cid in [only] if only is not None else list(staged):
        got = staged.pop(cid, None)
        if got is None:
            continue
        b, view = got
        if corpora.get(cid) is b:
            failed = still_failed(b, view)
            for address in {b.view.holders[i] for i in b.dead} - failed:
                getattr(b, "failed_at", {}).pop(address, None)  # used again: forgotten
            b.view, b.dead = view.without(failed)
            n += 1
    return n


class TableRefresh:
    """Re-reads the page table of every corpus bound to ``follower`` (``run``); counts
    ``corpusd_requester_table_rereads_total{result}``: unchanged, changed, revived (a failed
    holder used again), failed."""

    def __init__(self, follower: Follower, coordinator: CoordinatorClient) -> None:
        self.follower, self.coordinator = follower, coordinator

    async def once(self) -> int:
        """One re-read of every bound corpus; returns how many new views were staged."""
        f, staged = self.follower, 0
        for cid, b in list(f.corpora.items()):
            if b.force is not None:  # the monolithic baseline: no holders to follow
                continue
            try:
                view = CorpusView.from_page_table(await self.coordinator.page_table(cid))
            except (CoordinatorError, CorpusUnavailable) as e:  # unpinned, or coordinator down
                log.debug("re-reading corpus %s's page table: %s", cid[:12], e)
                f.metrics.rereads.labels("failed").inc()
                continue
            if f.corpora.get(cid) is not b:  # unbound meanwhile
                continue
            if b.from_snapshot is not None:  # the coordinator is back: its table rules now
                b.from_snapshot = None
                log.info("corpus %s, bound from the coordinator snapshot, follows the "
                         "coordinator's page table again", cid[:12])  # fmt: skip
            pending = f.staged.get(cid)
            current = pending[1] if pending is not None and pending[0] is b else b.view
            back = {b.view.holders[i] for i in b.dead} - still_failed(b, view)
            if view.same_table(current) and not back:
                f.metrics.rereads.labels("unchanged").inc()
                continue
            for address in view.holders:  # route transports set up now, not inside a step
                await f.fanout.route(address)
            f.staged[cid] = (b, view)
            staged += 1
            if back:
                f.metrics.rereads.labels("revived").inc()
                log.info(
                    "corpus %s: holders %s failed over %g s ago and hold live leases: used "
                    "again from the next step",
                    cid[:12],
                    sorted(back),
                    REVIVE_S,
                )
                continue
            f.metrics.rereads.labels("changed").inc()
            log.info(
                "corpus %s's page table changed (%d holders, %d page replicas); adopted at the "
                "next step",
                cid[:12],
                len(view.holders),
                sum(len(r) for r in view.replicas),
            )
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
