"""How a worker's routed partials reach one holder: gRPC Attend, or the holder's NVSHMEM job.

``connect`` picks per holder through the transport registry (``corpusd.transport.choose``):
``auto`` takes NVSHMEM when this process has a GPU and nvshmem4py, is in no other NVSHMEM job,
and the holder offers a job it can reach (its Transport service answers a probe: same node, or
IBGDA configured); else gRPC. ``grpc`` / ``nvshmem`` force one (``nvshmem`` raises ValueError
where it cannot work). Both routes keep Attend's semantics: ``(O [n, h, d_v] in q's dtype,
LSE [n, h] float32, natural log)`` of the same kernel on the same request, so the same bits; and
the same failures: a refused or failed call raises ``corpusd.rpc.StatusError`` with the gRPC
status the holder's Attend would give (OUT_OF_RANGE for rows outside the corpus), which the
worker handles exactly like a failed gRPC call (failover).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from contextlib import nullcontext
from typing import Any

import grpc
import torch

from corpusd.rpc import StatusError
from corpusd.transport import TRANSPORTS, Peer, choose
from corpusd.transport import nvshmem_ring as nr
from requester.holder_client import HolderClient, Partial
from requester.nvshmem_client import NvshmemClient, RemoteRowError

log = logging.getLogger("corpusd.requester")
JOIN_TIMEOUT_S = 120.0  # NVSHMEM init is collective: the holder inits once all its peers joined
_JOINED: dict[str, str] = {}  # this process's NVSHMEM job (one per process): job id → holder


class NvshmemRoute:
    """Attend over the holder's NVSHMEM ring: q and rows go to this process's GPU, one stream of
    one request per call (the holder runs it eagerly; a shape it saw before replays a graph), the
    reply comes back to the host in q's dtype. Calls to one holder are serialised (one ring). A
    timeout or a failed stream marks the route broken: later calls go over gRPC."""

    name = "nvshmem"

    def __init__(self, client: NvshmemClient, grpc_route: HolderClient, address: str) -> None:
        self.client, self.grpc, self.address = client, grpc_route, address
        self.lock = asyncio.Lock()
        self.broken = ""

    async def attend_rows(
        self,
        corpus_id: str,
        layer: int,
        q: torch.Tensor,
        rows: torch.Tensor,
        scale: float,
        timeout: float | None = None,
    ) -> Partial:
        n, h, _ = q.shape
        k = rows.shape[1]
        step = self._rows_per_request(h, k)
        if self.broken or step == 0:
            return await self.grpc.attend_rows(corpus_id, layer, q, rows, scale, timeout)
        deadline = time.monotonic() + (timeout or 60.0)
        job = self.client.job
        assert job is not None
        t0 = time.perf_counter()
        guard = torch.cuda.device(job.device) if job.device.type == "cuda" else nullcontext()
        async with self.lock:
            with guard:
                qd = q.to(job.device, torch.bfloat16)
                idx = rows.to(job.device, torch.int32)
                outs = []
                for a in range(0, n, step):
                    b = min(n, a + step)
                    try:
                        await self.client.open_stream(
                            "attend", 1, b - a, h, k, corpus_id, layer, 1, scale
                        )
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            self._break(f"OpenStream: {e.details()}")
                        raise StatusError(e.code(), e.details() or "") from None
                    pending = self.client.attend(qd[a:b], idx[a:b])
                    try:
                        await self._wait(pending.done, deadline)
                    except asyncio.CancelledError:  # the fan-out gave up on the holder
                        self._break("a call was cancelled with its reply outstanding")
                        raise
                    try:
                        pending.check()
                    except RemoteRowError as e:
                        raise StatusError(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None
                    o, lse = pending.views
                    outs.append((o.to(q.dtype).cpu(), lse.cpu()))
        o = torch.cat([x for x, _ in outs]) if len(outs) > 1 else outs[0][0]
        lse = torch.cat([x for _, x in outs]) if len(outs) > 1 else outs[0][1]
        # the holder's kernel is not named on the ring; compute_us is the round trip here
        return Partial(o, lse, "", (time.perf_counter() - t0) * 1e6)

    def _rows_per_request(self, h: int, k: int) -> int:
        """Most rows of ``h`` heads and ``k`` indices one ring slot holds (0: not even one)."""
        g = self.client.ring
        lo, hi = 0, 1 << 16
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = (
                nr.attend_request_bytes(mid, h, k) <= g.req_bytes
                and nr.attend_reply_bytes(mid, h) <= g.rep_bytes
            )
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    async def _wait(self, done: torch.cuda.Event, deadline: float) -> None:
        """Poll the reply's event without blocking the event loop, until ``deadline``."""
        delay = 0.0
        while not done.query():
            if time.monotonic() > deadline:
                self._break("no reply before the deadline")
                raise StatusError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no NVSHMEM reply from {self.address} before the deadline",
                )
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, 2e-5), 1e-3)

    def _break(self, why: str) -> None:
        # The ring's state is unknown now (a request may still be in flight): never reuse it.
        self.broken = why
        log.warning("NVSHMEM route to %s broken (%s); its calls go over gRPC", self.address, why)

    async def close(self) -> None:
        # Leaving the job is collective with the holder, which leaves only when it stops: the
        # job is abandoned instead, and the holder's own close gives up on this member.
        await self.client.close(leave=False)


