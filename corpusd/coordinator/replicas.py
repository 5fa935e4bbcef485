"""Replicas that follow load: the leader copies a hot holder's hottest pages to a cool holder,
and takes the copy away when the load falls.

Holders report with every heartbeat their fan-in (flows running + queued, time-averaged since the
previous beat: ``Admission.mean_fanin``), their elbow (the largest fan-in whose latency stays
within 1.5x of one flow: the admission cap ``--max-flows``, measured by ``corpusd calibrate``)
and their most attended pages since the last beat. Those
reports are soft state, kept here for ``window_s``; a new leader has them again within a window.

Policy (``decide``, a pure function of the reports and the state): a holder whose every report
over the last ``window_s`` is past its elbow gets one replica — of the hottest pages of its
hottest corpus (at most ``max_pages``) on the live holder that can load the corpus, is under
its own elbow, holds none of those pages and has the most free frames. The replica goes when
its source's every report over a window is at or below ``low`` × elbow, and not before it
has stood a window (hysteresis: a holder between the two thresholds keeps what it has).
``apply`` carries a decision out under the publisher's lock: Assign then one page-table write
(add), or one page-table write (remove) and, ``grace_s`` later, Release: a requester that still
routes by the table it read before the removal (agent workers re-read it every lease/3) finds the
copy there until it has read the new one. A pending release is soft state of the leader's loop: it
stays until its Release has answered (a round cancelled mid-call retries it), and it spares the
pages the page table gives the target again by then (a newer replica re-used them). One lost with
the leader leaves frames the table does not name; the holder gives them back when it registers
again (``upkeep.reconcile``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from corpusd.coordinator.db import HolderRow, StateStore
from corpusd.coordinator.links import HolderCallError
from corpusd.coordinator.publish import Publisher

log = logging.getLogger("corpusd.coordinator")


@dataclass(frozen=True, slots=True)
class LoadReport:
    at: float  # monotonic seconds
    fanin: float  # flows running + queued, time-averaged since the holder's previous report
    elbow: int  # 0: the holder does not report one (never replicated for)
    hot: dict[tuple[str, int], int]  # (corpus, page) → hits since the previous report
    queued: int = 0  # requests waiting for a flow slot at the report's instant


@dataclass(frozen=True, slots=True)
class Replica:
    """A replica the leader added: ``pages`` of ``corpus_id`` copied from ``source`` to
    ``target`` at ``since`` (monotonic)."""

    corpus_id: str
    source: str
    target: str
    pages: tuple[int, ...]
    since: float


@dataclass(frozen=True, slots=True)
class PendingRelease:
    """A removed replica's frames: ``pages`` of ``corpus_id`` on ``target``, released once
    ``due`` (monotonic) has passed."""

    corpus_id: str
    target: str
    pages: frozenset[int]
    due: float


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "add" or "remove"
    replica: Replica


@dataclass
class Replicator:
    window_s: float
    low: float = 0.5
    max_pages: int = 64
    grace_s: float = 0.0  # a removed copy is released this long after the page-table write
    reports: dict[str, deque[LoadReport]] = field(default_factory=dict)
    added: dict[tuple[str, str], Replica] = field(default_factory=dict)  # (corpus, source)
    pending: list[PendingRelease] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.window_s < 0 or self.grace_s < 0:
            raise ValueError(
                f"window_s and grace_s must be >= 0, got {self.window_s=}, {self.grace_s=}"
            )

    def observe(self, holder_id: str, r: LoadReport) -> None:
        """Keep ``r`` and the reports of the last two windows before it."""
        q = self.reports.setdefault(holder_id, deque())
        q.append(r)
        while q and q[0].at < r.at - 2 * self.window_s:
            q.popleft()

    def latest(self, holder_id: str) -> LoadReport | None:
        q = self.reports.get(holder_id)
        return q[-1] if q else None

    def _window(self, holder_id: str, now: float) -> list[LoadReport] | None:
        """The reports of the last window; None when they do not span one yet or the last is
        older than half a window."""
        q = self.reports.get(holder_id)
        if not q or q[0].at > now - self.window_s or q[-1].at < now - self.window_s / 2:
            return None  # not a window's worth yet, or gone quiet: neither hot nor cool
        return [r for r in q if r.at >= now - self.window_s]

    def hot(self, holder_id: str, now: float) -> bool:
        w = self._window(holder_id, now)
        if not w:  # reports do not span a window yet, or none came in the last one
            return False
        return all(r.elbow > 0 and r.fanin > r.elbow for r in w)

    def cool_with(self, source: str, target: str, now: float) -> bool:
        """The load a replica splits has fallen: over a window, the source's fan-in plus the
        target's peak stays at or below ``low`` × the source's elbow. Judging the source alone
        dropped a replica as soon as it had halved the load it was added for (bench_fanin saw
        it removed 11–13 s after it was added, under unchanged load). The target's peak may
        include other corpora's flows: that only keeps the replica longer."""
        w = self._window(source, now)
        if not w:
            return False
        peak = max((r.fanin for r in self._window(target, now) or []), default=0)
        return all(r.fanin + peak <= self.low * r.elbow for r in w)

    def decide(
        self, now: float, holders: list[HolderRow], held: dict[str, dict[str, set[int]]],
        free: dict[str, int], loadable: dict[str, set[str]],
    ) -> list[Decision]:  # fmt: skip
        """What to do now. ``holders``: registered (live ones are used); ``held``: holder →
        corpus → pages the page table gives it; ``free``: holder → free frames; ``loadable``:
        corpus (ready) → holders that can load it."""
        out = []
        for (cid, source), rep in list(self.added.items()):
            gone = cid not in loadable or rep.target not in {h.holder_id for h in holders}
            if gone or (
                now - rep.since >= self.window_s and self.cool_with(source, rep.target, now)
            ):
                out.append(Decision("remove", rep))
        live = [h for h in holders if h.live(time.time())]
        for h in live:
            if not self.hot(h.holder_id, now):
                continue
            heat: dict[str, dict[int, int]] = {}
            for r in self._window(h.holder_id, now) or []:
                for (cid, page), hits in r.hot.items():
                    if cid in loadable and page in held.get(h.holder_id, {}).get(cid, set()):
                        heat.setdefault(cid, {})
                        heat[cid][page] = heat[cid].get(page, 0) + hits
            ranked = sorted(heat, key=lambda c: -sum(heat[c].values()))
            for cid in ranked:
                if (cid, h.holder_id) in self.added:
                    continue
                hottest = sorted(heat[cid], key=lambda p: (-heat[cid][p], p))[: self.max_pages]
                target = self._target(h.holder_id, cid, hottest, live, held, free, loadable, now)
                if target is not None:
                    rep = Replica(cid, h.holder_id, target, tuple(sorted(hottest)), now)
                    out.append(Decision("add", rep))
                    break  # one replica per hot holder per round: its effect is measured next
        return out

    def _target(
        self, source: str, cid: str, pages: list[int], live: list[HolderRow],
        held: dict[str, dict[str, set[int]]], free: dict[str, int],
        loadable: dict[str, set[str]], now: float,
    ) -> str | None:  # fmt: skip
        """The least-loaded live holder with room that can take ``pages`` of ``cid``."""
        ok = []
        for h in live:
            hid = h.holder_id
            last = self.latest(hid)
            if (
                hid == source
                or hid not in loadable[cid]
                or free.get(hid, 0) < len(pages)
                or held.get(hid, {}).get(cid, set()) & set(pages)
                or (last is not None and last.elbow > 0 and last.fanin >= last.elbow)
            ):
                continue
            load = last.fanin / last.elbow if last is not None and last.elbow else 0.0
            ok.append((load, -free.get(hid, 0), hid))
        return min(ok)[2] if ok else None

    async def step(self, pub: Publisher, now: float | None = None) -> list[Decision]:
        """Decide and apply, under the publisher's lock. Returns what was done."""
        now = time.monotonic() if now is None else now
        if not self.added and not self.pending and not any(self.hot(h, now) for h in self.reports):
            return []  # the common case: nothing to do, and no state read to find that out
        async with pub.lock:
            state = pub.state
            holders = await state.holders()
            tables = await state.tables()
            held: dict[str, dict[str, set[int]]] = {}
            for cid, table in tables.items():
                for page, reps in table.items():
                    for hid, _ in reps:
                        held.setdefault(hid, {}).setdefault(cid, set()).add(page)
            loads = {x.holder_id: x for x in await pub.loads(holders)}
            free = {h: x.capacity - x.used for h, x in loads.items()}
            loadable: dict[str, set[str]] = {}
            for row in await state.corpora():
                if row.state == "ready" and row.corpus_id in tables:
                    loadable[row.corpus_id] = {
                        h.holder_id for h in holders if _loads(h, row.manifest)
                    }
            by_id = {h.holder_id: h for h in holders}
            done = []
            for d in self.decide(now, holders, held, free, loadable):
                if await self._apply(pub, state, d, by_id, now):
                    done.append(d)
            await self._release_due(pub, state, by_id, now)
        return done

    async def _release_due(
        self, pub: Publisher, state: StateStore, by_id: dict[str, HolderRow], now: float
    ) -> None:
        """Release the copies whose grace has passed, sparing pages the page table gives their
        target again. Each leaves ``pending`` only once its Release has answered."""
        for rel in [r for r in self.pending if r.due <= now]:
            table = await state.page_table(rel.corpus_id)
            again = {p for p, reps in table.items() if any(h == rel.target for h, _ in reps)}
            pages = sorted(rel.pages - again)
            target = by_id.get(rel.target)
            if pages and target is not None:
                try:
                    await pub.links.release(rel.target, target.address, rel.corpus_id, pages)
                    await state.add_used(rel.target, -len(pages))
                    pub.capacity_changed.set()
                except HolderCallError as e:  # reconciled when it registers again
                    log.warning(
                        "load replica of %s on %s: release failed: %s", rel.corpus_id, rel.target, e
                    )
            self.pending.remove(rel)
            log.info(
                "load replica released: %d pages of corpus %s on %s (%d re-used)",
                len(pages) if target is not None else 0,
                rel.corpus_id,
                rel.target,
                len(rel.pages) - len(pages),
            )

    async def _apply(
        self,
        pub: Publisher,
        state: StateStore,
        d: Decision,
        by_id: dict[str, HolderRow],
        now: float,
    ) -> bool:
        rep, key = d.replica, (d.replica.corpus_id, d.replica.source)
        table = await state.page_table(rep.corpus_id)
        target = by_id.get(rep.target)
        if d.action == "add":
            assert target is not None, f"{rep=}"
            try:
                frames = await pub.links.assign(
                    rep.target, target.address, rep.corpus_id, list(rep.pages)
                )
            except HolderCallError as e:
                log.warning("load replica of %s on %s not added: %s", rep.corpus_id, rep.target, e)
                return False
            for p in rep.pages:
                table[p] = [*table[p], (rep.target, frames[p])]
            await state.set_table(rep.corpus_id, table)
            await state.add_used(rep.target, len(rep.pages))
            self.added[key] = rep
        else:
            for p in rep.pages:
                if p in table and len(table[p]) > 1:
                    table[p] = [x for x in table[p] if x[0] != rep.target] or table[p]
            if table:
                await state.set_table(rep.corpus_id, table)
            del self.added[key]
            # released after the grace (_release_due): readers of the older table still use it
            self.pending.append(
                PendingRelease(rep.corpus_id, rep.target, frozenset(rep.pages), now + self.grace_s)
            )
        pub.metrics.replicas.labels("added" if d.action == "add" else "removed").inc()
        log.info(
            "load replica %s: %d hot pages of corpus %s from %s on %s",
            "added" if d.action == "add" else "removed",
            len(rep.pages),
            rep.corpus_id,
            rep.source,
            rep.target,
        )
        pub.capacity_changed.set()
        return True


def _loads(h: HolderRow, manifest: str) -> bool:
    from corpusd.corpus.manifest import Manifest

    m = Manifest.from_json(manifest)
    return (h.page_size, h.dtype, h.model_fingerprint) == (
        m.page_size,
        m.dtype,
        m.model_fingerprint,
    )
