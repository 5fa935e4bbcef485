"""The Coordinator gRPC servicer: validate → act (publisher / state) → reply.

Wire types stop here. Every refusal is a gRPC status with a one-line message, and a bad request
changes nothing: checks that need no lock run before any state is touched.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Awaitable
from typing import Any

import grpc

from corpusd.coordinator import lifecycle
from corpusd.coordinator.client import HOLDER_SPEC
from corpusd.coordinator.db import CorpusRow, HolderRow, NotLeader
from corpusd.coordinator.election import Leadership
from corpusd.coordinator.publish import Publisher
from corpusd.coordinator.replicas import LoadReport, Replicator
from corpusd.coordinator.sessions import NoWorker, WorkerLoad, choose_home
from corpusd.coordinator.state_store import Table
from corpusd.coordinator.upkeep import reconcile
from corpusd.corpus.head import corpus_head
from corpusd.corpus.manifest import Manifest
from corpusd.corpus.store import PageStore, StoreError
from corpusd.rpc import Reject, Rpc
from corpusd.v1 import coordinator_pb2 as pb
from corpusd.v1 import coordinator_pb2_grpc

log = logging.getLogger("corpusd.coordinator")
S = grpc.StatusCode


def _status(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    """A write that found another coordinator leading, or a state store out of reach: both
    UNAVAILABLE, so a client with several coordinator addresses moves on."""
    if isinstance(e, NotLeader):
        return S.UNAVAILABLE, str(e)
    etcd = sys.modules.get("aetcd.exceptions")  # loaded only by a coordinator on etcd
    if etcd is not None and isinstance(e, etcd.ClientError):
        return S.UNAVAILABLE, f"the state store is unavailable: {type(e).__name__}: {e}"
    return None


rpc = Rpc(log, requests=lambda service: service.pub.metrics.requests, status=_status)


def _holder(h: HolderRow, now: float) -> pb.HolderAddress:
    return pb.HolderAddress(**h.spec(), live=h.live(now))


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        pub: Publisher,
        store: PageStore,
        lease_s: float,
        lead: Leadership | None = None,
        replicator: Replicator | None = None,
    ) -> None:
        """``lead``: default, always leading (SQLite); ``replicator``: default, one that never
        acts (its reports are kept for status)."""
        self.pub, self.state, self.store, self.lease_s = pub, pub.state, store, lease_s
        self.lead = lead or Leadership()
        self.replicator = replicator or Replicator(0)
        self._tasks: set[asyncio.Task[Any]] = set()
        # agent workers: soft state rebuilt from their reports within one lease after a restart
        self.workers: dict[str, tuple[pb.WorkerReport, float]] = {}
        # worker → corpus → when its reports first listed that corpus bound (this clock)
        self.bound_since: dict[str, dict[str, float]] = {}
        self._heads: dict[str, tuple[int, str]] = {}  # corpus id → its head (head.py)

    async def _leading(self) -> None:
        """Raise NotLeader (UNAVAILABLE, naming the leader) on a standby: it serves reads only."""
        if not self.lead.leading:
            raise NotLeader(await self.lead.leader())

    def _background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # keep a reference until done (asyncio holds only weak ones)
        task.add_done_callback(self._tasks.discard)

    # -- holders --------------------------------------------------------------------------------
    @rpc("RegisterHolder")
    async def RegisterHolder(self, request: pb.RegisterHolderRequest, context: Any) -> Any:
        await self._leading()
        h = request.holder
        bad = [
            k for k in ("holder_id", "address", "model_fingerprint", "dtype") if not getattr(h, k)
        ]
        bad += [k for k in ("capacity_frames", "page_size") if getattr(h, k) <= 0]
        if bad:
            raise Reject(S.INVALID_ARGUMENT, f"holder registration lacks {', '.join(bad)}")
        await self.state.register(
            HolderRow(
                **{f: getattr(h, f) for f in HOLDER_SPEC},
                used_frames=0,
                active_flows=0,
                last_heartbeat=time.time(),
                lease_s=self.lease_s,
            ),
            self.lease_s,
        )
        log.info(
            "holder %s registered at %s (%d frames)", h.holder_id, h.address, h.capacity_frames
        )
        self._background(self._after_join(h.holder_id))
        return pb.RegisterHolderResponse(lease_seconds=self.lease_s)

    async def _after_join(self, holder_id: str) -> None:
        await reconcile(self.pub, holder_id)
        self.pub.capacity_changed.set()

    @rpc("Heartbeat")
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        await self._leading()
        fanin = float(request.active_flows + request.queue_depth)  # one instant: older holders
        if request.HasField("fanin_mean"):
            fanin = request.fanin_mean
        if not (math.isfinite(fanin) and fanin >= 0):
            raise Reject(S.INVALID_ARGUMENT, f"fanin_mean: {fanin}; must be finite and >= 0")
        now = time.time()
        before = await self.state.holder(request.holder_id)
        if before is None or not await self.state.heartbeat(
            request.holder_id, request.used_frames, request.active_flows, now
        ):
            raise Reject(S.NOT_FOUND, f"holder {request.holder_id!r} is not registered")
        if not before.live(now):  # back after a lapse: it may hold frames of failed pins
            log.info("holder %s is live again", request.holder_id)
            self._background(self._after_join(request.holder_id))
        elif request.used_frames < before.used_frames:
            self.pub.capacity_changed.set()
        self.replicator.observe(
            request.holder_id,
            LoadReport(
                time.monotonic(),
                fanin,
                request.elbow_flows,
                {(x.corpus_id, x.page): x.hits for x in request.hot_pages[:1024]},
                request.queue_depth,
            ),
        )
        return pb.HeartbeatResponse(lease_seconds=self.lease_s)

    @rpc("ListHolders")
    async def ListHolders(self, request: pb.ListHoldersRequest, context: Any) -> Any:
        now, placed = time.time(), await self.state.placed_frames()
        return pb.ListHoldersResponse(
            holders=[
                pb.HolderStatus(
                    holder=_holder(h, now),
                    used_frames=h.used_frames,
                    active_flows=h.active_flows,
                    heartbeat_age_s=now - h.last_heartbeat,
                    placed_frames=placed.get(h.holder_id, 0),
                    elbow_flows=r.elbow if (r := self.replicator.latest(h.holder_id)) else 0,
                    queue_depth=r.queued if r else 0,
                )
                for h in await self.state.holders()
            ],
            lease_seconds=self.lease_s,
        )

    # -- agent workers --------------------------------------------------------------------------
    @rpc("ReportWorker")
    async def ReportWorker(self, request: pb.WorkerReport, context: Any) -> Any:
        await self._leading()
        bad = [k for k in ("worker_id", "address") if not getattr(request, k)]
        bad += [k for k in ("max_batch", "kv_capacity") if getattr(request, k) <= 0]
        if bad:
            raise Reject(S.INVALID_ARGUMENT, f"worker report lacks {', '.join(bad)}")
        if request.worker_id not in self.workers:
            log.info("agent worker %s at %s", request.worker_id, request.address)
        now = time.time()
        self.workers[request.worker_id] = (request, now)
        unpinned = await self._unpinned(request, now)
        return pb.ReportWorkerResponse(lease_seconds=self.lease_s, unpinned=unpinned)

    async def _unpinned(self, request: pb.WorkerReport, now: float) -> list[str]:
        """The corpora the worker reports bound whose binding is void: no longer pinned
        (retired, deleted, or being pinned again), or published again since the worker's
        reports first listed it (unpinned and re-pinned between two reports: its page table
        has changed)."""
        since = self.bound_since.setdefault(request.worker_id, {})
        listed = set(request.corpora)
        for cid in [c for c in since if c not in listed]:
            del since[cid]
        gone = []
        for cid in request.corpora:
            first = since.setdefault(cid, now)
            row = await self.state.corpus(cid)
            if row is None or row.state != "ready" or first < row.updated_at:
                gone.append(cid)
                del since[cid]
        return gone

    @rpc("ListWorkers")
    async def ListWorkers(self, request: pb.ListWorkersRequest, context: Any) -> Any:
        now = time.time()
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerStatus(report=r, age_s=now - t, live=now - t <= self.lease_s)
                for _, (r, t) in sorted(self.workers.items())
            ]
        )

    @rpc("ChooseWorker")
    async def ChooseWorker(self, request: pb.ChooseWorkerRequest, context: Any) -> Any:
        await self._leading()
        now = time.time()
        gone = set(request.exclude)  # the client found these dead; their leases may not show it
        live = {
            w: r
            for w, (r, t) in self.workers.items()
            if now - t <= self.lease_s and r.address not in gone
        }
        if not live and time.monotonic() - self.lead.since < self.lease_s:
            # a new leader: the workers report to it within a lease (a client moves on, retries)
            raise Reject(S.UNAVAILABLE, "leading for under a lease: agent workers still reporting")
        if not live:
            raise Reject(S.UNAVAILABLE, "no live agent worker has reported (is corpusd agent up?)")
        loads = [
            WorkerLoad(w, r.generating, r.max_batch, r.kv_tokens, r.kv_capacity)
            for w, r in live.items()
        ]
        try:
            chosen = choose_home(loads, request.session_tokens)
        except NoWorker as e:
            raise Reject(S.RESOURCE_EXHAUSTED, str(e)) from None
        # Count the session now, so a burst of choices spreads before the next reports arrive.
        r = live[chosen]
        # saturating: the fields are uint32/uint64, and a report may claim their maximum
        r.generating = min(r.generating + 1, 2**32 - 1)
        r.kv_tokens = min(r.kv_tokens + request.session_tokens, 2**64 - 1)
        return pb.ChooseWorkerResponse(worker_id=chosen, address=r.address)

    # -- corpora --------------------------------------------------------------------------------
    async def _info(
        self, row: CorpusRow, now: float, holders: tuple[str, ...] | None = None
    ) -> pb.CorpusInfo:
        """``row`` on the wire; ``holders``: those that held it (given once its pages are gone
        from the page table: an unpin's answer), else read from the page table."""
        m = Manifest.from_json(row.manifest)
        if holders is None:
            table = await self.state.page_table(row.corpus_id) if row.state == "ready" else {}
            holders = tuple(sorted({hid for reps in table.values() for hid, _ in reps}))
        live = {h.holder_id for h in await self.state.holders() if h.live(now)}
        queue = [r.corpus_id for r in await self.state.queued()] if row.state == "queued" else []
        return pb.CorpusInfo(
            corpus_id=row.corpus_id,
            name=row.name,
            state=row.state,
            tokens=row.tokens,
            pages=row.pages,
            page_size=m.page_size,
            cp_degree=row.cp_degree,
            replicas=row.replicas,
            model_fingerprint=m.model_fingerprint,
            holder_ids=holders,
            expired_holders=[h for h in holders if h not in live],
            queue_position=queue.index(row.corpus_id) + 1 if row.corpus_id in queue else 0,
            created_at=m.created_at,
            state_age_s=max(0.0, now - row.updated_at),
            **self._head(row.corpus_id),
        )

    def _head(self, corpus_id: str) -> dict[str, Any]:
        """The corpus's head fields, read from the store once (a corpus id names its content);
        none when its tokens cannot be read (then no bound prompt is checked against them)."""
        if corpus_id not in self._heads:
            try:
                self._heads[corpus_id] = corpus_head(self.store.read_token_ids(corpus_id))
            except Exception as e:  # a missing or unreadable tokens file costs only the check
                log.warning("corpus %s: no head digest (tokens unreadable: %s)", corpus_id, e)
                self._heads[corpus_id] = (0, "")  # said once, not at every listing
        n, digest = self._heads[corpus_id]
        return {"head_len": n, "head_digest": digest} if n else {}

    async def _table(self, row: CorpusRow, table: Table | None = None) -> pb.PageTable:
        now = time.time()
        if table is None:
            table = await self.state.page_table(row.corpus_id)
        ids = {hid for reps in table.values() for hid, _ in reps}
        return pb.PageTable(
            corpus=await self._info(row, now),
            holders=[_holder(h, now) for h in await self.state.holders() if h.holder_id in ids],
            pages=[
                pb.PageEntry(page=p, replicas=[pb.Replica(holder_id=h, frame=f) for h, f in reps])
                for p, reps in sorted(table.items())
            ],
        )

    async def _known(self, corpus_id: str) -> CorpusRow:
        row = await self.state.corpus(corpus_id)
        if row is None:
            raise Reject(S.NOT_FOUND, f"corpus {corpus_id!r} is not known to this coordinator")
        return row

    @rpc("ListCorpora")
    async def ListCorpora(self, request: pb.ListCorporaRequest, context: Any) -> Any:
        now, rows = time.time(), await self.state.corpora()
        if request.stored:
            rows += await lifecycle.stored_rows(self.pub, self.store)
        return pb.ListCorporaResponse(corpora=[await self._info(r, now) for r in rows])

    @rpc("GetPageTable")
    async def GetPageTable(self, request: pb.GetPageTableRequest, context: Any) -> Any:
        row = await self._known(request.corpus_id)
        if row.state != "ready":
            raise Reject(
                S.FAILED_PRECONDITION, f"corpus {row.corpus_id} is {row.state}: no page table"
            )
        table = await self.state.page_table(row.corpus_id)
        if len(table) != row.pages:
            # the row and its table are two reads: an unpin (or a re-pin) ran between them, and
            # a ready corpus's table with pages missing must never be served (an agent binding
            # it would attend none of them); read both again
            row = await self._known(row.corpus_id)  # NOT_FOUND once it is gone
            table = await self.state.page_table(row.corpus_id)
            if row.state != "ready" or len(table) != row.pages:
                raise Reject(
                    S.FAILED_PRECONDITION,
                    f"corpus {row.corpus_id} is {row.state}: its page table changed while it was "
                    "read; ask again",
                )
        return await self._table(row, table)

    @rpc("Pin")
    async def Pin(self, request: pb.PinRequest, context: Any) -> Any:
        await self._leading()
        cid, replicas = request.corpus_id, request.replicas or 1
        if not cid or not cid.isalnum():
            raise Reject(S.INVALID_ARGUMENT, f"corpus_id must be a corpus id, got {cid!r}")
        try:
            text = (self.store.corpora / cid / "manifest.json").read_text()
            m = Manifest.from_json(text)
        except FileNotFoundError:
            raise Reject(
                S.NOT_FOUND, f"corpus {cid!r} is not in the coordinator's store {self.store.root}"
            ) from None
        except (OSError, ValueError, TypeError, AssertionError, StoreError) as e:
            raise Reject(S.FAILED_PRECONDITION, f"corpus {cid}: unreadable manifest: {e}") from None
        row = await self.pub.pin(m, text, replicas)
        if row.state == "queued" and request.wait:
            row = await self.pub.wait_placed(cid, context.time_remaining())
        return pb.PinResponse(table=await self._table(row))

    @rpc("Unpin")
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> Any:
        await self._leading()
        r = await lifecycle.unpin(self.pub, self.store, request.corpus_id, request.delete)
        return pb.UnpinResponse(
            frames_freed=r.frames,
            corpus=await self._info(r.row, time.time(), r.holders),
            deleted=r.deleted,
            bytes_deleted=r.bytes_deleted,
        )

    @rpc("Delete")
    async def Delete(self, request: pb.DeleteRequest, context: Any) -> Any:
        await self._leading()
        r = await lifecycle.delete(self.pub, self.store, request.corpus_id)
        return pb.DeleteResponse(
            corpus=await self._info(r.row, time.time(), r.holders),
            deleted=r.deleted,
            bytes_deleted=r.bytes_deleted,
        )
