"""The requester's end of a holder's NVSHMEM job: join over gRPC, then Attend / Fetch over the
symmetric ring, stream-ordered (see ``corpusd.transport.nvshmem_ring``).

Usage: ``c = await NvshmemClient.join(address, requester_id)`` (collective with the holder's
init), ``first = await c.open_stream(mode=..., count=N, ...)`` announces N requests of one shape,
then ``c.attend(q, idx)`` N times, each returning a :class:`Pending` whose ``result()`` waits for
the reply. ``attend`` only enqueues on ``c.stream``; the caller may overlap its own work.

Where ``q`` and ``idx`` live in fixed buffers (a decode loop's static inputs), ``c.graphed(q,
idx)`` captures the whole request (store, signal, wait, status) as one CUDA graph per ring slot:
a request then costs the host one replay instead of five or six launches.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from corpusd import security
from corpusd.transport import nvshmem_ring as nr
from corpusd.v1 import transport_pb2, transport_pb2_grpc

_ABANDONED: list[Any] = []


class RemoteRowError(ValueError):
    """The holder's device-side check found rows outside the named corpus."""


def _check(status: torch.Tensor, what: str) -> None:
    """Raise RemoteRowError when the reply's status word (host copy) says rows were rejected."""
    code = int(status[0])
    if code != 0:
        raise RemoteRowError(f"{what}: holder rejected rows (status {code})")


@dataclass(slots=True)
class Pending:
    stream: torch.cuda.Stream
    views: tuple[torch.Tensor, ...]
    status: torch.Tensor  # pinned host int32 [1], filled on the stream
    what: str
    done: torch.cuda.Event = field(default_factory=torch.cuda.Event)

    def check(self) -> None:
        """Raise RemoteRowError when the holder rejected the rows (after the reply is in)."""
        _check(self.status, self.what)

    def result(self, copy: bool = False) -> tuple[torch.Tensor, ...]:
        """Wait for the reply; raises RemoteRowError when the holder rejected the rows. Views
        point into the ring slot, valid until ``depth`` later requests: ``copy=True`` clones."""
        self.done.synchronize()
        self.check()
        return tuple(v.clone() for v in self.views) if copy else self.views

    def wait_on(self, stream: torch.cuda.Stream) -> tuple[torch.Tensor, ...]:
        """Make ``stream`` wait for the reply (no host sync); call ``check()`` once the host
        synchronizes with that stream anyway."""
        stream.wait_event(self.done)
        return self.views


@dataclass(slots=True)
class DeferredPending:
    """A :class:`GraphedAttend` reply whose wait was left out of the send's graph: the caller's
    stream waits for the reply signal itself (:meth:`wait_on`), so nothing on the client's
    stream sits in front of the caller's own work while the holder computes."""

    job: nr.Job
    sent: torch.cuda.Event  # the send's graph (its signal reset included) is done
    rep_sig: torch.Tensor
    views: tuple[torch.Tensor, ...]
    reply_status: torch.Tensor  # the slot's status word (device)
    status: torch.Tensor  # pinned host int32 [1]
    what: str
    awaited: bool = False  # wait_on was called: the next send may reset the reply signal

    def wait_on(self, stream: torch.cuda.Stream) -> tuple[torch.Tensor, ...]:
        """Enqueue on ``stream``: the wait for the reply signal (after the send's reset), then
        the status word's copy out; no host sync. ``check()`` once the host synchronizes."""
        self.awaited = True
        stream.wait_event(self.sent)
        self.job.wait_ge(self.rep_sig, 1, stream.cuda_stream)
        with torch.cuda.stream(stream):
            self.status.copy_(self.reply_status, non_blocking=True)
        return self.views

    def check(self) -> None:
        _check(self.status, self.what)

    def result(self, copy: bool = False) -> tuple[torch.Tensor, ...]:
        stream = torch.cuda.current_stream(self.views[0].device)
        self.wait_on(stream)
        stream.synchronize()
        self.check()
        return tuple(v.clone() for v in self.views) if copy else self.views


