"""The holder's NVSHMEM endpoint: the Transport gRPC servicer (control plane) and, per requester,
a thread that enqueues each announced request's wait → compute → reply on that requester's
CUDA stream (data plane; no host in the loop once enqueued).

The holder is rank 0 of its job; ``peers`` requesters join as ranks 1…peers. Attend replies
carry a status word computed on the device with the same checks as the gRPC Attend (every index
≥ 0 must be a valid row of a frame of the named corpus); the kernel itself never reads outside
the pool, so a bad request costs one wasted kernel and an error at the requester, never the
holder.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from corpusd.kernels.registry import Kernel, for_compacted
from corpusd.model.config import MAX_HEADS
from corpusd.rpc import Reject
from corpusd.transport import nvshmem_ring as nr
from corpusd.v1 import transport_pb2, transport_pb2_grpc
from holder.config import HolderConfig
from holder.pool import FramePool, rows_outside

log = logging.getLogger("corpusd.holder.nvshmem")

STATUS_OK, STATUS_BAD_ROWS = 0, 1
BAD = grpc.StatusCode.INVALID_ARGUMENT
GRAPH_CACHE = 64  # captured plans kept per requester
Body = Callable[[torch.Tensor, torch.Tensor, int], None]  # (req slot, rep slot, layer)


@dataclass(frozen=True, slots=True)
class Plan:
    """What each request of one announced stream does: ``body`` (None for echo) reads the
    request slot and fills the reply slot for a layer; ``reply_bytes`` go back."""

    key: tuple[Any, ...]
    body: Body | None
    reply_bytes: int
    layers: int
    direct: bool = False  # body writes the requester's reply slot through NVLink; signal only


def ring_geometry(cfg: HolderConfig, heads: int) -> nr.RingGeometry:
    """Slots for ``cfg.nvshmem_rows`` query rows of the model's ``heads`` (at least 128, the
    size every earlier ring had) × ``cfg.nvshmem_topk`` selected rows: a model of more heads
    gets larger slots, not requests split into fewer rows (or none: gRPC)."""
    return nr.RingGeometry.for_shapes(
        cfg.nvshmem_peers, 2, cfg.nvshmem_rows, max(128, heads), cfg.nvshmem_topk,
        cfg.nvshmem_fetch_rows,
    )  # fmt: skip


def from_config(
    cfg: HolderConfig, pool: FramePool, kernel: Kernel, heads: int = 128
) -> NvshmemEndpoint:
    """The endpoint ``cfg.nvshmem_*`` describes for a model of ``heads`` query heads (call only
    when ``cfg.nvshmem_peers > 0``). Raises ValueError for a model whose latent rows are not the
    ring's 576 / 512 (requesters then route over gRPC: no NVSHMEM job is offered)."""
    widths = (pool.geo.kv_dim, pool.geo.d_v)
    if widths != (nr.D_QK, nr.D_V):
        raise ValueError(
            f"--nvshmem-peers: the NVSHMEM ring carries {nr.D_QK}-wide rows with {nr.D_V}-wide "
            f"outputs; this model's are {widths[0]} / {widths[1]} (serve it without NVSHMEM)"
        )
    ring = ring_geometry(cfg, heads)
    job = f"{socket.gethostname()}:{os.getpid()}:{cfg.holder_id or cfg.port}"
    return NvshmemEndpoint(pool, kernel, ring, job, socket.gethostname())


