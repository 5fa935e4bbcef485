"""A corpus's way out: ``unpin`` (off every holder and out of the page table, in one step under
the publisher's lock), ``delete`` (out of the coordinator's page store, refused while pinned),
and which corpus the text a user typed means for them (``names.resolve_in``: the one rule, over
corpora in every state). The corpora of the store the coordinator was never asked to pin are
listed as rows of state ``stored``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from corpusd.coordinator.db import CorpusRow
from corpusd.coordinator.publish import Publisher
from corpusd.corpus.manifest import Manifest
from corpusd.corpus.names import CorpusNameError, resolve_in
from corpusd.corpus.store import MANIFEST, PageStore
from corpusd.rpc import Reject

log = logging.getLogger("corpusd.coordinator")
S = grpc.StatusCode
#: states in which a corpus holds (or is about to hold) frames on holders
PINNED = ("ready", "queued", "pinning")


@dataclass(frozen=True, slots=True)
class Removed:
    """What an unpin or a delete did."""

    row: CorpusRow  # the corpus as it was before
    holders: tuple[str, ...]  # the holders that held pages of it (asked to release them)
    frames: int  # frames the page table gave it
    deleted: bool = False  # its files left the page store
    bytes_deleted: int = 0


async def stored_rows(pub: Publisher, store: PageStore) -> list[CorpusRow]:
    """The store's corpora the coordinator has no row for, as rows of state ``stored``
    (``updated_at``: when the manifest was written). Unreadable manifests are left out."""
    known = {r.corpus_id for r in await pub.state.corpora()}
    out = []
    for cid in store.ids():
        if cid in known:
            continue
        path = store.corpora / cid / MANIFEST
        try:
            text = path.read_text()
            m = Manifest.from_json(text)
            when = path.stat().st_mtime
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        out.append(
            CorpusRow(cid, m.name, "stored", text, m.token_count, m.n_pages, 0, 0, None, None, when)
        )
    return out


async def find(pub: Publisher, store: PageStore, text: str, pinned_first: bool) -> CorpusRow:
    """The corpus ``text`` (an id, a name or an id prefix of ≥ 8 characters) means: among the
    pinned corpora first, then the retired (``pinned_first``: unpin), or among the retired and
    the stored first, then the pinned (delete). Raises Reject: INVALID_ARGUMENT (empty, or
    ambiguous), NOT_FOUND naming the corpora it knows."""
    if not text:
        raise Reject(S.INVALID_ARGUMENT, "no corpus given: name an id, a name or an id prefix")
    rows = await pub.state.corpora()
    pinned = [r for r in rows if r.state in PINNED]
    gone = [r for r in rows if r.state not in PINNED]
    if not pinned_first:
        gone += await stored_rows(pub, store)
    try:
        row = resolve_in(text, *((pinned, gone) if pinned_first else (gone, pinned)))
    except CorpusNameError as e:
        raise Reject(S.INVALID_ARGUMENT, str(e)) from None
    if row is None:
        known = ", ".join(sorted({r.name for r in pinned + gone})) or "none"
        raise Reject(
            S.NOT_FOUND,
            f"corpus {text[:80]!r} is not known to this coordinator (it knows: {known})",
        )
    return row


async def unpin(pub: Publisher, store: PageStore, text: str, delete: bool) -> Removed:
    """Release the corpus ``text`` means on every holder and retire it (a queued pin is
    withdrawn), then with ``delete`` remove it from the store and forget it; all under the
    publisher's lock, so no pin or placement sees it half gone. A retired corpus is left as it
    is (0 frames), or with ``delete`` deleted. Raises Reject as ``find``."""
    async with pub.lock:
        row = await find(pub, store, text, pinned_first=True)
        holders, frames = await _retire(pub, row)
        deleted, size = False, 0
        if delete:
            deleted, size = await _delete_files(store, row.corpus_id)
            await pub.state.drop_corpus(row.corpus_id)
    if row.state != "retired":
        pub.capacity_changed.set()
        log.info("unpinned corpus %s (%d frames on %s)", row.corpus_id, frames, list(holders))
    if delete:
        log.info("deleted corpus %s from the store (%d bytes)", row.corpus_id, size)
    return Removed(row, holders, frames, deleted, size)


async def delete(pub: Publisher, store: PageStore, text: str) -> Removed:
    """Remove the corpus ``text`` means from the store and forget it. Raises Reject:
    FAILED_PRECONDITION while it is pinned (ready, queued or pinning), and as ``find``."""
    async with pub.lock:
        row = await find(pub, store, text, pinned_first=False)
        if row.state in PINNED:
            held = sorted(
                {
                    h
                    for reps in (await pub.state.page_table(row.corpus_id)).values()
                    for h, _ in reps
                }
            )
            on = f" on {', '.join(held)}" if held else ""
            raise Reject(
                S.FAILED_PRECONDITION,
                f"corpus {row.name} ({row.corpus_id}) is {row.state}{on}: unpin it first",
            )
        deleted, size = await _delete_files(store, row.corpus_id)
        await pub.state.drop_corpus(row.corpus_id)
    log.info("deleted corpus %s from the store (%d bytes)", row.corpus_id, size)
    return Removed(row, (), 0, deleted, size)


async def _retire(pub: Publisher, row: CorpusRow) -> tuple[tuple[str, ...], int]:
    """Release ``row``'s frames on its holders (best effort: an unreachable holder is reconciled
    when it registers again) and mark it retired; returns (holders, frames). The caller holds
    the publisher's lock."""
    assert pub.lock.locked(), "retire runs under the publisher's lock"
    if row.state not in PINNED:
        return (), 0
    plan: dict[str, list[int]] = {}
    for page, replicas in (await pub.state.page_table(row.corpus_id)).items():
        for hid, _ in replicas:
            plan.setdefault(hid, []).append(page)
    addr = {h.holder_id: h.address for h in await pub.state.holders()}
    await pub.release_plan(row.corpus_id, plan, addr)
    await pub.state.retire(row.corpus_id)
    for hid, pages in plan.items():
        await pub.state.add_used(hid, -len(pages))
    pub.fail_waiters(row.corpus_id, Reject(S.CANCELLED, f"corpus {row.corpus_id} was unpinned"))
    return tuple(sorted(plan)), sum(map(len, plan.values()))


async def _delete_files(store: PageStore, corpus_id: str) -> tuple[bool, int]:
    """(whether it was there, bytes freed); the removal runs off the event loop."""
    if corpus_id not in store.ids():
        return False, 0
    loop = asyncio.get_running_loop()
    return True, await loop.run_in_executor(None, store.delete, corpus_id)