class GraphedAttend:
    """``attend(q, idx)`` of fixed ``q`` / ``idx`` tensors as one CUDA graph per ring slot.

    A replay stores the current contents of ``q`` and ``idx`` into the request slot, resets this
    requester's reply signal, signals the holder (SIGNAL_ADD 1: the holder waits for the
    request's sequence number, which counts requests either way), waits for the reply signal
    to be set (the holder sets it to the sequence number, ≥ 1) and copies the status word out.
    The reset precedes the send, so no reply of this request can be erased, whatever the
    earlier requests were. Each call consumes one request of the open attend stream.

    ``wait=False``: the graph ends at the signal; the call returns a :class:`DeferredPending`
    whose ``wait_on(stream)`` puts the reply wait on the caller's stream (after its own work),
    instead of on the client's stream inside the graph. Call ``wait_on`` (or ``result``) before
    the next call: the next send resets the reply signal once the caller's stream is past it."""

    def __init__(
        self, client: NvshmemClient, q: torch.Tensor, idx: torch.Tensor, wait: bool = True
    ) -> None:
        job, s = client.job, client.stream
        assert job is not None and s is not None and client._shape is not None
        assert client._shape[0] == "attend", "open an attend stream first"
        self.client, self.q, self.idx, self.wait = client, q, idx, wait
        self.last: DeferredPending | None = None  # wait=False: the reply not yet waited for
        me = client.rank - 1
        self.graphs: list[torch.cuda.CUDAGraph] = []
        s.wait_stream(torch.cuda.current_stream(q.device))
        for slot in range(client.ring.depth):
            (qv, iv), reply = client._views[slot]
            assert q.shape == qv.shape and idx.shape == iv.shape, (
                f"stream shapes {tuple(qv.shape)}, {tuple(iv.shape)}; got {tuple(q.shape)}, "
                f"{tuple(idx.shape)}"
            )
            _, n, h, k = client._shape
            nbytes = nr.attend_request_bytes(n, h, k)
            status = client._status[slot]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                cs = torch.cuda.current_stream(q.device).cuda_stream
                job.rep_sig[me : me + 1].zero_()
                nr.store(qv, q)
                nr.store(iv, idx)
                if client._direct:  # the stores above wrote the holder's slot
                    job.signal(job.req_sig[me : me + 1], 1, 0, cs, add=True)
                else:
                    job.put_signal(job.req[me, slot], nbytes, job.req_sig[me : me + 1], 1, 0, cs,
                                   add=True)  # fmt: skip
                if wait:
                    job.wait_ge(job.rep_sig[me : me + 1], 1, cs)
                    status.copy_(reply[-1], non_blocking=True)
            self.graphs.append(graph)

    def __call__(self) -> Pending | DeferredPending:
        if self.last is not None and not self.last.awaited:
            # its reply signal would be reset before any stream waited for it: a lost reply
            raise RuntimeError(
                f"{self.last.what}: its reply was never waited for; call wait_on (or result) "
                "on the previous call's DeferredPending before the next call"
            )
        c = self.client
        assert c.stream is not None and c.job is not None
        slot, _, _ = c._next("attend")
        c.stream.wait_stream(torch.cuda.current_stream(self.q.device))
        self.graphs[slot].replay()
        what = f"attend seq {c.seq}"
        if not self.wait:
            me = c.rank - 1
            sent = torch.cuda.Event()
            sent.record(c.stream)
            reply = c._views[slot][1]
            self.last = DeferredPending(c.job, sent, c.job.rep_sig[me : me + 1], reply[:-1],
                                        reply[-1], c._status[slot], what)  # fmt: skip
            return self.last
        p = Pending(c.stream, c._views[slot][1][:-1], c._status[slot], what)
        p.done.record(c.stream)
        return p


