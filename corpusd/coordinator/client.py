"""An asyncio client of the coordinator: page tables and corpus/holder status as dataclasses.

Used by requesters (``page_table``), holders (``register``/``heartbeat``) and the CLI. Wire
types stop here; a refused call raises CoordinatorError with the server's status and message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import grpc

from corpusd import security
from corpusd.rpc import StatusError
from corpusd.v1 import coordinator_pb2 as pb
from corpusd.v1 import coordinator_pb2_grpc

T = TypeVar("T")


class CoordinatorError(StatusError):
    """The coordinator refused or could not be reached; ``code`` is the gRPC status."""


async def _named(address: str, detail: str, ident: security.Identity | None) -> str:
    """``detail`` of a failed connection, or the TLS mistake it hides (one line)."""
    from corpusd.tls_diagnosis import explain

    me = ident if ident is not None else security.client_identity(address)
    return await asyncio.to_thread(explain, address, detail, me)


@dataclass(frozen=True, slots=True)
class HolderSpec:
    """What a holder says of itself when it registers: where it listens and what it can load."""

    holder_id: str
    address: str
    device: str
    capacity_frames: int
    page_size: int
    model_fingerprint: str
    dtype: str

    def spec(self) -> dict[str, Any]:
        """The spec's fields by name (to build the wire message or a row from)."""
        return {f: getattr(self, f) for f in HOLDER_SPEC}


@dataclass(frozen=True, slots=True)
class HolderInfo(HolderSpec):
    live: bool = True  # lease current (answers only)


HOLDER_SPEC = tuple(f.name for f in fields(HolderSpec))


@dataclass(frozen=True, slots=True)
class HolderState:
    info: HolderInfo
    used_frames: int
    active_flows: int  # fan-in at its last heartbeat
    heartbeat_age_s: float
    placed_frames: int


@dataclass(frozen=True, slots=True)
class CorpusStatus:
    corpus_id: str
    name: str
    state: str  # queued, pinning, ready, retired; stored (in the store, never pinned)
    tokens: int
    pages: int
    page_size: int
    cp_degree: int  # holders it spans
    replicas: int
    model_fingerprint: str
    holder_ids: tuple[str, ...]
    expired_holders: tuple[str, ...]
    queue_position: int  # 1-based while queued, else 0
    created_at: str = ""  # when its pages were made (ISO 8601)
    # seconds in its state (ready: since published); not compared: two reads of one state agree
    state_age_s: float = field(default=0.0, compare=False)
    head_len: int = 0  # its first token ids' SHA-256 (corpusd/corpus/head.py); 0: not known
    head_digest: str = ""


@dataclass(frozen=True, slots=True)
class Removal:
    """What ``unpin_corpus`` / ``delete_corpus`` did: the corpus as it was before (its holders:
    those that released it), the frames freed, whether its files left the page store."""

    corpus: CorpusStatus
    frames_freed: int
    deleted: bool
    bytes_deleted: int


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """An agent worker's load, as it reports it."""

    worker_id: str
    address: str
    sessions: int
    generating: int
    max_batch: int
    kv_tokens: int
    kv_capacity: int
    corpora: tuple[str, ...] = ()
    metrics_url: str = ""


@dataclass(frozen=True, slots=True)
class WorkerState:
    report: WorkerReport
    age_s: float
    live: bool


@dataclass(frozen=True, slots=True)
class PageTable:
    """``pages[p]``: page ``p``'s replicas as ``(holder_id, frame)``, replica 0 first; pool row
    of token ``t`` on a holder = ``frame(t // page_size) * page_size + t % page_size``."""

    corpus: CorpusStatus
    holders: dict[str, HolderInfo]
    pages: tuple[tuple[tuple[str, int], ...], ...]

    def address(self, holder_id: str) -> str:
        return self.holders[holder_id].address

    def frames_on(self, holder_id: str) -> dict[int, int]:
        """page → frame for the pages ``holder_id`` holds."""
        return {p: f for p, reps in enumerate(self.pages) for h, f in reps if h == holder_id}


def _holder(h: pb.HolderAddress) -> HolderInfo:
    return HolderInfo(**{f: getattr(h, f) for f in HOLDER_SPEC}, live=h.live)


def _corpus(c: pb.CorpusInfo) -> CorpusStatus:
    return CorpusStatus(
        c.corpus_id,
        c.name,
        c.state,
        c.tokens,
        c.pages,
        c.page_size,
        c.cp_degree,
        c.replicas,
        c.model_fingerprint,
        tuple(c.holder_ids),
        tuple(c.expired_holders),
        c.queue_position,
        c.created_at,
        c.state_age_s,
        c.head_len,
        c.head_digest,
    )