class NvshmemEndpoint(transport_pb2_grpc.TransportServicer):
    def __init__(
        self,
        pool: FramePool,
        kernel: Kernel,
        ring: nr.RingGeometry,
        job_id: str,
        host: str,
    ) -> None:
        assert pool.geo.device.startswith("cuda"), "the NVSHMEM endpoint needs a GPU pool"
        self.pool, self.kernel, self.ring, self.job_id, self.host = pool, kernel, ring, job_id, host
        self.device = torch.device(pool.geo.device)
        self.uid = nr.new_uid()
        self.job: nr.Job | None = None
        self._ready = threading.Event()
        self._joined: dict[str, int] = {}
        self._lock = threading.Lock()
        self._init_thread: threading.Thread | None = None
        self._next_seq = [1] * (ring.peers + 1)
        self._workers = [ThreadPoolExecutor(1, f"nvshmem-r{r}") for r in range(ring.peers + 1)]
        self._streams: list[torch.cuda.Stream] = []
        self._graph_cache: dict[int, dict[tuple[Any, ...], dict[tuple[int, int], Any]]] = {}
        self._seen: dict[int, set[tuple[Any, ...]]] = {}
        self._peer_reps: dict[int, torch.Tensor | None] = {}
        # device time per announced stream (the latest ones: the worker opens one per call)
        self.stream_stats: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        self._graph_pools: list[Any] = []  # one per requester: their streams run concurrently
        self._check_streams: list[Any] = []  # per requester: graph captures fork onto them

    # -- control plane ---------------------------------------------------------------------------
    async def Join(self, request: transport_pb2.JoinRequest, context: Any) -> Any:
        rank = 0
        if not request.probe:
            with self._lock:
                rank = self._joined.get(request.requester_id, 0)
                if self._init_thread is not None:
                    # init is collective and done once: members cannot change afterwards
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION
                        if rank
                        else grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the NVSHMEM job of this holder is up with its {self.ring.peers} "
                        "requester(s); it cannot take another member: use the gRPC transport",
                    )
                if not rank:  # (a requester that asks again before init keeps its rank)
                    rank = len(self._joined) + 1
                    self._joined[request.requester_id] = rank
                log.info("requester %s (%s) joins as rank %d", request.requester_id,
                         request.host, rank)  # fmt: skip
                if len(self._joined) == self.ring.peers:
                    # init and ring allocation are collective: rank 0 joins once every peer
                    # has its id, in a thread, since it blocks until all of them call init too.
                    self._init_thread = threading.Thread(target=self._init, daemon=True)
                    self._init_thread.start()
        g = self.ring
        return transport_pb2.JoinResponse(
            uid=self.uid if rank else b"",
            rank=rank,
            nranks=g.peers + 1,
            job_id=self.job_id,
            ring=transport_pb2.RingGeometry(
                peers=g.peers, depth=g.depth, req_bytes=g.req_bytes, rep_bytes=g.rep_bytes
            ),
            host=self.host,
        )

    def _init(self) -> None:
        try:
            self.job = nr.Job(self.uid, 0, self.ring.peers + 1, self.device.index or 0, self.ring)
        except Exception:
            log.exception("NVSHMEM job %s failed to come up; requesters use gRPC", self.job_id)
            return
        self._streams = [torch.cuda.Stream(self.device) for _ in range(self.ring.peers + 1)]
        self._graph_pools = [torch.cuda.graph_pool_handle() for _ in range(self.ring.peers + 1)]
        self._check_streams = [torch.cuda.Stream(self.device) for _ in range(self.ring.peers + 1)]
        self._ready.set()
        log.info("NVSHMEM job %s up: %d requesters", self.job_id, self.ring.peers)

    async def OpenStream(self, request: transport_pb2.OpenStreamRequest, context: Any) -> Any:
        r = request.rank
        if not 1 <= r <= self.ring.peers:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {r} is not a requester")
        ready = await asyncio.get_running_loop().run_in_executor(None, self._ready.wait, 60.0)
        if not ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "NVSHMEM job did not come up")
        try:
            plan = self._plan(request)
        except Reject as e:
            await context.abort(e.code, str(e))
        first = self._next_seq[r]
        self._next_seq[r] += request.count
        self._workers[r].submit(self._enqueue, r, first, request.count, plan)
        return transport_pb2.OpenStreamResponse(first_seq=first)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Leave the job (collective with the requesters, so bounded by ``timeout_s``: a
        requester that is gone, or a stream parked on a request that never came, must not keep
        the holder from exiting). False: the job was abandoned, and the process should end
        with ``os._exit`` (NVSHMEM's teardown at exit would wait for the same members)."""
        for w in self._workers:
            w.shutdown(wait=False, cancel_futures=True)
        return self.job.close(timeout_s) if self.job is not None else True

    # -- data plane ------------------------------------------------------------------------------
    def _plan(self, req: transport_pb2.OpenStreamRequest) -> Plan:
        """Check an OpenStream and return what each of its requests does on the device."""
        g, geo = self.ring, self.pool.geo
        if req.direct and self._peer_rep(req.rank) is None:
            raise Reject(BAD, "direct needs the requester on this node (no NVLink peer mapping)")
        if req.mode == "echo":
            if req.echo_bytes > g.rep_bytes:
                raise Reject(BAD, f"echo_bytes {req.echo_bytes} > reply slot {g.rep_bytes}")
            return Plan(("echo", req.direct), None, int(req.echo_bytes), 1, req.direct)
        layers = max(1, req.layers)
        if req.layer + layers > geo.n_layers:
            raise Reject(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layers {req.layer}..{req.layer + layers - 1} out of range: the model has layers "
                f"0..{geo.n_layers - 1}",
            )
        if self.pool.held(req.corpus_id) is None:
            raise Reject(
                grpc.StatusCode.NOT_FOUND, f"corpus {req.corpus_id!r} is not held by this holder"
            )
        # the pool's version is in the key: graphs captured against an older row mask are not
        # replayed once pages were assigned or released
        row_ok = self.pool.row_mask(req.corpus_id, self.device)
        n_rows = row_ok.shape[0]
        n, h, k = req.rows, req.heads, req.topk
        key = (req.mode, req.corpus_id, req.layer, layers, n, h, k, req.scale, req.direct,
               req.compacted, self.pool.version)  # fmt: skip
        kernel = for_compacted(self.kernel) if req.compacted else self.kernel

        def bad(idx: torch.Tensor) -> torch.Tensor:
            return rows_outside(row_ok, idx)

        if req.mode == "attend":
            if (
                nr.attend_request_bytes(n, h, k) > g.req_bytes
                or nr.attend_reply_bytes(n, h) > g.rep_bytes
                or not 0 < h <= MAX_HEADS
            ):
                raise Reject(BAD, f"attend rows {n} × heads {h} × topk {k} does not fit the ring")
            if not req.scale > 0:
                raise Reject(BAD, f"scale must be > 0, got {req.scale}")

            side = self._check_streams[req.rank]

            def attend(rq: torch.Tensor, rp: torch.Tensor, layer: int) -> None:
                q, idx = nr.attend_request_views(rq, n, h, k)
                o_out, lse_out, status = nr.attend_reply_views(rp, n, h)
                # the row check runs beside the kernel (a fork in the captured graph)
                cur = torch.cuda.current_stream(self.device)
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    nr.store(status, bad(idx).to(torch.int32).view(1))
                o, lse = kernel.fn(q, self.pool.latent[req.layer + layer], idx, req.scale,
                                   nr.D_V)  # fmt: skip
                nr.store(o_out, o)
                nr.store(lse_out, lse)
                cur.wait_stream(side)

            return Plan(key, attend, nr.attend_reply_bytes(n, h), layers, req.direct)
        if req.mode == "fetch":
            if n * 4 > g.req_bytes or n * nr.D_QK * 2 + 16 > g.rep_bytes:
                raise Reject(BAD, f"fetch of {n} rows does not fit the ring")

            def fetch(rq: torch.Tensor, rp: torch.Tensor, layer: int) -> None:
                rows = rq[: n * 4].view(torch.int32)
                pages, status = nr.fetch_reply_views(rp, n)
                pool = self.pool.latent[req.layer + layer]
                torch.index_select(pool, 0, rows.clamp(0, n_rows - 1), out=pages)
                nr.store(status, bad(rows.view(1, n)).to(torch.int32).view(1))

            return Plan(key, fetch, n * nr.D_QK * 2 + 4, layers, req.direct)
        raise Reject(BAD, f"mode must be attend, fetch or echo, got {req.mode!r}")

    def _peer_rep(self, r: int) -> torch.Tensor | None:
        """Requester r's reply ring mapped here (same node), cached; None across nodes."""
        if r not in self._peer_reps:
            assert self.job is not None
            self._peer_reps[r] = self.job.peer(self.job.rep, r)
        return self._peer_reps[r]

    def _graphs(self, r: int, plan: Plan, stream: torch.cuda.Stream) -> dict[tuple[int, int], Any]:
        """One CUDA graph per (ring slot, layer) of ``plan``'s body, captured once per shape: a
        request then costs the host one wait, one replay and one put instead of the body's
        dozen launches, so the host stays ahead of the GPU (eager, the holder's host was the
        bottleneck of the round trip)."""
        job = self.job
        assert job is not None and plan.body is not None
        cache = self._graph_cache.setdefault(r, {})
        if plan.key in cache:
            cache[plan.key] = cache.pop(plan.key)  # most recently used last
            return cache[plan.key]
        while len(cache) >= GRAPH_CACHE:  # shapes vary per decode step: bound the memory
            cache.pop(next(iter(cache)))
        keys = [(slot, layer) for slot in range(job.ring.depth) for layer in range(plan.layers)]
        reply = self._peer_rep(r) if plan.direct else job.rep
        assert reply is not None
        for slot, layer in keys:  # warm-up outside capture: compile, lazy init (any slot data)
            plan.body(job.req[r - 1, slot], reply[r - 1, slot], layer)
        stream.synchronize()  # (this stream only: its earlier requests were all answered)
        graphs = {}
        for slot, layer in keys:
            # capture_begin/end, not torch.cuda.graph: that one synchronizes the whole device,
            # which would wait on other requesters' streams parked in signal waits.
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._graph_pools[r], capture_error_mode="thread_local")
            try:
                plan.body(job.req[r - 1, slot], reply[r - 1, slot], layer)
            finally:
                graph.capture_end()
            graphs[(slot, layer)] = graph
        cache[plan.key] = graphs
        return graphs

    def _enqueue(self, r: int, first: int, count: int, plan: Plan) -> None:
        job = self.job
        assert job is not None
        stream = self._streams[r]
        s = stream.cuda_stream
        depth = job.ring.depth
        done: list[torch.cuda.Event] = []
        marks: list[tuple[torch.cuda.Event, ...]] = []  # (released, computed, replied)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                # a one-off shape runs eagerly (the decode worker's shapes vary per step); a
                # stream of several requests, or a shape seen before, replays graphs
                seen = self._seen.setdefault(r, set())
                if len(seen) > 16 * GRAPH_CACHE:
                    seen.clear()
                graphed = plan.body is not None and (count > 1 or plan.key in seen)
                seen.add(plan.key)
                graphs = self._graphs(r, plan, stream) if graphed else {}
                reply = self._peer_rep(r) if plan.direct else job.rep
                assert reply is not None
                for seq in range(first, first + count):
                    if len(done) >= 2 * depth:  # keep the host a bounded distance ahead
                        done.pop(0).synchronize()
                    slot = seq % depth
                    job.wait_ge(job.req_sig[r - 1 : r], seq, s)
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record(stream)
                    layer = (seq - first) % plan.layers
                    if graphs:
                        graphs[(slot, layer)].replay()
                    elif plan.body is not None:
                        plan.body(job.req[r - 1, slot], reply[r - 1, slot], layer)
                    ev[1].record(stream)
                    if plan.direct:  # the body already wrote the requester's slot
                        job.signal(job.rep_sig[r - 1 : r], seq, r, s)
                    else:
                        rp = job.rep[r - 1, slot]
                        job.put_signal(rp, plan.reply_bytes, job.rep_sig[r - 1 : r], seq, r, s)
                    ev[2].record(stream)
                    done.append(ev[2])
                    marks.append(tuple(ev))
            if marks:
                marks[-1][2].synchronize()
                body = sorted(a.elapsed_time(b) * 1e3 for a, b, _ in marks)
                put = sorted(b.elapsed_time(c) * 1e3 for _, b, c in marks)
                self.stream_stats.append({
                    "rank": r, "mode": str(plan.key[0]), "requests": count,
                    "body_us_p50": body[len(body) // 2], "put_us_p50": put[len(put) // 2],
                })  # fmt: skip
                log.debug("stream of requester %d: %s", r, self.stream_stats[-1])
        except Exception:
            log.exception("NVSHMEM stream of requester %d failed at enqueue", r)
