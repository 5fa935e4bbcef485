"""Putting corpora on holders and taking them off, all-or-nothing (the coordinator's core).

One lock orders every change of placement — pin, queue drain, unpin, reconciliation — so a
decision is made on the loads it will change. A pin is recorded ``pinning`` with its plan, the
holders Assign their pages concurrently, and only when every one answered is the page table
committed in one transaction; on any failure every planned page is released and the corpus row
removed, and a coordinator that died mid-pin does the same on start (``recover``). Frames a
holder could not be told to release are found when it next registers (``reconcile``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.db import CorpusRow, HolderRow, StateStore
from corpusd.coordinator.links import HolderCallError, Links
from corpusd.coordinator.metrics import CoordinatorMetrics
from corpusd.coordinator.placement import HolderLoad, NoFit, Placement, place
from corpusd.corpus.manifest import Manifest
from corpusd.rpc import Reject

log = logging.getLogger("corpusd.coordinator")
S = grpc.StatusCode


def _fits(h: HolderRow, m: Manifest) -> bool:
    return (h.page_size, h.dtype, h.model_fingerprint) == (
        m.page_size,
        m.page_format,
        m.model_fingerprint,
    )


class Publisher:
    def __init__(
        self,
        state: StateStore,
        links: Links,
        buckets: CpBuckets,
        metrics: CoordinatorMetrics,
        max_queue: int,
    ) -> None:
        self.state, self.links, self.buckets, self.metrics = state, links, buckets, metrics
        self.max_queue = max_queue
        self.lock = asyncio.Lock()
        self.capacity_changed = asyncio.Event()
        self._waiters: dict[str, list[asyncio.Future[CorpusRow]]] = {}

    # -- choosing holders -------------------------------------------------------------------------
    async def candidates(self, m: Manifest, replicas: int) -> list[HolderRow]:
        """Live holders that can load ``m``. Raises Reject(FAILED_PRECONDITION) when none is
        registered, or fewer are live than ``replicas``."""
        now = time.time()
        fit = [h for h in await self.state.holders() if _fits(h, m)]
        if not fit:
            raise Reject(
                S.FAILED_PRECONDITION,
                f"no registered holder can load corpus {m.corpus_id} (needs page size "
                f"{m.page_size}, dtype {m.page_format}, model {m.model_fingerprint[:12]}…)",
            )
        live = [h for h in fit if h.live(now)]
        if replicas > len(live):
            raise Reject(
                S.FAILED_PRECONDITION,
                f"replicas {replicas} > {len(live)} live holders that can load corpus "
                f"{m.corpus_id} ({len(fit) - len(live)} more registered but expired)",
            )
        return live

    async def loads(self, holders: list[HolderRow]) -> list[HolderLoad]:
        # The heartbeat's count includes frames the coordinator did not place (and lags a pin
        # by up to one beat); the page table's count is exact for ours. The larger is safe.
        placed = await self.state.placed_frames()
        return [
            HolderLoad(
                h.holder_id, h.capacity_frames, max(h.used_frames, placed.get(h.holder_id, 0))
            )
            for h in holders
        ]

    async def _place(self, m: Manifest, replicas: int) -> tuple[Placement, list[HolderRow]]:
        holders = await self.candidates(m, replicas)
        degree = self.buckets.degree(m.token_count)
        return place(await self.loads(holders), m.n_pages, replicas, degree), holders

    # -- pin --------------------------------------------------------------------------------------
    async def pin(self, m: Manifest, manifest_text: str, replicas: int) -> CorpusRow:
        """Place and publish ``m`` now, or queue it (FIFO) when it does not fit yet. Returns its
        row (state ready or queued). Raises Reject: FAILED_PRECONDITION (no fitting holders,
        replicas > live holders, already pinned with other replicas), RESOURCE_EXHAUSTED (larger
        than the live holders' capacity, or the queue is full), or the publish failure."""
        async with self.lock:
            row = await self.state.corpus(m.corpus_id)
            if row is not None and row.state in ("ready", "queued"):
                if row.replicas != replicas:
                    raise Reject(
                        S.FAILED_PRECONDITION,
                        f"corpus {m.corpus_id} is already {row.state} with replicas "
                        f"{row.replicas}; unpin it first to change that",
                    )
                return row
            new = CorpusRow(
                m.corpus_id,
                m.name,
                "queued",
                manifest_text,
                m.token_count,
                m.n_pages,
                replicas,
                0,
                None,
                None,
                time.time(),
            )
            await self.candidates(
                m, replicas
            )  # refuse impossible pins at once, even behind a queue
            if await self.state.queued():  # FIFO: a pin never overtakes those already waiting
                return await self._enqueue(new, "earlier pins are waiting")
            try:
                placement, holders = await self._place(m, replicas)
            except NoFit as e:
                if e.permanent:
                    self.metrics.pins.labels("rejected").inc()
                    raise Reject(S.RESOURCE_EXHAUSTED, str(e)) from None
                return await self._enqueue(new, str(e))
            return await self._publish(new, placement, holders, keep_queued=False)

    async def _enqueue(self, row: CorpusRow, why: str) -> CorpusRow:
        if len(await self.state.queued()) >= self.max_queue:
            self.metrics.pins.labels("rejected").inc()
            raise Reject(
                S.RESOURCE_EXHAUSTED,
                f"corpus {row.corpus_id} does not fit now ({why}) and the queue is full "
                f"({self.max_queue} pins)",
            )
        self.metrics.pins.labels("queued").inc()
        log.info("queued corpus %s (%d pages): %s", row.corpus_id, row.pages, why)
        return await self.state.put_corpus(row)

    async def _publish(
        self, row: CorpusRow, p: Placement, holders: list[HolderRow], keep_queued: bool
    ) -> CorpusRow:
        """Assign every shard, then commit; on failure release them all and drop the row (or
        put it back in the queue at its place when ``keep_queued`` and the cause was a holder
        that did not answer). Raises Reject with the holder's status."""
        t0 = time.perf_counter()
        addr = {h.holder_id: h.address for h in holders}
        plan = {h: list(pages) for h, pages in p.shards.items()}
        await self.state.put_corpus(replace(row, state="pinning", plan=plan, cp_degree=p.cp_degree))
        try:
            got = await asyncio.gather(
                *(self.links.assign(h, addr[h], row.corpus_id, pg) for h, pg in plan.items()),
                return_exceptions=True,
            )
            errors = [e for e in got if isinstance(e, BaseException)]
            errors += [
                HolderCallError(h, S.INTERNAL, f"Assign answered {len(g)} of {len(plan[h])} pages")
                for h, g in zip(plan, got, strict=True)
                if isinstance(g, dict) and not set(plan[h]) <= set(g)
            ]
        except BaseException:  # cancelled (caller gone, shutdown): still leave nothing behind
            await self.release_plan(row.corpus_id, plan, addr)
            if keep_queued:
                await self.state.put_corpus(row)
            else:
                await self.state.drop_corpus(row.corpus_id)
            raise
        if errors:
            await self.release_plan(row.corpus_id, plan, addr)
            unreachable = all(isinstance(e, HolderCallError) and e.unreachable for e in errors)
            if keep_queued and unreachable:
                await self.state.put_corpus(row)
            else:
                await self.state.drop_corpus(row.corpus_id)
            self.metrics.pins.labels("failed").inc()
            raise await self._refusal(row.corpus_id, errors[0])
        frames = {h: g for h, g in zip(plan, got, strict=True) if isinstance(g, dict)}
        table = {
            (page, r): (hid, frames[hid][page])
            for page, hids in enumerate(p.table)
            for r, hid in enumerate(hids)
        }
        await self.state.commit_pin(row.corpus_id, table, p.cp_degree)
        for hid, pages in plan.items():
            await self.state.add_used(hid, len(pages))
        self.metrics.pins.labels("placed").inc()
        self.metrics.publish_seconds.observe(time.perf_counter() - t0)
        log.info(
            "published corpus %s: %d pages × %d on %s (peak load %d frames)",
            row.corpus_id,
            p.pages,
            p.replicas,
            sorted(plan),
            p.peak,
        )
        done = await self.state.corpus(row.corpus_id)
        assert done is not None and done.state == "ready", f"{done=}"
        for fut in self._waiters.pop(row.corpus_id, []):
            if not fut.done():
                fut.set_result(done)
        return done

    async def _refusal(self, corpus_id: str, e: BaseException) -> Reject:
        if not isinstance(e, HolderCallError):
            log.error("publishing %s failed", corpus_id, exc_info=e)
            return Reject(S.INTERNAL, f"publishing {corpus_id} failed: {type(e).__name__}: {e}")
        if e.unreachable:
            await self.state.mark_unreachable(e.holder_id)
            code = S.UNAVAILABLE
        elif e.code == S.NOT_FOUND:  # the coordinator's store has it; the holder's does not
            code = S.FAILED_PRECONDITION
        else:
            code = e.code
        return Reject(code, f"corpus {corpus_id} was not published (nothing kept): {e}")

    async def release_plan(
        self, corpus_id: str, plan: dict[str, list[int]], addr: dict[str, str]
    ) -> int:
        """Release planned pages everywhere, best effort; an unreachable holder is marked so and
        reconciled when it registers again. Returns frames freed."""

        async def one(hid: str) -> int:
            try:
                return await self.links.release(hid, addr[hid], corpus_id, plan[hid])
            except HolderCallError as e:
                log.warning("could not release %s on %s (reconciled later): %s", corpus_id, hid, e)
                if e.unreachable:
                    await self.state.mark_unreachable(hid)
                return 0

        return sum(await asyncio.gather(*(one(h) for h in plan if h in addr)))

    async def wait_placed(self, corpus_id: str, timeout: float | None) -> CorpusRow:
        """Until a queued corpus is ready. Raises Reject: its publish failed, it was unpinned,
        or DEADLINE_EXCEEDED."""
        fut: asyncio.Future[CorpusRow] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(corpus_id, []).append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise Reject(S.DEADLINE_EXCEEDED, f"corpus {corpus_id} is still queued") from None
        finally:
            if not fut.done() and fut in self._waiters.get(corpus_id, []):
                self._waiters[corpus_id].remove(fut)

    def fail_waiters(self, corpus_id: str, e: Reject) -> None:
        for fut in self._waiters.pop(corpus_id, []):
            if not fut.done():
                fut.set_exception(e)

    # -- queue ------------------------------------------------------------------------------------
    async def drain(self) -> int:
        """Publish queued pins in FIFO order while the head fits; returns how many were placed."""
        placed = 0
        async with self.lock:
            for row in await self.state.queued():
                m = Manifest.from_json(row.manifest)
                try:
                    placement, holders = await self._place(m, row.replicas)
                except (Reject, NoFit):
                    break
                try:
                    await self._publish(row, placement, holders, keep_queued=True)
                    placed += 1
                except Reject as e:
                    if await self.state.corpus(row.corpus_id) is not None:
                        break  # still queued: a holder did not answer; retried later
                    self.fail_waiters(row.corpus_id, e)
        return placed