def _table(t: pb.PageTable) -> PageTable:
    pages: list[tuple[tuple[str, int], ...]] = [()] * len(t.pages)
    for e in t.pages:
        assert e.page < len(pages), f"page {e.page} of a table of {len(pages)} entries"
        pages[e.page] = tuple((r.holder_id, r.frame) for r in e.replicas)
    return PageTable(_corpus(t.corpus), {h.holder_id: _holder(h) for h in t.holders}, tuple(pages))


#: UNAVAILABLE answers that are the coordinator's own verdict on the request (a holder did not
#: answer, no worker is up): another coordinator would answer the same, so no failover
_VERDICTS = ("corpus ", "no live agent worker")


class CoordinatorClient:
    """``address``: one coordinator (``host:port``) or several (``h1:p1,h2:p2``: coordinators
    sharing an etcd state, one leading). With several, a call answered UNAVAILABLE — the
    process is gone or draining, or it is a standby asked to write — moves to the next
    address, round and round with a short backoff, until ``timeout`` has passed; the address
    that last answered is tried first next time. ``ident``: TLS and token to use (default:
    this process's, see corpusd.security)."""

    def __init__(
        self, address: str, timeout: float | None = 30.0, ident: security.Identity | None = None
    ) -> None:
        self.address, self.timeout = address, timeout
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.ident = ident
        self.channels = [security.channel(a, ident=ident) for a in self.addresses]
        self.stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self.channels]
        self.at = 0  # index of the address that answered last

    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return self.stubs[self.at]

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self, call: Callable[[coordinator_pb2_grpc.CoordinatorStub], Awaitable[T]]
    ) -> T:
        """``call(stub)`` on the current coordinator, failing over as the class says. Raises
        CoordinatorError with the last status."""
        deadline = time.monotonic() + (self.timeout or 30.0)
        tried = 0
        while True:
            try:
                return await call(self.stub)
            except grpc.aio.AioRpcError as e:
                code, detail = e.code(), e.details() or ""
                if (
                    len(self.stubs) == 1
                    or code != grpc.StatusCode.UNAVAILABLE
                    or detail.startswith(_VERDICTS)
                    or time.monotonic() > deadline
                ):
                    if code == grpc.StatusCode.UNAVAILABLE:
                        detail = await _named(self.addresses[self.at], detail, self.ident)
                    raise CoordinatorError(code, detail) from None
            self.at = (self.at + 1) % len(self.stubs)
            tried += 1
            if tried % len(self.stubs) == 0:  # a full round: wait for an election
                await asyncio.sleep(0.1)

    async def register(self, h: HolderInfo) -> float:
        """Register (or re-register) a holder; returns its lease in seconds."""
        req = pb.RegisterHolderRequest(holder=pb.HolderAddress(**h.spec()))
        r: Any = await self._call(lambda stub: stub.RegisterHolder(req, timeout=self.timeout))
        return float(r.lease_seconds)

    async def heartbeat(
        self,
        holder_id: str,
        used_frames: int,
        active_flows: int,
        elbow_flows: int = 0,
        queue_depth: int = 0,
        hot_pages: Sequence[tuple[str, int, int]] = (),
        fanin_mean: float | None = None,
    ) -> float:
        """Renew the lease and report the load: fan-in (``active_flows`` running,
        ``queue_depth`` queued, now; ``fanin_mean``: both time-averaged since the last beat, what
        the load replicas judge by when given), the elbow, and ``hot_pages``
        ``(corpus, page, hits)``. Raises CoordinatorError(NOT_FOUND) when it must register
        again."""
        req = pb.HeartbeatRequest(
            holder_id=holder_id,
            used_frames=used_frames,
            active_flows=active_flows,
            elbow_flows=elbow_flows,
            queue_depth=queue_depth,
            hot_pages=[pb.PageHeat(corpus_id=c, page=p, hits=h) for c, p, h in hot_pages],
            fanin_mean=fanin_mean,
        )
        r: Any = await self._call(lambda stub: stub.Heartbeat(req, timeout=self.timeout))
        return float(r.lease_seconds)

    async def list_corpora(self, stored: bool = False) -> list[CorpusStatus]:
        """The coordinator's corpora in every state; ``stored``: also those of its page store it
        was never asked to pin (state ``stored``)."""
        req = pb.ListCorporaRequest(stored=stored)
        r: Any = await self._call(lambda stub: stub.ListCorpora(req, timeout=self.timeout))
        return [_corpus(c) for c in r.corpora]

    async def list_holders(self) -> list[HolderState]:
        r: Any = await self._call(
            lambda stub: stub.ListHolders(pb.ListHoldersRequest(), timeout=self.timeout)
        )
        return [
            HolderState(
                _holder(s.holder), s.used_frames, s.active_flows, s.heartbeat_age_s, s.placed_frames
            )
            for s in r.holders
        ]

    async def lease_s(self) -> float:
        """The coordinator's holder lease in seconds (0: a coordinator too old to say), for a
        client that registers nothing (the SGLang plugin) and still paces itself by it."""
        r: Any = await self._call(
            lambda stub: stub.ListHolders(pb.ListHoldersRequest(), timeout=self.timeout)
        )
        return float(r.lease_seconds)

    async def page_table(self, corpus_id: str) -> PageTable:
        """Raises CoordinatorError: NOT_FOUND (unknown), FAILED_PRECONDITION (not ready)."""
        req = pb.GetPageTableRequest(corpus_id=corpus_id)
        return _table(await self._call(lambda stub: stub.GetPageTable(req, timeout=self.timeout)))

    async def pin(
        self, corpus_id: str, replicas: int = 1, wait: bool = False, timeout: float | None = None
    ) -> PageTable:
        """Publish a corpus of the coordinator's store onto holders. Its state is ``ready``, or
        ``queued`` (no pages yet) when it does not fit now and ``wait`` is false; with ``wait``
        the call returns once it is placed (or fails at ``timeout``, DEADLINE_EXCEEDED)."""
        req = pb.PinRequest(corpus_id=corpus_id, replicas=replicas, wait=wait)
        r: Any = await self._call(lambda stub: stub.Pin(req, timeout=timeout or self.timeout))
        return _table(r.table)

    async def unpin(self, corpus_id: str) -> int:
        """Release a corpus's frames everywhere; returns how many. Idempotent once retired."""
        r: Any = await self._call(
            lambda stub: stub.Unpin(pb.UnpinRequest(corpus_id=corpus_id), timeout=self.timeout)
        )
        return int(r.frames_freed)

    async def unpin_corpus(self, corpus: str, delete: bool = False) -> Removal:
        """Unpin the corpus ``corpus`` means (an id, a name or an id prefix of ≥ 8 characters):
        off every holder and out of the page table; ``delete``: out of the page store too.
        Raises CoordinatorError: NOT_FOUND (unknown), INVALID_ARGUMENT (ambiguous)."""
        req = pb.UnpinRequest(corpus_id=corpus, delete=delete)
        r: Any = await self._call(lambda stub: stub.Unpin(req, timeout=self.timeout))
        return Removal(_corpus(r.corpus), r.frames_freed, r.deleted, r.bytes_deleted)

    async def delete_corpus(self, corpus: str) -> Removal:
        """Delete a corpus that is not pinned from the coordinator's page store. Raises
        CoordinatorError: FAILED_PRECONDITION (still pinned), NOT_FOUND, INVALID_ARGUMENT."""
        req = pb.DeleteRequest(corpus_id=corpus)
        r: Any = await self._call(lambda stub: stub.Delete(req, timeout=self.timeout))
        return Removal(_corpus(r.corpus), 0, r.deleted, r.bytes_deleted)

    async def report_worker(self, w: WorkerReport) -> tuple[float, tuple[str, ...]]:
        """An agent worker's load report (registers it on first); returns its lease and the
        corpora it reported bound that are no longer pinned (it should drop them)."""
        req = pb.WorkerReport(
            worker_id=w.worker_id,
            address=w.address,
            sessions=w.sessions,
            generating=w.generating,
            max_batch=w.max_batch,
            kv_tokens=w.kv_tokens,
            kv_capacity=w.kv_capacity,
            corpora=list(w.corpora),
            metrics_url=w.metrics_url,
        )
        r: Any = await self._call(lambda stub: stub.ReportWorker(req, timeout=self.timeout))
        return float(r.lease_seconds), tuple(r.unpinned)

    async def list_workers(self) -> list[WorkerState]:
        r: Any = await self._call(
            lambda stub: stub.ListWorkers(pb.ListWorkersRequest(), timeout=self.timeout)
        )
        return [
            WorkerState(
                WorkerReport(
                    s.report.worker_id,
                    s.report.address,
                    s.report.sessions,
                    s.report.generating,
                    s.report.max_batch,
                    s.report.kv_tokens,
                    s.report.kv_capacity,
                    tuple(s.report.corpora),
                    s.report.metrics_url,
                ),
                s.age_s,
                s.live,
            )
            for s in r.workers
        ]

    async def choose_worker(
        self, session_tokens: int, exclude: Sequence[str] = ()
    ) -> tuple[str, str]:
        """(worker id, address) of a new session's home, never one at an ``exclude`` address.
        Raises CoordinatorError: UNAVAILABLE (no live worker), RESOURCE_EXHAUSTED (all full)."""
        req = pb.ChooseWorkerRequest(session_tokens=session_tokens, exclude=list(exclude))
        r: Any = await self._call(lambda stub: stub.ChooseWorker(req, timeout=self.timeout))
        return r.worker_id, r.address

    async def wait_holders(self, n: int, timeout: float = 30.0) -> list[HolderState]:
        """Poll until at least ``n`` holders are live; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            with_lease = [h for h in await self.list_holders() if h.info.live]
            if len(with_lease) >= n:
                return with_lease
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(with_lease)} of {n} holders live after {timeout} s")
            await asyncio.sleep(0.05)
