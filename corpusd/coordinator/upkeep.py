"""Taking frames back: reconciling a (re)registered holder, recovery after a crash (unpin is
in lifecycle.py).

Both run under the publisher's lock, so they never race a pin's placement decision.
"""

from __future__ import annotations

import asyncio
import logging

from corpusd.coordinator.links import HolderCallError
from corpusd.coordinator.publish import Publisher

log = logging.getLogger("corpusd.coordinator")


async def reconcile(pub: Publisher, holder_id: str) -> tuple[int, int]:
    """Make a holder hold what the page table says: release frames of pages it should not have
    (a pin that failed while it was unreachable) and reload pages it lost (a wiped state dir),
    recording their new frames. Returns (released, reloaded) page counts; best effort."""
    async with pub.lock:
        h = next((x for x in await pub.state.holders() if x.holder_id == holder_id), None)
        if h is None:
            return 0, 0
        try:
            held = await pub.links.held(h.holder_id, h.address)
        except HolderCallError as e:
            log.warning("cannot reconcile %s: %s", holder_id, e)
            return 0, 0
        want = await pub.state.held_by(holder_id)
        released = reloaded = 0
        try:
            for cid, pages in sorted(held.items()):
                extra = sorted(set(pages) - set(want.get(cid, {})))
                if extra:
                    released += await pub.links.release(h.holder_id, h.address, cid, extra)
            for cid, pages in sorted(want.items()):
                have = held.get(cid, {})
                moved = {p: have[p] for p in pages if p in have and have[p] != pages[p]}
                lost = sorted(p for p in pages if p not in have)
                if lost:
                    moved.update(await pub.links.assign(h.holder_id, h.address, cid, lost))
                    reloaded += len(lost)
                if moved:
                    await pub.state.set_frames(cid, holder_id, moved)
        except HolderCallError as e:
            log.warning("reconciling %s stopped: %s", holder_id, e)
    if released or reloaded:
        log.info(
            "reconciled %s: released %d orphan pages, reloaded %d", holder_id, released, reloaded
        )
        pub.metrics.reconciled.labels("released").inc(released)
        pub.metrics.reconciled.labels("reloaded").inc(reloaded)
        pub.capacity_changed.set()
    return released, reloaded


async def recover(pub: Publisher) -> int:
    """On start: roll back pins a previous run left ``pinning`` (release their plans, drop the
    rows). Returns how many were rolled back."""
    async with pub.lock:
        stale = [r for r in await pub.state.corpora() if r.state == "pinning"]
        addr = {h.holder_id: h.address for h in await pub.state.holders()}
        await asyncio.gather(*(pub.release_plan(r.corpus_id, r.plan or {}, addr) for r in stale))
        for r in stale:
            await pub.state.drop_corpus(r.corpus_id)
            log.warning("rolled back corpus %s, left half-published by a previous run", r.corpus_id)
    return len(stale)
