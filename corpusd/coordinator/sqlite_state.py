"""The embedded state store: one SQLite file (WAL) in the coordinator's state directory.

Each write is one SQLite transaction; the calls are local and short, so they run on the event
loop. Holder liveness is our own lease clock (``last_heartbeat`` + ``lease_s``).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path

from corpusd.coordinator.state_store import CorpusRow, HolderRow, StateStore, Table

SCHEMA = """
CREATE TABLE IF NOT EXISTS holders (
    holder_id TEXT PRIMARY KEY, address TEXT NOT NULL, device TEXT NOT NULL,
    capacity_frames INTEGER NOT NULL, page_size INTEGER NOT NULL, model_fingerprint TEXT NOT NULL,
    dtype TEXT NOT NULL, used_frames INTEGER NOT NULL DEFAULT 0,
    active_flows INTEGER NOT NULL DEFAULT 0, last_heartbeat REAL NOT NULL, lease_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS corpora (
    corpus_id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL, manifest TEXT NOT NULL,
    tokens INTEGER NOT NULL, pages INTEGER NOT NULL, replicas INTEGER NOT NULL,
    cp_degree INTEGER NOT NULL DEFAULT 0, plan TEXT, queued_seq INTEGER, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pages (
    corpus_id TEXT NOT NULL, page INTEGER NOT NULL, replica INTEGER NOT NULL,
    holder_id TEXT NOT NULL, frame INTEGER NOT NULL, PRIMARY KEY (corpus_id, page, replica)
);
CREATE INDEX IF NOT EXISTS pages_by_holder ON pages (holder_id, corpus_id);
"""


class SqliteState(StateStore):
    """One SQLite file; all methods run on the caller's thread (the coordinator's event loop)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(SCHEMA)

    async def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: commits on a clean exit, rolls back on any exception."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- holders --------------------------------------------------------------------------------
    async def register(self, h: HolderRow, ttl_s: float) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO holders VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(holder_id) DO "
                "UPDATE SET address=excluded.address, device=excluded.device, "
                "capacity_frames=excluded.capacity_frames, page_size=excluded.page_size, "
                "model_fingerprint=excluded.model_fingerprint, dtype=excluded.dtype, "
                "used_frames=excluded.used_frames, last_heartbeat=excluded.last_heartbeat, "
                "lease_s=excluded.lease_s",
                astuple(h)[:11],
            )

    async def heartbeat(self, holder_id: str, used: int, flows: int, now: float) -> bool:
        """Renew a lease; False for an unknown holder (it must register)."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE holders SET used_frames=?, active_flows=?, last_heartbeat=? "
                "WHERE holder_id=?",
                (used, flows, now, holder_id),
            )
        return cur.rowcount == 1

    async def mark_unreachable(self, holder_id: str) -> None:
        """Lapse a holder's lease now (an RPC to it failed); its next heartbeat revives it."""
        with self.tx() as c:
            c.execute("UPDATE holders SET last_heartbeat=0 WHERE holder_id=?", (holder_id,))

    async def add_used(self, holder_id: str, delta: int) -> None:
        """Track frames taken/freed by the coordinator until the holder's next heartbeat."""
        with self.tx() as c:
            c.execute(
                "UPDATE holders SET used_frames=MAX(0, used_frames + ?) WHERE holder_id=?",
                (delta, holder_id),
            )

    async def holders(self) -> list[HolderRow]:
        rows = self.conn.execute("SELECT * FROM holders ORDER BY holder_id").fetchall()
        return [HolderRow(*r) for r in rows]  # leased=None: our lease clock

    async def holder(self, holder_id: str) -> HolderRow | None:
        r = self.conn.execute("SELECT * FROM holders WHERE holder_id=?", (holder_id,)).fetchone()
        return HolderRow(*r) if r else None

    async def placed_frames(self) -> dict[str, int]:
        """Frames the page table gives each holder."""
        rows = self.conn.execute("SELECT holder_id, COUNT(*) FROM pages GROUP BY holder_id")
        return {h: n for h, n in rows}

    async def held_by(self, holder_id: str) -> dict[str, dict[int, int]]:
        """corpus → {page: frame} that the page table gives ``holder_id``."""
        out: dict[str, dict[int, int]] = {}
        for cid, page, frame in self.conn.execute(
            "SELECT corpus_id, page, frame FROM pages WHERE holder_id=?", (holder_id,)
        ):
            out.setdefault(cid, {})[page] = frame
        return out

    async def set_frames(self, corpus_id: str, holder_id: str, frames: dict[int, int]) -> None:
        """Record new frames for pages a holder re-loaded (reconciliation after it lost them)."""
        with self.tx() as c:
            c.executemany(
                "UPDATE pages SET frame=? WHERE corpus_id=? AND holder_id=? AND page=?",
                [(f, corpus_id, holder_id, p) for p, f in frames.items()],
            )

    # -- corpora --------------------------------------------------------------------------------
    async def corpus(self, corpus_id: str) -> CorpusRow | None:
        r = self.conn.execute("SELECT * FROM corpora WHERE corpus_id=?", (corpus_id,)).fetchone()
        return _corpus(r) if r else None

    async def corpora(self) -> list[CorpusRow]:
        rows = self.conn.execute("SELECT * FROM corpora ORDER BY name, corpus_id").fetchall()
        return [_corpus(r) for r in rows]

    async def queued(self) -> list[CorpusRow]:
        """Pins waiting for room, oldest first."""
        rows = self.conn.execute(
            "SELECT * FROM corpora WHERE state='queued' ORDER BY queued_seq"
        ).fetchall()
        return [_corpus(r) for r in rows]

    async def put_corpus(self, row: CorpusRow) -> CorpusRow:
        """Insert or replace a corpus row; a ``queued`` row without a sequence number goes to
        the back of the queue. Returns the row as stored."""
        with self.tx() as c:
            seq = row.queued_seq
            if row.state == "queued" and seq is None:
                top = c.execute("SELECT MAX(queued_seq) FROM corpora").fetchone()[0]
                seq = (top or 0) + 1
            c.execute(
                "INSERT OR REPLACE INTO corpora VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row.corpus_id,
                    row.name,
                    row.state,
                    row.manifest,
                    row.tokens,
                    row.pages,
                    row.replicas,
                    row.cp_degree,
                    None if row.plan is None else json.dumps(row.plan),
                    seq,
                    time.time(),
                ),
            )
        stored = await self.corpus(row.corpus_id)
        assert stored is not None
        return stored

    async def commit_pin(
        self, corpus_id: str, table: dict[tuple[int, int], tuple[str, int]], cp_degree: int
    ) -> None:
        """Publish a page table ``(page, replica) → (holder, frame)`` and mark the corpus ready,
        in one transaction."""
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.executemany(
                "INSERT INTO pages VALUES (?,?,?,?,?)",
                [(corpus_id, p, r, h, f) for (p, r), (h, f) in sorted(table.items())],
            )
            c.execute(
                "UPDATE corpora SET state='ready', cp_degree=?, plan=NULL, queued_seq=NULL, "
                "updated_at=? WHERE corpus_id=?",
                (cp_degree, time.time(), corpus_id),
            )

    async def drop_corpus(self, corpus_id: str) -> None:
        """Forget a corpus entirely (a failed pin: as if it was never asked for)."""
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.execute("DELETE FROM corpora WHERE corpus_id=?", (corpus_id,))

    async def retire(self, corpus_id: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.execute(
                "UPDATE corpora SET state='retired', plan=NULL, queued_seq=NULL, updated_at=? "
                "WHERE corpus_id=?",
                (time.time(), corpus_id),
            )

    async def set_table(self, corpus_id: str, table: Table) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.executemany(
                "INSERT INTO pages VALUES (?,?,?,?,?)",
                [
                    (corpus_id, p, r, h, f)
                    for p, reps in sorted(table.items())
                    for r, (h, f) in enumerate(reps)
                ],
            )

    async def tables(self) -> dict[str, Table]:
        out: dict[str, Table] = {}
        for cid, page, holder, frame in self.conn.execute(
            "SELECT corpus_id, page, holder_id, frame FROM pages ORDER BY corpus_id, page, replica"
        ):
            out.setdefault(cid, {}).setdefault(page, []).append((holder, frame))
        return out

    async def page_table(self, corpus_id: str) -> Table:
        out: Table = {}
        for page, holder, frame in self.conn.execute(
            "SELECT page, holder_id, frame FROM pages WHERE corpus_id=? ORDER BY page, replica",
            (corpus_id,),
        ):
            out.setdefault(page, []).append((holder, frame))
        return out


def _corpus(r: tuple[object, ...]) -> CorpusRow:
    plan = json.loads(str(r[8])) if r[8] is not None else None
    return CorpusRow(*r[:8], plan, *r[9:])  # type: ignore[arg-type, call-arg]
