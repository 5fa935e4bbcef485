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

from corpusd.transport import nvshmem_ring as nr
from corpusd.v1 import transport_pb2, transport_pb2_grpc
from holder.config import HolderConfig
from holder.kernels import Kernel
from holder.pool import FramePool

log = logging.getLogger("corpusd.holder.nvshmem")

STATUS_OK, STATUS_BAD_ROWS = 0, 1
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


def from_config(cfg: HolderConfig, pool: FramePool, kernel: Kernel) -> NvshmemEndpoint:
    """The endpoint ``cfg.nvshmem_*`` describes (call only when ``cfg.nvshmem_peers > 0``)."""
    ring = nr.RingGeometry.for_shapes(
        cfg.nvshmem_peers, 2, cfg.nvshmem_rows, 128, cfg.nvshmem_topk, cfg.nvshmem_fetch_rows
    )
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
        self._row_ok: dict[str, torch.Tensor] = {}
        self._graph_cache: dict[int, dict[tuple[Any, ...], dict[tuple[int, int], Any]]] = {}
        self._peer_reps: dict[int, torch.Tensor | None] = {}
        self.stream_stats: list[dict[str, Any]] = []  # device time per announced stream
        self._graph_pools: list[Any] = []  # one per requester: their streams run concurrently
        self._check_streams: list[Any] = []  # per requester: graph captures fork onto them

    # -- control plane ---------------------------------------------------------------------------
    async def Join(self, request: transport_pb2.JoinRequest, context: Any) -> Any:
        with self._lock:
            rank = self._joined.get(request.requester_id)
            if rank is None:
                if len(self._joined) == self.ring.peers:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the NVSHMEM job of this holder has {self.ring.peers} requester slots, "
                        "all taken; use the gRPC transport",
                    )
                rank = len(self._joined) + 1
                self._joined[request.requester_id] = rank
            if len(self._joined) == self.ring.peers and self._init_thread is None:
                # init and ring allocation are collective: rank 0 joins once every peer has
                # its id, in a thread, since it blocks until all of them call init too.
                self._init_thread = threading.Thread(target=self._init, daemon=True)
                self._init_thread.start()
        g = self.ring
        return transport_pb2.JoinResponse(
            uid=self.uid,
            rank=rank,
            nranks=g.peers + 1,
            job_id=self.job_id,
            ring=transport_pb2.RingGeometry(
                peers=g.peers, depth=g.depth, req_bytes=g.req_bytes, rep_bytes=g.rep_bytes
            ),
        )

    def _init(self) -> None:
        self.job = nr.Job(self.uid, 0, self.ring.peers + 1, self.device.index or 0, self.ring)
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
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        first = self._next_seq[r]
        self._next_seq[r] += request.count
        self._workers[r].submit(self._enqueue, r, first, request.count, plan)
        return transport_pb2.OpenStreamResponse(first_seq=first)

    def close(self) -> None:
        for w in self._workers:
            w.shutdown(wait=True)
        if self.job is not None:
            self.job.close()

    # -- data plane ------------------------------------------------------------------------------
    def _row_mask(self, corpus_id: str) -> torch.Tensor:
        """bool ``[pool rows]`` on the device: rows that hold a token of ``corpus_id``."""
        cached = self._row_ok.get(corpus_id)
        if cached is None:
            held = self.pool.held(corpus_id)
            if held is None:
                raise ValueError(f"corpus {corpus_id!r} is not held by this holder")
            p = self.pool.geo.page_size
            owned = (self.pool.owner == held.handle).repeat_interleave(p)
            slot_ok = torch.arange(p).repeat(
                self.pool.geo.frames
            ) < self.pool.valid.repeat_interleave(p)
            cached = (owned & slot_ok).to(self.device)
            self._row_ok[corpus_id] = cached
        return cached

    def _plan(self, req: transport_pb2.OpenStreamRequest) -> Plan:
        """Check an OpenStream and return what each of its requests does on the device."""
        g, geo = self.ring, self.pool.geo
        if req.direct and self._peer_rep(req.rank) is None:
            raise ValueError("direct needs the requester on this node (no NVLink peer mapping)")
        if req.mode == "echo":
            if req.echo_bytes > g.rep_bytes:
                raise ValueError(f"echo_bytes {req.echo_bytes} > reply slot {g.rep_bytes}")
            return Plan(("echo", req.direct), None, int(req.echo_bytes), 1, req.direct)
        layers = max(1, req.layers)
        if req.layer + layers > geo.n_layers:
            raise ValueError(f"layers {req.layer}..{req.layer + layers - 1} past {geo.n_layers}")
        row_ok = self._row_mask(req.corpus_id)
        n_rows = row_ok.shape[0]
        n, h, k = req.rows, req.heads, req.topk
        key = (req.mode, req.corpus_id, req.layer, layers, n, h, k, req.scale, req.direct)

        def bad(idx: torch.Tensor) -> torch.Tensor:
            used = idx >= 0
            ok = ~used | ((idx < n_rows) & row_ok[idx.clamp(0, n_rows - 1).long()])
            return ((idx < -1) | ~ok).any()

        if req.mode == "attend":
            if (
                nr.attend_request_bytes(n, h, k) > g.req_bytes
                or nr.attend_reply_bytes(n, h) > g.rep_bytes
                or not 0 < h <= 128
            ):
                raise ValueError(f"attend rows {n} × heads {h} × topk {k} does not fit the ring")
            if not req.scale > 0:
                raise ValueError(f"scale must be > 0, got {req.scale}")

            side = self._check_streams[req.rank]

            def attend(rq: torch.Tensor, rp: torch.Tensor, layer: int) -> None:
                q, idx = nr.attend_request_views(rq, n, h, k)
                o_out, lse_out, status = nr.attend_reply_views(rp, n, h)
                # the row check runs beside the kernel (a fork in the captured graph)
                cur = torch.cuda.current_stream(self.device)
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    nr.store(status, bad(idx).to(torch.int32).view(1))
                o, lse = self.kernel.fn(q, self.pool.latent[req.layer + layer], idx, req.scale,
                                        nr.D_V)  # fmt: skip
                nr.store(o_out, o)
                nr.store(lse_out, lse)
                cur.wait_stream(side)

            return Plan(key, attend, nr.attend_reply_bytes(n, h), layers, req.direct)
        if req.mode == "fetch":
            if n * 4 > g.req_bytes or n * nr.D_QK * 2 + 16 > g.rep_bytes:
                raise ValueError(f"fetch of {n} rows does not fit the ring")

            def fetch(rq: torch.Tensor, rp: torch.Tensor, layer: int) -> None:
                rows = rq[: n * 4].view(torch.int32)
                pages, status = nr.fetch_reply_views(rp, n)
                pool = self.pool.latent[req.layer + layer]
                torch.index_select(pool, 0, rows.clamp(0, n_rows - 1), out=pages)
                nr.store(status, bad(rows.view(1, n)).to(torch.int32).view(1))

            return Plan(key, fetch, n * nr.D_QK * 2 + 4, layers, req.direct)
        raise ValueError(f"mode must be attend, fetch or echo, got {req.mode!r}")

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
            return cache[plan.key]
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
                graphs = self._graphs(r, plan, stream) if plan.body is not None else {}
                for seq in range(first, first + count):
                    if len(done) >= 2 * depth:  # keep the host a bounded distance ahead
                        done.pop(0).synchronize()
                    slot = seq % depth
                    job.wait_ge(job.req_sig[r - 1 : r], seq, s)
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record(stream)
                    if graphs:
                        graphs[(slot, seq % plan.layers)].replay()
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
                log.info("stream of requester %d: %s", r, self.stream_stats[-1])
        except Exception:
            log.exception("NVSHMEM stream of requester %d failed at enqueue", r)
