"""``corpusd.rpc.Rpc``, the one decorator of every servicer's methods: what it counts, answers
and logs, for unary calls and server streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from corpusd.rpc import Reject, Rpc

S = grpc.StatusCode


@dataclass
class Msg:
    """A request or reply: what the decorator reads of a protobuf message is ``ByteSize``."""

    what: str = ""

    def ByteSize(self) -> int:
        return len(self.what)


class Busy(Exception):
    pass


class Context:
    """What the decorator uses of a ``grpc.aio.ServicerContext``: ``abort`` raises."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] = (S.OK, "")

    async def abort(self, code: grpc.StatusCode, detail: str) -> None:
        self.aborted = (code, detail)
        raise grpc.aio.AbortError()


def _busy(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    return (S.RESOURCE_EXHAUSTED, f"busy: {e}") if isinstance(e, Busy) else None


rpc = Rpc(
    logging.getLogger("test.rpc"),
    requests=lambda s: s.requests,
    status=_busy,
    sizes=lambda s: (s.bytes_in, s.bytes_out),
    quiet=frozenset({S.RESOURCE_EXHAUSTED}),
)


class Servicer:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.requests = Counter("requests", "", ["method", "code"], registry=r)
        self.bytes_in = Counter("bytes_in", "", ["method"], registry=r)
        self.bytes_out = Counter("bytes_out", "", ["method"], registry=r)

    def count(self, method: str, code: str = "") -> float:
        c = self.requests.labels(method, code) if code else self.bytes_in.labels(method)
        return float(c._value.get())

    @rpc("Unary")
    async def Unary(self, request: Msg, context: Any) -> Msg:
        if request.what == "reject":
            raise Reject(S.NOT_FOUND, "no such thing")
        if request.what == "busy":
            raise Busy("3 queued")
        if request.what == "bug":
            raise KeyError("oops")
        if request.what == "abort":
            await context.abort(S.ABORTED, "by hand")
        return Msg("reply")

    @rpc("Unsized", sized=False)
    async def Unsized(self, request: Msg, context: Any) -> Msg:
        return Msg("reply")

    @rpc("Stream")
    async def Stream(self, request: Msg, context: Any) -> AsyncIterator[int]:
        for i in range(3):
            if request.what == "reject" and i == 1:
                raise Reject(S.OUT_OF_RANGE, "page 1")
            yield i


def _call(ctx: Context, call: Awaitable[Any]) -> tuple[Any, grpc.StatusCode, str]:
    async def go() -> tuple[Any, grpc.StatusCode, str]:
        try:
            return await call, S.OK, ""
        except grpc.aio.AbortError:
            return None, *ctx.aborted

    return asyncio.run(go())


def test_unary_calls_are_counted_answered_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    svc, ctx = Servicer(), Context()
    caplog.set_level(logging.INFO, "test.rpc")
    assert _call(ctx, svc.Unary(Msg("ok"), ctx)) == (Msg("reply"), S.OK, "")
    assert svc.count("Unary", "OK") == 1 and svc.bytes_out.labels("Unary")._value.get() == 5
    # A Reject: its code and message, counted, logged at info.
    assert _call(ctx, svc.Unary(Msg("reject"), ctx))[1:] == (S.NOT_FOUND, "no such thing")
    assert svc.count("Unary", "NOT_FOUND") == 1
    assert "Unary refused: NOT_FOUND: no such thing" in caplog.text
    # The service's own exception through its status hook; a quiet code is not logged.
    assert _call(ctx, svc.Unary(Msg("busy"), ctx))[1:] == (S.RESOURCE_EXHAUSTED, "busy: 3 queued")
    assert svc.count("Unary", "RESOURCE_EXHAUSTED") == 1 and "busy" not in caplog.text
    # Anything else: INTERNAL naming the method and the error, logged with its traceback.
    _, code, detail = _call(ctx, svc.Unary(Msg("bug"), ctx))
    assert (code, detail) == (S.INTERNAL, "internal error in Unary: KeyError: 'oops'")
    assert svc.count("Unary", "INTERNAL") == 1
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    # A method that aborted the call itself: passed through as it is, not counted.
    assert _call(ctx, svc.Unary(Msg("abort"), ctx))[1] == S.ABORTED
    assert svc.count("Unary", "ABORTED") == 0
    # Request bytes are counted for every call, reply bytes for answered ones; not when unsized.
    assert svc.count("Unary") == len("okrejectbusybugabort")
    assert svc.bytes_out.labels("Unary")._value.get() == 5
    assert _call(ctx, svc.Unsized(Msg("ok"), ctx))[1] == S.OK
    assert svc.count("Unsized", "OK") == 1 and svc.count("Unsized") == 0


def test_streams_are_counted_once_when_they_end() -> None:
    svc, ctx = Servicer(), Context()

    async def drain(request: Msg) -> list[int]:
        return [i async for i in svc.Stream(request, ctx)]

    assert _call(ctx, drain(Msg())) == ([0, 1, 2], S.OK, "")
    assert svc.count("Stream", "OK") == 1
    assert _call(ctx, drain(Msg("reject")))[1:] == (S.OUT_OF_RANGE, "page 1")
    assert svc.count("Stream", "OUT_OF_RANGE") == 1 and svc.count("Stream", "OK") == 1


def test_a_request_that_does_not_parse_gets_invalid_argument_not_unknown() -> None:
    """grpc answers UNKNOWN ("Unexpected DecodeError") to request bytes that do not parse; with
    ``DecodeGuard`` (every daemon's server has it) it is INVALID_ARGUMENT naming the method, and
    the servicer never sees the request. Good requests, streams and health pass as before."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    from corpusd.rpc import DecodeGuard
    from corpusd.v1 import holder_pb2, holder_pb2_grpc

    seen: list[Any] = []

    class Servicer(holder_pb2_grpc.HolderServicer):
        async def Info(self, request: Any, context: Any) -> Any:
            seen.append(request)
            return holder_pb2.InfoResponse(holder_id="h")

        async def IndexKeys(self, request: Any, context: Any) -> AsyncIterator[Any]:
            seen.append(request)
            yield holder_pb2.IndexKeysChunk(pages=[request.layer])

    async def go(guarded: bool) -> list[tuple[grpc.StatusCode, str]]:
        server = grpc.aio.server(interceptors=[DecodeGuard()] if guarded else [])
        holder_pb2_grpc.add_HolderServicer_to_server(Servicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            unary = ch.unary_unary("/corpusd.v1.Holder/Info")
            stream = ch.unary_stream("/corpusd.v1.Holder/IndexKeys")
            good = holder_pb2.IndexKeysRequest(corpus_id="c", layer=3).SerializeToString()
            for call in (
                unary(b"\xff\xff\xff"),  # a truncated varint
                _drain(stream(good[:-1])),  # cut inside the last field
                _drain(stream(b"\x0a\x02\xff\xfe")),  # corpus_id with invalid UTF-8
            ):
                try:
                    await call
                    out.append((S.OK, ""))
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details() or ""))
            assert holder_pb2.InfoResponse.FromString(await unary(b"")).holder_id == "h"
            assert await _drain(stream(good)) == 1
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        await server.stop(0)
        return out

    unguarded = asyncio.run(go(False))
    assert [c for c, _ in unguarded] == [S.UNKNOWN] * 3  # what grpc does by itself
    seen.clear()
    got = asyncio.run(go(True))
    assert [c for c, _ in got] == [S.INVALID_ARGUMENT] * 3, got
    assert "request is not a valid message for /corpusd.v1.Holder/Info" in got[0][1]
    assert "/corpusd.v1.Holder/IndexKeys" in got[1][1] and "UTF-8" in got[2][1], got
    assert len(seen) == 2  # only the two good calls reached the servicer


async def _drain(call: Any) -> int:
    return len([m async for m in call])
