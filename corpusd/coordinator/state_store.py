"""The coordinator's durable state behind one interface: its rows and the contract every store
keeps (``sqlite_state``, ``etcd_state``; ``db.open_state`` picks one by URL).

Every change that must survive a restart is one transaction in either store, so a crash
leaves the state before or after it. Corpus states: ``queued`` (waits for room, FIFO by
``queued_seq``), ``pinning`` (being published; ``plan`` lists what may be on holders so a
restart or a new leader can roll it back), ``ready`` (its page table is committed) and
``retired`` (unpinned; no page rows).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from corpusd.coordinator.client import HolderSpec


@dataclass(frozen=True, slots=True)
class HolderRow(HolderSpec):
    """A registered holder as the state keeps it: its spec, then its load and lease (SQLite's
    table columns, in order)."""

    used_frames: int
    active_flows: int
    last_heartbeat: float  # wall-clock seconds; 0 = marked unreachable
    lease_s: float
    # etcd: whether the holder's etcd lease key exists (the store's clock decides liveness);
    # None: decided by ``last_heartbeat`` + ``lease_s`` on our clock (SQLite)
    leased: bool | None = field(default=None, compare=False)

    def live(self, now: float) -> bool:
        if self.leased is not None:
            return self.leased
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


#: page → [(holder, frame)] in replica order
Table = dict[int, list[tuple[str, int]]]


class NotLeader(Exception):
    """A write was refused because this coordinator is not (or no longer) the leader; the
    change was not made. ``leader``: the leader's address when known, else ""."""

    def __init__(self, leader: str = "") -> None:
        super().__init__(f"not the leader coordinator (leader: {leader or 'unknown'})")
        self.leader = leader


class StateStore(abc.ABC):
    """The contract both stores keep. All methods are coroutines run on the coordinator's
    event loop; writes are atomic (all of a method's change or none) and raise NotLeader, with
    nothing changed, when a fenced store (etcd) finds another coordinator leading. Reads
    never raise NotLeader: standbys serve them."""

    #: where it lives, for logs (a path, or the etcd endpoints and prefix)
    where: str

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections (and etcd leases this process holds)."""

    # -- holders --------------------------------------------------------------------------------
    @abc.abstractmethod
    async def register(self, h: HolderRow, ttl_s: float) -> None:
        """Insert or update a holder (same id: new address/geometry) with a fresh lease of
        ``ttl_s`` seconds."""

    @abc.abstractmethod
    async def heartbeat(self, holder_id: str, used: int, flows: int, now: float) -> bool:
        """Renew a lease and record the load; False for an unknown holder (it must register)
        or, on etcd, one whose lease lapsed (it registers again, which revives it)."""

    @abc.abstractmethod
    async def mark_unreachable(self, holder_id: str) -> None:
        """Lapse a holder's lease now (an RPC to it failed); its next registration revives it."""

    @abc.abstractmethod
    async def add_used(self, holder_id: str, delta: int) -> None:
        """Track frames taken/freed by the coordinator until the holder's next heartbeat."""

    @abc.abstractmethod
    async def holders(self) -> list[HolderRow]:
        """Every registered holder, by id."""

    async def holder(self, holder_id: str) -> HolderRow | None:
        return next((h for h in await self.holders() if h.holder_id == holder_id), None)

    # -- corpora and the page table -------------------------------------------------------------
    @abc.abstractmethod
    async def corpus(self, corpus_id: str) -> CorpusRow | None: ...

    @abc.abstractmethod
    async def corpora(self) -> list[CorpusRow]:
        """Every corpus row, by (name, id)."""

    async def queued(self) -> list[CorpusRow]:
        """Pins waiting for room, oldest first."""
        rows = [r for r in await self.corpora() if r.state == "queued"]
        return sorted(rows, key=lambda r: r.queued_seq or 0)

    @abc.abstractmethod
    async def put_corpus(self, row: CorpusRow) -> CorpusRow:
        """Insert or replace a corpus row; a ``queued`` row without a sequence number goes to
        the back of the queue. Returns the row as stored."""

    @abc.abstractmethod
    async def commit_pin(
        self, corpus_id: str, table: dict[tuple[int, int], tuple[str, int]], cp_degree: int
    ) -> None:
        """Publish a page table ``(page, replica) → (holder, frame)`` and mark the corpus ready,
        in one transaction."""

    @abc.abstractmethod
    async def set_table(self, corpus_id: str, table: Table) -> None:
        """Replace a ready corpus's page table (replicas added or removed) in one transaction."""

    @abc.abstractmethod
    async def drop_corpus(self, corpus_id: str) -> None:
        """Forget a corpus entirely (a failed pin: as if it was never asked for)."""

    @abc.abstractmethod
    async def retire(self, corpus_id: str) -> None:
        """Drop its page table and mark it retired, in one transaction."""

    @abc.abstractmethod
    async def page_table(self, corpus_id: str) -> Table:
        """page → [(holder, frame)] in replica order; {} when it has none."""

    @abc.abstractmethod
    async def tables(self) -> dict[str, Table]:
        """Every corpus's page table (those that have one)."""

    async def placed_frames(self) -> dict[str, int]:
        """Frames the page table gives each holder."""
        out: dict[str, int] = {}
        for table in (await self.tables()).values():
            for reps in table.values():
                for hid, _ in reps:
                    out[hid] = out.get(hid, 0) + 1
        return out

    async def held_by(self, holder_id: str) -> dict[str, dict[int, int]]:
        """corpus → {page: frame} that the page table gives ``holder_id``."""
        out: dict[str, dict[int, int]] = {}
        for cid, table in (await self.tables()).items():
            for page, reps in table.items():
                for hid, frame in reps:
                    if hid == holder_id:
                        out.setdefault(cid, {})[page] = frame
        return out

    async def set_frames(self, corpus_id: str, holder_id: str, frames: dict[int, int]) -> None:
        """Record new frames for pages a holder re-loaded (reconciliation after it lost them)."""
        table = await self.page_table(corpus_id)
        new = {
            p: [(h, frames[p] if h == holder_id and p in frames else f) for h, f in reps]
            for p, reps in table.items()
        }
        await self.set_table(corpus_id, new)

    async def snapshot(self) -> tuple[list[HolderRow], dict[str, int], dict[str, int]]:
        """(holders, corpora count by state, placed frames by holder): what /metrics shows."""
        states: dict[str, int] = {}
        for r in await self.corpora():
            states[r.state] = states.get(r.state, 0) + 1
        return await self.holders(), states, await self.placed_frames()