#: How a worker's routed partials reach one holder: its :class:`HolderClient` (gRPC Attend) or
#: an :class:`NvshmemRoute`. Both answer ``attend_rows(corpus_id, layer, q [n, h, kv_dim],
#: rows [n, k] int32 pool rows (-1 unused), scale, timeout)`` with a :class:`Partial`, and raise
#: grpc.aio.AioRpcError or StatusError; ``name`` says which.
Route = HolderClient | NvshmemRoute


async def connect(
    address: str, holder: HolderClient, transport: str, device: int, requester_id: str
) -> Route:
    """The route to the holder at ``address`` that ``transport`` (auto | grpc | nvshmem) picks.
    Raises ValueError when ``nvshmem`` is forced and cannot work for this holder."""
    assert transport in TRANSPORTS, f"{transport=} not in {TRANSPORTS}"
    plain = holder  # a HolderClient is the gRPC route: its Attend
    if transport == "grpc":
        return plain
    here = nr.available()
    if not here or _JOINED:
        why = (
            f"this process is already in NVSHMEM job {next(iter(_JOINED))} (one per process)"
            if here
            else "no CUDA GPU or nvshmem4py here"
        )
        if transport == "nvshmem":
            raise ValueError(f"transport nvshmem to {address}: {why}")
        log.info("holder %s: transport grpc (%s)", address, why)
        return plain
    try:
        offer = await NvshmemClient.probe(holder.channel, timeout=10.0)
    except grpc.aio.AioRpcError as e:
        if transport == "nvshmem":
            raise ValueError(f"holder {address} offers no NVSHMEM job: {e.details()}") from None
        log.info("holder %s: transport grpc (it offers no NVSHMEM job)", address)
        return plain
    peer = Peer(nvshmem_job=offer.job_id, same_node=offer.host == socket.gethostname())
    chosen = choose(transport, peer)  # raises ValueError when a forced nvshmem cannot work
    if chosen.name != "nvshmem":
        log.info("holder %s: transport grpc (job %s on %s not reachable)", address,
                 offer.job_id, offer.host)  # fmt: skip
        return plain
    # Stays set even when the join fails: a half-done NVSHMEM init cannot be retried here.
    _JOINED[offer.job_id] = address
    try:
        client = await asyncio.wait_for(
            NvshmemClient.join(address, requester_id, device), JOIN_TIMEOUT_S
        )
    except (grpc.aio.AioRpcError, TimeoutError) as e:
        why = e.details() if isinstance(e, grpc.aio.AioRpcError) else "timed out"
        if transport == "nvshmem":
            raise ValueError(f"could not join the NVSHMEM job of {address}: {why}") from None
        log.warning("holder %s: transport grpc (joining its NVSHMEM job failed: %s)", address, why)
        return plain
    log.info("holder %s: transport nvshmem (job %s, rank %d, %s)", address, client.job_id,
             client.rank, "same node" if peer.same_node else "across nodes")  # fmt: skip
    return NvshmemRoute(client, plain, address)


def requester_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Connections:
    """A process's connections to holders: one :class:`HolderClient` and one :class:`Route` per
    holder address, the route's transport chosen once by ``transport`` (auto | grpc | nvshmem)
    and exported on ``transport_info`` (a gauge labelled holder, transport). Create and use it
    inside one running event loop."""

    def __init__(self, transport: str, nvshmem_device: int, transport_info: Any) -> None:
        assert transport in TRANSPORTS, f"{transport=} not in {TRANSPORTS}"
        self.transport, self.nvshmem_device = transport, nvshmem_device
        self.transport_info = transport_info
        self.clients: dict[str, HolderClient] = {}
        self.routes: dict[str, Route] = {}  # holder address → how its routes travel
        self._connecting: dict[str, asyncio.Lock] = {}

    def client(self, address: str) -> HolderClient:
        if address not in self.clients:
            self.clients[address] = HolderClient(address)
        return self.clients[address]

    async def route(self, address: str) -> Route:
        """The holder's route transport (chosen once, logged and exported as
        ``corpusd_requester_transport_info{holder,transport}``). Raises ValueError when a forced
        transport cannot work for it."""
        if address in self.routes:
            return self.routes[address]
        async with self._connecting.setdefault(address, asyncio.Lock()):
            if address not in self.routes:
                r = await connect(
                    address,
                    self.client(address),
                    self.transport,
                    self.nvshmem_device,
                    f"{requester_id()}:{id(self):x}",
                )
                self.routes[address] = r
                for name in TRANSPORTS[1:]:
                    self.transport_info.labels(address, name).set(int(name == r.name))
        return self.routes[address]

    async def close(self) -> None:
        for address, r in self.routes.items():
            if r is not self.clients.get(address):  # a gRPC route is the client itself
                await r.close()
        for c in self.clients.values():
            await c.close()
