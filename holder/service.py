"""The Holder gRPC servicer: receive → validate → admit → compute → reply.

Wire types stop here: requests are decoded to tensors (``corpusd.wire``), validated, and every
failure becomes a gRPC status with a one-line message; a bad request never reaches the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from corpusd.corpus.store import PageStore, StoreError
from corpusd.rpc import Reject
from corpusd.rpc import wire as _wire
from corpusd.v1 import holder_pb2, holder_pb2_grpc
from corpusd.wire import from_proto, to_proto
from holder.admission import Admission, Overloaded
from holder.config import HolderConfig
from holder.kernels import Kernel
from holder.metrics import HolderMetrics, k_bucket, rows_bucket
from holder.pool import FramePool, PoolFull, RowError, rows_outside
from holder.staging import StagingPool
from holder.state import AssignmentLog
from indexer import ARITHS, index_scores, select_topk

log = logging.getLogger("corpusd.holder")
T = TypeVar("T")
_FLOATS = (torch.float32, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def rpc(
    method: str, sized: bool = True
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Count the call by status, and turn Reject / unexpected errors into gRPC statuses.
    ``sized``: count the messages' bytes here (``ByteSize`` serialises the message, a copy of
    its payload: methods with tensor payloads count their tensors' bytes themselves)."""

    def deco(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(
            self: HolderService, request: Any, context: grpc.aio.ServicerContext
        ) -> Any:
            if sized:
                self.metrics.bytes_in.labels(method).inc(request.ByteSize())
            count = self.metrics.requests.labels
            # Counted before the status goes out, so a client that sees it can also scrape it.
            try:
                reply = await fn(self, request, context)
            except Reject as e:
                log.info("%s rejected: %s: %s", method, e.code.name, e)
                count(method, e.code.name).inc()
                await context.abort(e.code, str(e))
            except Overloaded as e:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                count(method, code.name).inc()
                await context.abort(code, f"holder overloaded: {e}")
            except Exception as e:
                if isinstance(e, grpc.aio.AbortError):
                    raise
                code = grpc.StatusCode.INTERNAL
                log.exception("%s failed", method)
                count(method, code.name).inc()
                await context.abort(code, f"internal error in {method}: {type(e).__name__}: {e}")
            if sized:
                self.metrics.bytes_out.labels(method).inc(reply.ByteSize())
            count(method, "OK").inc()
            return reply

        return wrapper

    return deco


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
        self.log = AssignmentLog(cfg.state_dir)
        self.admission = Admission(cfg.max_flows, cfg.max_queue, cfg.queue_timeout_s)
        self.executor = ThreadPoolExecutor(cfg.max_flows, thread_name_prefix="flow")
        self._mutate = asyncio.Lock()
        self._inflight: dict[str, int] = {}
        # corpus → (pool rows, positions) of its held tokens; dropped whenever its pages change
        self._rows_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.staging = (
            StagingPool(cfg.staging_streams, pool.geo.device)
            if pool.geo.device.startswith("cuda")
            else None
        )
        metrics.capacity.set(pool.geo.frames)
        metrics.kernel.labels(kernel.name, cfg.device).set(1)

    # -- helpers ---------------------------------------------------------------------------------
    def _held(self, corpus_id: str) -> None:
        if self.pool.held(corpus_id) is None:
            raise Reject(
                grpc.StatusCode.NOT_FOUND, f"corpus {corpus_id!r} is not held by this holder"
            )

    def _tensor(
        self,
        msg: Any,
        name: str,
        dtypes: tuple[torch.dtype, ...],
        rank: int,
        finite: bool = False,
        copy: bool = True,
    ) -> torch.Tensor:
        """Decode one request tensor; a malformed one is INVALID_ARGUMENT naming the field.
        ``copy=False``: a read-only view of the request's bytes."""
        return _wire(
            lambda: from_proto(
                msg,
                name,
                dtypes=dtypes,
                rank=rank,
                finite=finite,
                max_bytes=self.cfg.max_message_bytes,
                copy=copy,
            )
        )

    def _layer(self, layer: int) -> None:
        if layer >= self.pool.geo.n_layers:
            raise Reject(
                grpc.StatusCode.OUT_OF_RANGE,
                f"layer {layer} out of range: the model has layers 0..{self.pool.geo.n_layers - 1}",
            )

    async def _run(self, corpus_id: str, fn: Callable[[], T]) -> tuple[T, float, float]:
        """Run ``fn`` in a flow slot on the executor; returns (result, queued s, compute s)."""
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

    def _update_resident(self) -> None:
        self.metrics.pages.set(self.pool.used_frames)
        self.metrics.resident_bytes.set(self.pool.used_frames * self.pool.geo.bytes_per_frame)

    # -- route -------------------------------------------------------------------------------------
    @rpc("Attend", sized=False)
    async def Attend(
        self, request: holder_pb2.AttendRequest, context: Any
    ) -> holder_pb2.AttendResponse:
        t0 = time.perf_counter()
        geo, cfg = self.pool.geo, self.cfg
        self._held(request.corpus_id)
        self._layer(request.layer)
        # A GPU holder checks q's values and the rows on the device, beside the kernel, and
        # reads the payload in place (it only copies it to the device); a CPU holder checks here.
        gpu = self.staging is not None
        q = self._tensor(request.q, "q", _FLOATS, 3, finite=not gpu, copy=not gpu)
        rows = self._tensor(request.rows, "rows", _INTS, 2, copy=not gpu)
        n, h, d = q.shape
        if d != geo.kv_dim or not 0 < h <= 128 or n > cfg.max_rows:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"q must be [n ≤ {cfg.max_rows}, 1 ≤ h ≤ 128, {geo.kv_dim}], got {list(q.shape)}",
            )
        if rows.shape[0] != n or rows.shape[1] > cfg.max_k:
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rows must be [{n}, k ≤ {cfg.max_k}], got {list(rows.shape)}",
            )
        if not (request.scale > 0 and request.scale < float("inf")):
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"scale must be finite and > 0, got {request.scale}",
            )
        if not gpu:
            self._check_rows(request.corpus_id, rows)
        kernel = self.kernel.resolve(n, h)
        args = (kernel, q, rows, request.corpus_id, request.layer, request.scale)
        compute = functools.partial(self._partial_gpu if gpu else self._partial_cpu, *args)
        t1 = time.perf_counter()
        (o, lse, bad), waited, secs = await self._run(request.corpus_id, compute)
        t2 = time.perf_counter()
        if bad is not None and bool(bad.any()):
            if bool(bad[0]):
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, "q: contains NaN or infinite values")
            self._check_rows(request.corpus_id, rows)  # raises with the first bad row named
            raise AssertionError("the device found bad rows that check_rows accepts")
        self.metrics.partial.labels(rows_bucket(n), k_bucket(rows.shape[1])).observe(secs)
        reply = holder_pb2.AttendResponse(
            o=to_proto(o.to(q.dtype)),
            lse=to_proto(lse.float()),
            kernel=kernel.name,
            compute_us=secs * 1e6,
        )
        t3 = time.perf_counter()
        stage = self.metrics.attend_stage.labels
        stage("decode").observe(t1 - t0)
        stage("queue").observe(waited)
        stage("compute").observe(secs)
        stage("encode").observe(t3 - t2)
        elt = q.element_size()
        self.metrics.bytes_in.labels("Attend").inc(q.numel() * elt + rows.numel() * 4)
        self.metrics.bytes_out.labels("Attend").inc(o.numel() * elt + lse.numel() * 4)
        return reply

    def _check_rows(self, corpus_id: str, rows: torch.Tensor) -> None:
        try:
            self.pool.check_rows(corpus_id, rows)
        except RowError as e:
            raise Reject(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None

    def _partial_cpu(
        self, kernel: Kernel, q: torch.Tensor, rows: torch.Tensor, corpus: str, layer: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
        pool = self.pool.latent[layer]
        o, lse = kernel.fn(q.to(pool.dtype), pool, rows.to(torch.int64), scale, pool.shape[1] - 64)
        return o, lse, None

    def _partial_gpu(
        self, kernel: Kernel, q: torch.Tensor, rows: torch.Tensor, corpus: str, layer: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Copy in, check, compute and copy out on one staging stream, with one host sync:
        ``(O, LSE)`` in pinned host memory and ``bad [2]`` (q not finite, rows not the
        corpus's). The kernel never reads outside the pool, so bad rows cost a wasted kernel,
        never a wrong read."""
        assert self.staging is not None
        pool = self.pool.latent[layer]
        dev = pool.device
        with torch.cuda.device(dev):  # flows run on executor threads
            stream = self.staging.stream()
            with torch.cuda.stream(stream):
                qd = q.to(dev, non_blocking=True)
                rd = rows.to(dev, non_blocking=True)
                wrong = rows_outside(self.pool.row_mask(corpus, dev), rd)
                bad = torch.stack((~torch.isfinite(qd).all(), wrong))
                o, lse = kernel.fn(qd.to(pool.dtype), pool, rd, scale, pool.shape[1] - 64)
                host = (
                    torch.empty(o.shape, dtype=o.dtype, pin_memory=True),
                    torch.empty(lse.shape, dtype=lse.dtype, pin_memory=True),
                    torch.empty(2, dtype=torch.bool, pin_memory=True),
                )
                for src, dst in zip((o, lse, bad), host, strict=True):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
        return host

    # -- move the cache ----------------------------------------------------------------------------
    def _frames_of(self, corpus_id: str, pages: list[int]) -> list[int]:
        held = self.pool.held(corpus_id)
        assert held is not None
        bad = [p for p in pages if p not in held.pages]
        if bad:
            code = (
                grpc.StatusCode.OUT_OF_RANGE
                if max(bad) >= held.n_pages
                else grpc.StatusCode.NOT_FOUND
            )
            raise Reject(
                code,
                f"pages {bad[:4]} of corpus {corpus_id} are not held here "
                f"(it has pages 0..{held.n_pages - 1}; held: {len(held.pages)})",
            )
        return [held.pages[p] for p in pages]

    @rpc("Fetch")
    async def Fetch(
        self, request: holder_pb2.FetchRequest, context: Any
    ) -> holder_pb2.FetchResponse:
        self._held(request.corpus_id)
        layers = list(request.layers) or list(range(self.pool.geo.n_layers))
        for layer in layers:
            self._layer(layer)
        frames = self._frames_of(request.corpus_id, list(request.pages))
        p = self.pool.geo.page_size
        rows = torch.tensor([f * p + s for f in frames for s in range(p)], dtype=torch.int64)

        def gather() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            lat = [self.pool.latent[i][rows].view(len(frames), p, -1) for i in layers]
            idx = (
                [self.pool.index_keys[i][rows].view(len(frames), p, -1) for i in layers]
                if request.index_keys
                else []
            )
            return lat, idx

        (lat, idx), _, _ = await self._run(request.corpus_id, gather)
        return holder_pb2.FetchResponse(
            latent=[to_proto(t) for t in lat], index_keys=[to_proto(t) for t in idx]
        )

    # -- indexer -----------------------------------------------------------------------------------
    def _corpus_rows(self, corpus_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows and corpus positions of every valid token held here, in position order."""
        cached = self._rows_cache.get(corpus_id)
        if cached is not None:
            return cached
        held = self.pool.held(corpus_id)
        assert held is not None
        p = self.pool.geo.page_size
        pages = sorted(held.pages)
        pos = torch.cat([torch.arange(pg * p, min((pg + 1) * p, held.token_count)) for pg in pages])
        frames = torch.tensor([held.pages[pg] for pg in pages]).repeat_interleave(
            torch.tensor([min(p, held.token_count - pg * p) for pg in pages])
        )
        self._rows_cache[corpus_id] = (frames * p + pos % p, pos)
        return self._rows_cache[corpus_id]

    @rpc("IndexTopK")
    async def IndexTopK(
        self, request: holder_pb2.IndexTopKRequest, context: Any
    ) -> holder_pb2.IndexTopKResponse:
        geo, cfg = self.pool.geo, self.cfg
        self._held(request.corpus_id)
        self._layer(request.layer)
        q = self._tensor(request.q, "q", _FLOATS, 3, finite=True)
        w = self._tensor(request.weights, "weights", _FLOATS, 2, finite=True)
        limit = self._tensor(request.limit, "limit", _INTS, 1)
        n = q.shape[0]
        if (
            q.shape[2] != geo.index_dim
            or n > cfg.max_rows
            or tuple(w.shape) != tuple(q.shape[:2])
            or tuple(limit.shape) != (n,)
            or not 0 < request.k <= cfg.max_k
            or request.arith not in ("", *ARITHS)
        ):
            raise Reject(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"need q [n, H_I, {geo.index_dim}], weights [n, H_I], limit [n], 0 < k ≤ "
                f"{cfg.max_k}, arith in {ARITHS}; got q {list(q.shape)}, weights {list(w.shape)}, "
                f"limit {list(limit.shape)}, k {request.k}, arith {request.arith!r}",
            )
        rows, pos = self._corpus_rows(request.corpus_id)
        keys = self.pool.index_keys[request.layer]

        arith = request.arith or "exact"

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            scores = index_scores(q, w, keys[rows], geo.index_dim**-0.5, arith)
            scores = scores.masked_fill(pos[None, :] >= limit[:, None], float("-inf"))
            cols = select_topk(scores, int(request.k))
            picked = torch.where(cols >= 0, pos[cols.clamp(min=0)], -1)
            vals = torch.where(cols >= 0, scores.gather(1, cols.clamp(min=0)), float("-inf"))
            return picked, vals

        (picked, vals), _, _ = await self._run(request.corpus_id, compute)
        return holder_pb2.IndexTopKResponse(positions=to_proto(picked), scores=to_proto(vals))

    async def IndexKeys(
        self, request: holder_pb2.IndexKeysRequest, context: Any
    ) -> AsyncIterator[holder_pb2.IndexKeysChunk]:
        code = grpc.StatusCode.OK
        try:
            self._held(request.corpus_id)
            self._layer(request.layer)
            held = self.pool.held(request.corpus_id)
            assert held is not None
            pages = sorted(held.pages)
            p = self.pool.geo.page_size
            keys = self.pool.index_keys[request.layer]
            for i in range(0, len(pages), 256):
                chunk = pages[i : i + 256]
                rows = torch.tensor([held.pages[pg] * p + s for pg in chunk for s in range(p)])
                msg = holder_pb2.IndexKeysChunk(
                    pages=chunk, keys=to_proto(keys[rows].view(len(chunk), p, -1))
                )
                self.metrics.bytes_out.labels("IndexKeys").inc(msg.ByteSize())
                yield msg
        except Reject as e:
            code = e.code
            await context.abort(e.code, str(e))
        finally:
            self.metrics.requests.labels("IndexKeys", code.name).inc()

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
        self, corpus_id: str, pages: list[int], wanted: dict[int, int] | None = None
    ) -> dict[int, int]:
        """Load ``pages`` (all when empty) of a pinned corpus into frames; returns page → frame for
        the requested pages. Idempotent. All-or-nothing: on failure no frame stays taken."""
        try:
            m = self.store.manifest(corpus_id)
        except StoreError as e:
            raise Reject(grpc.StatusCode.NOT_FOUND, str(e)) from None
        geo = self.pool.geo
        mismatch = [
            f"{k} {a} vs {b}"
            for k, a, b in (
                ("layers", m.n_layers, geo.n_layers),
                ("page_size", m.page_size, geo.page_size),
                ("kv_dim", m.kv_dim, geo.kv_dim),
                ("index_dim", m.index_dim, geo.index_dim),
                ("dtype", m.dtype, str(geo.dtype).removeprefix("torch.")),
            )
            if a != b
        ]
        if m.model_fingerprint != self.fingerprint:
            mismatch.append("model fingerprint differs")
        if mismatch:
            raise Reject(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"corpus {corpus_id} does not fit this holder: {', '.join(mismatch)}",
            )
        pages = pages or list(range(m.n_pages))
        bad = [p for p in pages if p >= m.n_pages]
        if bad:
            raise Reject(
                grpc.StatusCode.OUT_OF_RANGE,
                f"corpus {corpus_id} has pages 0..{m.n_pages - 1}, asked for {bad[:4]}",
            )
        held = self.pool.add_corpus(corpus_id, m.token_count, m.n_pages)
        new = sorted(set(pages) - set(held.pages))
        if new:
            try:
                frames = self.pool.take_frames(
                    len(new), [wanted[p] for p in new] if wanted else None
                )
            except PoolFull as e:
                self.pool.drop_if_empty(corpus_id)
                raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, f"holder is full: {e}") from None
            try:
                per_layer = [self.store.read_pages(corpus_id, i, new) for i in range(m.n_layers)]
                for j, (page, frame) in enumerate(zip(new, frames, strict=True)):
                    lat = [pl[0][j] for pl in per_layer]
                    keys = [pl[1][j] for pl in per_layer]
                    self.pool.fill(corpus_id, page, frame, lat, keys)
            except BaseException:
                for page in new:
                    held.pages.pop(page, None)
                self.pool.return_frames(frames)
                self.pool.drop_if_empty(corpus_id)
                raise
            self._rows_cache.pop(corpus_id, None)
            self._persist()
        self._update_resident()
        return {p: held.pages[p] for p in pages}

    @rpc("Release")
    async def Release(
        self, request: holder_pb2.ReleaseRequest, context: Any
    ) -> holder_pb2.ReleaseResponse:
        async with self._mutate:
            self._held(request.corpus_id)
            while self._inflight.get(request.corpus_id, 0):  # let running flows finish reading
                await asyncio.sleep(0.001)
            freed = self.pool.release(request.corpus_id, list(request.pages))
            self._rows_cache.pop(request.corpus_id, None)
            self._persist()
            self._update_resident()
        return holder_pb2.ReleaseResponse(freed=freed)

    def _persist(self) -> None:
        self.log.save({cid: dict(h.pages) for cid, h in self.pool.corpora.items()})

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

    def restore(self) -> int:
        """Reload every assignment of the log into the same frames (at start-up)."""
        n = 0
        for cid, pages in self.log.load().items():
            try:
                self.assign(cid, sorted(pages), wanted=pages)
                n += len(pages)
            except Reject as e:
                log.error("could not restore corpus %s: %s", cid, e)
        return n
