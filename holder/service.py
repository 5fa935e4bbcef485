"""The Holder gRPC servicer: receive → check → admit → compute → reply.

Wire types stop here: requests are decoded and checked (``holder.requests``), computed on a flow
slot (``holder.partials``, ``holder.reads``), and every failure becomes a gRPC status with a
one-line message (``corpusd.rpc.Rpc``); a bad request never reaches the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from corpusd.corpus.store import PageStore
from corpusd.kernels.registry import Kernel, report
from corpusd.rpc import Reject, Rpc
from corpusd.transport import cuda_ipc
from corpusd.v1 import holder_pb2, holder_pb2_grpc
from corpusd.wire import to_proto
from holder.admission import Admission, Overloaded
from holder.config import HolderConfig
from holder.loading import Corrupt, load_pages
from holder.metrics import HolderMetrics, k_bucket, rows_bucket
from holder.partials import partial_cpu, partial_gpu
from holder.pool import FramePool
from holder.reads import PoolReads
from holder.requests import AttendCall, RequestChecks
from holder.staging import StagingPool
from holder.state import AssignmentLog

log = logging.getLogger("corpusd.holder")
T = TypeVar("T")


def _overloaded(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(e, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"holder overloaded: {e}"
    return None


rpc = Rpc(
    log,
    requests=lambda service: service.metrics.requests,
    status=_overloaded,
    sizes=lambda service: (service.metrics.bytes_in, service.metrics.bytes_out),
    quiet=frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED}),  # shed load is counted, not logged
)


class HolderService(holder_pb2_grpc.HolderServicer):
    def __init__(
        self,
        cfg: HolderConfig,
        pool: FramePool,
        store: PageStore,
        kernel: Kernel,
        fingerprint: str,
        metrics: HolderMetrics,
    ) -> None:
        self.cfg, self.pool, self.store, self.kernel = cfg, pool, store, kernel
        self.fingerprint, self.metrics = fingerprint, metrics
        self.checks = RequestChecks(cfg, pool)
        self.reads = PoolReads(pool)
        self.log = AssignmentLog(cfg.state_dir)
        self.admission = Admission(cfg.max_flows, cfg.max_queue, cfg.queue_timeout_s)
        self.executor = ThreadPoolExecutor(cfg.max_flows, thread_name_prefix="flow")
        self._mutate = asyncio.Lock()
        self._inflight: dict[str, int] = {}
        self.staging = (
            StagingPool(cfg.staging_streams, pool.geo.device)
            if pool.geo.device.startswith("cuda")
            else None
        )
        metrics.capacity.set(pool.geo.frames)
        metrics.elbow.set(cfg.max_flows)
        # layer-0 rows attended per frame since the last heartbeat (what pages are hot)
        self.heat = torch.zeros(pool.geo.frames, dtype=torch.int64)
        report(kernel, cfg.device, "holder", metrics.kernel)
        # this process's pools: a requester that mapped an earlier process's must not reuse it
        self.incarnation = secrets.token_hex(8)

    async def _run(self, corpus_id: str, fn: Callable[[], T]) -> tuple[T, float, float]:
        """Run ``fn`` in a flow slot on the executor; returns (result, queued s, compute s).
        Raises Overloaded when no slot frees in time."""
        self._inflight[corpus_id] = self._inflight.get(corpus_id, 0) + 1
        self.metrics.queue.set(self.admission.queued + 1)
        try:
            async with self.admission.slot() as waited:
                self.metrics.queue.set(self.admission.queued)
                self.metrics.queue_wait.observe(waited)
                self.metrics.flows.set(self.admission.active)
                t0 = time.perf_counter()
                result = await asyncio.get_running_loop().run_in_executor(self.executor, fn)
                return result, waited, time.perf_counter() - t0
        finally:
            self._inflight[corpus_id] -= 1
            self.metrics.flows.set(self.admission.active)
            self.metrics.queue.set(self.admission.queued)

    # -- route -------------------------------------------------------------------------------------
    @rpc("Attend", sized=False)
    async def Attend(
        self, request: holder_pb2.AttendRequest, context: Any
    ) -> holder_pb2.AttendResponse:
        t0 = time.perf_counter()
        call = self.checks.attend(request, on_device=self.staging is not None)
        n, h = call.q.shape[:2]
        kernel = self.kernel.resolve(n, h)
        compute = (
            functools.partial(partial_gpu, self.pool, self.staging, kernel, call)
            if self.staging is not None
            else functools.partial(partial_cpu, self.pool, kernel, call)
        )
        t1 = time.perf_counter()
        (o, lse, bad), waited, secs = await self._run(call.corpus_id, compute)
        t2 = time.perf_counter()
        if bad is not None:
            self.checks.device_found(call, bad)
        reply = holder_pb2.AttendResponse(
            o=to_proto(o.to(call.q.dtype)),
            lse=to_proto(lse.float()),
            kernel=kernel.name,
            compute_us=secs * 1e6,
        )
        self._observe_attend(call, o, lse, (t1 - t0, waited, secs, time.perf_counter() - t2))
        return reply

    def _observe_attend(
        self,
        call: AttendCall,
        o: torch.Tensor,
        lse: torch.Tensor,
        stages: tuple[float, float, float, float],
    ) -> None:
        """Attend's metrics: compute time by shape, time by stage (decode, queue, compute,
        encode: seconds), and the payload bytes (``ByteSize`` would copy them)."""
        m, (n, k) = self.metrics, call.rows.shape
        if call.layer == 0:
            rows = call.rows.reshape(-1).to("cpu", torch.int64)
            frames = rows[rows >= 0] // self.pool.geo.page_size
            self.heat += torch.bincount(frames, minlength=self.heat.numel())[: self.heat.numel()]
        m.partial.labels(rows_bucket(n), k_bucket(k)).observe(stages[2])
        for stage, secs in zip(("decode", "queue", "compute", "encode"), stages, strict=True):
            m.attend_stage.labels(stage).observe(secs)
        elt = call.q.element_size()
        m.bytes_in.labels("Attend").inc(call.q.numel() * elt + call.rows.numel() * 4)
        m.bytes_out.labels("Attend").inc(o.numel() * elt + lse.numel() * 4)

    def hot_pages(self, n: int = 64) -> list[tuple[str, int, int]]:
        """The ``n`` most attended pages since the last call, ``(corpus, page, hits)``, hottest
        first; the counts start again from zero."""
        heat, self.heat = self.heat, torch.zeros_like(self.heat)
        hits, frames = torch.topk(heat, min(n, heat.numel()))
        out = []
        for h, f in zip(hits.tolist(), frames.tolist(), strict=True):
            if h > 0 and f in self.pool.table:
                cid, page = self.pool.table[f]
                out.append((cid, page, h))
        return out

    # -- move the cache ----------------------------------------------------------------------------
    @rpc("Fetch")
    async def Fetch(
        self, request: holder_pb2.FetchRequest, context: Any
    ) -> holder_pb2.FetchResponse:
        layers, frames = self.checks.fetch(request)
        gather = functools.partial(self.reads.pages, frames, layers, request.index_keys)
        (lat, idx), _, _ = await self._run(request.corpus_id, gather)
        return holder_pb2.FetchResponse(
            latent=[to_proto(t) for t in lat], index_keys=[to_proto(t) for t in idx]
        )

    # -- indexer -----------------------------------------------------------------------------------
    @rpc("IndexTopK")
    async def IndexTopK(
        self, request: holder_pb2.IndexTopKRequest, context: Any
    ) -> holder_pb2.IndexTopKResponse:
        call = self.checks.index_topk(request)
        (picked, vals), _, _ = await self._run(call.corpus_id, self.reads.index_topk(call))
        return holder_pb2.IndexTopKResponse(positions=to_proto(picked), scores=to_proto(vals))

    @rpc("IndexKeys")
    async def IndexKeys(
        self, request: holder_pb2.IndexKeysRequest, context: Any
    ) -> AsyncIterator[holder_pb2.IndexKeysChunk]:
        self.checks.held(request.corpus_id)
        self.checks.layer(request.layer)
        for pages, keys in self.reads.index_key_chunks(request.corpus_id, request.layer):
            msg = holder_pb2.IndexKeysChunk(pages=pages, keys=to_proto(keys))
            self.metrics.bytes_out.labels("IndexKeys").inc(msg.ByteSize())
            yield msg

    # -- placement ------------------------------------------------------------------------------
    @rpc("Assign")
    async def Assign(
        self, request: holder_pb2.AssignRequest, context: Any
    ) -> holder_pb2.AssignResponse:
        async with self._mutate:
            frames = await asyncio.get_running_loop().run_in_executor(
                None, self.assign, request.corpus_id, list(request.pages)
            )
        return holder_pb2.AssignResponse(
            frames=[holder_pb2.PageFrame(page=p, frame=f) for p, f in sorted(frames.items())],
            page_size=self.pool.geo.page_size,
        )

    def assign(
        self,
        corpus_id: str,
        pages: list[int],
        wanted: dict[int, int] | None = None,
        when: str = "assign",
    ) -> dict[int, int]:
        """Load ``pages`` (all when empty) of a pinned corpus into frames; returns page → frame for
        the requested pages. Idempotent, all-or-nothing (``load_pages``); raises Reject. Corrupt
        stored data is counted in ``corrupt{when}`` (``when``: assign or restore) and refused."""
        try:
            frames, loaded = load_pages(
                self.pool, self.store, self.fingerprint, corpus_id, pages, wanted
            )
        except Corrupt as e:
            if e.pages:
                self.metrics.corrupt.labels(when, "page").inc(len(e.pages))
            else:
                self.metrics.corrupt.labels(when, "file").inc()
            log.error("refused corpus %s on %s: %s", corpus_id, when, e)
            raise
        if loaded:
            self.reads.forget(corpus_id)
            self._persist()
        self._update_resident()
        return frames

    @rpc("Release")
    async def Release(
        self, request: holder_pb2.ReleaseRequest, context: Any
    ) -> holder_pb2.ReleaseResponse:
        async with self._mutate:
            self.checks.held(request.corpus_id)
            while self._inflight.get(request.corpus_id, 0):  # let running flows finish reading
                await asyncio.sleep(0.001)
            freed = self.pool.release(request.corpus_id, list(request.pages))
            self.reads.forget(request.corpus_id)
            self._persist()
            self._update_resident()
        return holder_pb2.ReleaseResponse(freed=freed)

    def _persist(self) -> None:
        self.log.save({cid: dict(h.pages) for cid, h in self.pool.corpora.items()})

    def _update_resident(self) -> None:
        self.metrics.pages.set(self.pool.used_frames)
        self.metrics.resident_bytes.set(self.pool.used_frames * self.pool.geo.bytes_per_frame)

    @rpc("Info")
    async def Info(self, request: holder_pb2.InfoRequest, context: Any) -> holder_pb2.InfoResponse:
        geo = self.pool.geo
        return holder_pb2.InfoResponse(
            holder_id=self.cfg.holder_id,
            device=self.cfg.device,
            kernel=self.kernel.name,
            page_size=geo.page_size,
            n_layers=geo.n_layers,
            capacity_frames=geo.frames,
            used_frames=self.pool.used_frames,
            active_flows=self.admission.active,
            queued_flows=self.admission.queued,
            model_fingerprint=self.fingerprint,
            corpora=[
                holder_pb2.CorpusHeld(
                    corpus_id=cid,
                    tokens=h.token_count,
                    frames=[
                        holder_pb2.PageFrame(page=p, frame=f) for p, f in sorted(h.pages.items())
                    ],
                )
                for cid, h in sorted(self.pool.corpora.items())
            ],
        )

    @rpc("SharePool")
    async def SharePool(
        self, request: holder_pb2.SharePoolRequest, context: Any
    ) -> holder_pb2.SharePoolResponse:
        geo = self.pool.geo
        if not geo.device.startswith("cuda"):
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"holder {self.cfg.holder_id} keeps its pool on {geo.device}; only a GPU pool is "
                "shared (start the holder with --device cuda:N)",
            )
        here = cuda_ipc.device_uuid(geo.device)
        if request.device_uuid != here and not request.peer:
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"holder {self.cfg.holder_id} is on GPU {here}, not {request.device_uuid!r}: "
                "a pool is shared with a requester on its own GPU, or (peer) on another GPU of "
                "this host that reaches it over NVLink; else use Attend",
            )
        # fp8 pools go as they are (uint8 [whole 64-row blocks, 656]): the requester's device
        # path runs FlashMLA's fp8 decode over them as this holder does
        latent = [cuda_ipc.to_wire(cuda_ipc.share(t)) for t in self.pool.latent]
        # from now on a released frame may still be read in place by a running request
        self.pool.reuse_delay_s = self.cfg.shared_reuse_delay_s
        log.info(
            "pool shared over CUDA IPC (%d layers) with a requester on %s%s; released frames "
            "wait %.0f s before reuse", len(latent), request.device_uuid,
            "" if request.device_uuid == here else f" (peer access to {here})",
            self.pool.reuse_delay_s,
        )  # fmt: skip
        return holder_pb2.SharePoolResponse(
            latent=latent, page_size=geo.page_size, d_v=geo.d_v, holder_id=self.cfg.holder_id,
            incarnation=self.incarnation,
        )  # fmt: skip

    def restore(self) -> int:
        """Reload every assignment of the log into the same frames (at start-up). A corpus that
        cannot be (a page failing its digest, say) is left out, logged and counted; the others
        are served. Returns pages restored."""
        n = 0
        for cid, pages in self.log.load().items():
            try:
                self.assign(cid, sorted(pages), wanted=pages, when="restore")
                n += len(pages)
            except Corrupt:
                pass  # logged and counted by assign; requesters fail over to its replicas
            except Reject as e:
                log.error("could not restore corpus %s: %s: %s", cid, e.code.name, e)
        return n