class NvshmemClient:
    def __init__(self, channel: grpc.aio.Channel, reply: transport_pb2.JoinResponse) -> None:
        self.channel = channel
        self.stub = transport_pb2_grpc.TransportStub(channel)
        self.rank, self.job_id = reply.rank, reply.job_id
        g = reply.ring
        self.ring = nr.RingGeometry(g.peers, g.depth, g.req_bytes, g.rep_bytes)
        self._uid, self._nranks = reply.uid, reply.nranks
        self.job: nr.Job | None = None
        self.stream: torch.cuda.Stream | None = None
        self.seq = 0
        self._shape: tuple[str, int, int, int] | None = None
        self._left = 0
        self._status = [torch.zeros(1, dtype=torch.int32).pin_memory() for _ in range(g.depth)]
        self._views: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        self.trace: list[torch.cuda.Event] | None = None
        self._peer_req: torch.Tensor | None = None
        self._direct = False  # a list: record stream timing events

    @staticmethod
    async def probe(channel: grpc.aio.Channel, timeout: float | None = None) -> Any:
        """The holder's NVSHMEM offer (``job_id``, ``host``, ``ring``) without taking a slot;
        raises grpc.aio.AioRpcError (UNIMPLEMENTED: the holder offers none)."""
        stub = transport_pb2_grpc.TransportStub(channel)
        return await stub.Join(
            transport_pb2.JoinRequest(host=socket.gethostname(), probe=True), timeout=timeout
        )

    @classmethod
    async def join(cls, address: str, requester_id: str, device: int) -> NvshmemClient:
        """Take a requester slot of the holder's job and initialise NVSHMEM with it (collective:
        returns once the holder and every other requester of the job initialised too)."""
        channel = security.channel(address)
        stub = transport_pb2_grpc.TransportStub(channel)
        reply = await stub.Join(
            transport_pb2.JoinRequest(requester_id=requester_id, host=socket.gethostname())
        )
        c = cls(channel, reply)
        loop = asyncio.get_running_loop()
        c.job = await loop.run_in_executor(
            None, lambda: nr.Job(c._uid, c.rank, c._nranks, device, c.ring)
        )
        c.stream = torch.cuda.Stream(c.job.device)
        return c

    async def open_stream(
        self,
        mode: str,
        count: int,
        rows: int,
        heads: int = 0,
        topk: int = 0,
        corpus_id: str = "",
        layer: int = 0,
        layers: int = 1,
        scale: float = 0.0,
        echo_bytes: int = 0,
        direct: bool | None = None,
        compacted: bool = False,
    ) -> int:
        """Announce ``count`` requests of one shape; returns the first one's sequence number.
        ``compacted``: attend requests' rows list their valid indices first (-1 after), so the
        holder runs the kernel that skips the -1 blocks (``registry.for_compacted``).
        ``direct`` (default: when the holder's ring maps here, i.e. same node): both ends write
        each other's slots through NVLink with SM stores and only signal, instead of staging
        into their own slot and put_signal-ing it (the copy-engine path, also across nodes)."""
        assert self.job is not None
        me = self.rank - 1
        if self._peer_req is None:
            self._peer_req = self.job.peer(self.job.req, 0)
        direct = (self._peer_req is not None) if direct is None else direct
        assert not direct or self._peer_req is not None, "direct needs the holder on this node"
        direct = direct and mode != "echo"  # the raw floor stays a put of the same bytes
        assert self._left == 0, f"{self._left} requests of the previous stream not sent yet"
        r = await self.stub.OpenStream(
            transport_pb2.OpenStreamRequest(
                rank=self.rank,
                mode=mode,
                corpus_id=corpus_id,
                layer=layer,
                layers=layers,
                rows=rows,
                heads=heads,
                topk=topk,
                scale=scale,
                count=count,
                echo_bytes=echo_bytes,
                direct=direct,
                compacted=compacted,
            )
        )
        assert r.first_seq == self.seq + 1, f"holder's sequence {r.first_seq} vs ours {self.seq}"
        self._shape, self._left = (mode, rows, heads, topk), count
        self._echo, self._direct = echo_bytes, direct
        slots = range(self.ring.depth)
        req, rep = self.job.req[me], self.job.rep[me]
        if direct:
            assert self._peer_req is not None
            req = self._peer_req[me]  # write the holder's inbox directly
        if mode == "attend":
            self._views = [
                (nr.attend_request_views(req[i], rows, heads, topk),
                 nr.attend_reply_views(rep[i], rows, heads))
                for i in slots
            ]  # fmt: skip
        elif mode == "fetch":
            self._views = [
                ((req[i][: rows * 4].view(torch.int32),), nr.fetch_reply_views(rep[i], rows))
                for i in slots
            ]
        else:
            self._views = [((), (rep[i][:echo_bytes],)) for i in slots]
        return int(r.first_seq)

    def _next(self, mode: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        assert self.job is not None and self._shape is not None and self._left > 0, (
            "open_stream first"
        )
        assert self._shape[0] == mode, f"stream is {self._shape[0]}, not {mode}"
        self._left -= 1
        self.seq += 1
        slot = self.seq % self.ring.depth
        r = self.rank - 1
        return slot, self.job.req[r, slot], self.job.rep[r, slot]

    def _send(self, slot: int, rq: torch.Tensor, nbytes: int, views: tuple, what: str) -> Pending:
        job, s = self.job, self.stream
        assert job is not None and s is not None
        r = self.rank - 1
        self._mark()
        if self._direct:  # the request is already in the holder's slot
            job.signal(job.req_sig[r : r + 1], self.seq, 0, s.cuda_stream)
        else:
            job.put_signal(rq, nbytes, job.req_sig[r : r + 1], self.seq, 0, s.cuda_stream)
        self._mark()
        job.wait_ge(job.rep_sig[r : r + 1], self.seq, s.cuda_stream)
        self._mark()
        status = self._status[slot]
        with torch.cuda.stream(s):
            if views and views[-1].dtype == torch.int32 and views[-1].numel() == 1:
                status.copy_(views[-1], non_blocking=True)
                views = views[:-1]
            else:
                status.zero_()
        self._mark()
        p = Pending(s, views, status, f"{what} seq {self.seq}")
        p.done.record(s)
        return p

    def attend(self, q: torch.Tensor, idx: torch.Tensor) -> Pending:
        """Route ``q [rows, heads, 576] bf16`` over pool rows ``idx [rows, topk]`` (-1 unused):
        the reply's ``(O [rows, heads, 512] bf16, LSE [rows, heads] f32 natural log)``."""
        slot, rq, _ = self._next("attend")
        (qv, iv), reply = self._views[slot]
        assert q.shape == qv.shape and idx.shape == iv.shape, (
            f"stream shapes {tuple(qv.shape)}, {tuple(iv.shape)}; got {tuple(q.shape)}, "
            f"{tuple(idx.shape)}"
        )
        assert self.stream is not None and self._shape is not None
        _, n, h, k = self._shape
        self.stream.wait_stream(torch.cuda.current_stream(q.device))
        self._mark()
        with torch.cuda.stream(self.stream):
            nr.store(qv, q)
            nr.store(iv, idx)
        return self._send(slot, rq, nr.attend_request_bytes(n, h, k), reply, "attend")

    def _mark(self) -> None:
        """Record a timing event on the stream when tracing (``self.trace = []``)."""
        if self.trace is not None and self.stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.trace.append(ev)

    def fetch(self, rows: torch.Tensor) -> Pending:
        """Pool rows ``rows [n]`` int32 → ``pages [n, 576]`` bf16 (the move-the-cache path)."""
        slot, rq, _ = self._next("fetch")
        (rv,), reply = self._views[slot]
        assert rows.shape == rv.shape, f"stream fetches {tuple(rv.shape)}, got {rows.shape}"
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(rows.device))
        with torch.cuda.stream(self.stream):
            nr.store(rv, rows)
        return self._send(slot, rq, rv.numel() * 4, reply, "fetch")

    def echo(self, nbytes: int) -> Pending:
        """Send ``nbytes`` of the request slot and get the holder's reply of ``echo_bytes`` with no
        work in between: the transport's raw round trip."""
        slot, rq, _ = self._next("echo")
        return self._send(slot, rq, nbytes, self._views[slot][1], "echo")

    def graphed(self, q: torch.Tensor, idx: torch.Tensor, wait: bool = True) -> GraphedAttend:
        """``attend(q, idx)`` as CUDA graph replays (see :class:`GraphedAttend`): ``q`` and ``idx``
        must keep their storage; each call sends their current contents. ``wait=False``: the
        reply is waited for on the stream given to ``wait_on``, not inside the graph."""
        return GraphedAttend(self, q, idx, wait)

    async def close(self, leave: bool = True, timeout_s: float | None = None) -> bool:
        """Close the control channel and, with ``leave``, the job: collective, so with the
        holder's own close (``timeout_s`` bounds the wait; False when it gave up). Without
        ``leave`` the job is abandoned: its memory stays mapped until this process exits."""
        done = True
        if leave and self.job is not None:
            job = self.job
            done = await asyncio.get_running_loop().run_in_executor(
                None, lambda: job.close(timeout_s)
            )
        else:
            _ABANDONED.append(self.job)  # never garbage-collected: freeing is collective
        await self.channel.close()
        return done
