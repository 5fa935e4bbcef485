"""The coordinator's durable state in SQLite (WAL): holders, corpora, the global page table.

Every change that must survive a restart is one transaction, so a crash leaves the state before
or after it. Corpus states: ``queued`` (waits for room, FIFO by ``queued_seq``), ``pinning``
(being published; ``plan`` lists what may be on holders so a restart can roll it back),
``ready`` (its page table is committed) and ``retired`` (unpinned; no page rows).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path

from corpusd.coordinator.client import HolderSpec

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


@dataclass(frozen=True, slots=True)
class HolderRow(HolderSpec):
    """A registered holder as the state keeps it: its spec, then its load and lease (the table's
    columns, in order)."""

    used_frames: int
    active_flows: int
    last_heartbeat: float  # wall-clock seconds; 0 = marked unreachable
    lease_s: float

    def live(self, now: float) -> bool:
        return now - self.last_heartbeat <= self.lease_s


@dataclass(frozen=True, slots=True)
class CorpusRow:
    corpus_id: str
    name: str
    state: str
    manifest: str  # the store's manifest.json text
    tokens: int
    pages: int
    replicas: int
    cp_degree: int
    plan: dict[str, list[int]] | None  # holder → pages being assigned (state "pinning")
    queued_seq: int | None
    updated_at: float


class State:
    """One SQLite file; all methods run on the caller's thread (the coordinator's event loop)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(SCHEMA)

    def close(self) -> None:
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
    def register(self, h: HolderRow) -> None:
        """Insert or update a holder (same id: new address/geometry, fresh lease)."""
        with self.tx() as c:
            c.execute(
                "INSERT INTO holders VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(holder_id) DO "
                "UPDATE SET address=excluded.address, device=excluded.device, "
                "capacity_frames=excluded.capacity_frames, page_size=excluded.page_size, "
                "model_fingerprint=excluded.model_fingerprint, dtype=excluded.dtype, "
                "used_frames=excluded.used_frames, last_heartbeat=excluded.last_heartbeat, "
                "lease_s=excluded.lease_s",
                astuple(h),
            )

    def heartbeat(self, holder_id: str, used: int, flows: int, now: float) -> bool:
        """Renew a lease; False for an unknown holder (it must register)."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE holders SET used_frames=?, active_flows=?, last_heartbeat=? "
                "WHERE holder_id=?",
                (used, flows, now, holder_id),
            )
        return cur.rowcount == 1

    def mark_unreachable(self, holder_id: str) -> None:
        """Lapse a holder's lease now (an RPC to it failed); its next heartbeat revives it."""
        with self.tx() as c:
            c.execute("UPDATE holders SET last_heartbeat=0 WHERE holder_id=?", (holder_id,))

    def add_used(self, holder_id: str, delta: int) -> None:
        """Track frames taken/freed by the coordinator until the holder's next heartbeat."""
        with self.tx() as c:
            c.execute(
                "UPDATE holders SET used_frames=MAX(0, used_frames + ?) WHERE holder_id=?",
                (delta, holder_id),
            )

    def holders(self) -> list[HolderRow]:
        rows = self.conn.execute("SELECT * FROM holders ORDER BY holder_id").fetchall()
        return [HolderRow(*r) for r in rows]

    def placed_frames(self) -> dict[str, int]:
        """Frames the page table gives each holder."""
        rows = self.conn.execute("SELECT holder_id, COUNT(*) FROM pages GROUP BY holder_id")
        return {h: n for h, n in rows}

    def held_by(self, holder_id: str) -> dict[str, dict[int, int]]:
        """corpus → {page: frame} that the page table gives ``holder_id``."""
        out: dict[str, dict[int, int]] = {}
        for cid, page, frame in self.conn.execute(
            "SELECT corpus_id, page, frame FROM pages WHERE holder_id=?", (holder_id,)
        ):
            out.setdefault(cid, {})[page] = frame
        return out

    def set_frames(self, corpus_id: str, holder_id: str, frames: dict[int, int]) -> None:
        """Record new frames for pages a holder re-loaded (reconciliation after it lost them)."""
        with self.tx() as c:
            c.executemany(
                "UPDATE pages SET frame=? WHERE corpus_id=? AND holder_id=? AND page=?",
                [(f, corpus_id, holder_id, p) for p, f in frames.items()],
            )

    # -- corpora --------------------------------------------------------------------------------
    def corpus(self, corpus_id: str) -> CorpusRow | None:
        r = self.conn.execute("SELECT * FROM corpora WHERE corpus_id=?", (corpus_id,)).fetchone()
        return _corpus(r) if r else None

    def corpora(self) -> list[CorpusRow]:
        rows = self.conn.execute("SELECT * FROM corpora ORDER BY name, corpus_id").fetchall()
        return [_corpus(r) for r in rows]

    def queued(self) -> list[CorpusRow]:
        """Pins waiting for room, oldest first."""
        rows = self.conn.execute(
            "SELECT * FROM corpora WHERE state='queued' ORDER BY queued_seq"
        ).fetchall()
        return [_corpus(r) for r in rows]

    def put_corpus(self, row: CorpusRow) -> CorpusRow:
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
        stored = self.corpus(row.corpus_id)
        assert stored is not None
        return stored

    def commit_pin(
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

    def drop_corpus(self, corpus_id: str) -> None:
        """Forget a corpus entirely (a failed pin: as if it was never asked for)."""
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.execute("DELETE FROM corpora WHERE corpus_id=?", (corpus_id,))

    def retire(self, corpus_id: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM pages WHERE corpus_id=?", (corpus_id,))
            c.execute(
                "UPDATE corpora SET state='retired', plan=NULL, queued_seq=NULL, updated_at=? "
                "WHERE corpus_id=?",
                (time.time(), corpus_id),
            )

    def page_table(self, corpus_id: str) -> dict[int, list[tuple[str, int]]]:
        """page → [(holder, frame)] in replica order."""
        out: dict[int, list[tuple[str, int]]] = {}
        for page, holder, frame in self.conn.execute(
            "SELECT page, holder_id, frame FROM pages WHERE corpus_id=? ORDER BY page, replica",
            (corpus_id,),
        ):
            out.setdefault(page, []).append((holder, frame))
        return out


def _corpus(r: tuple[object, ...]) -> CorpusRow:
    plan = json.loads(str(r[8])) if r[8] is not None else None
    return CorpusRow(*r[:8], plan, *r[9:])  # type: ignore[arg-type, call-arg]
