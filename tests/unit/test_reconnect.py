"""A corpusd channel reaches a daemon that comes back within its capped reconnect backoff.

gRPC's default backoff grows 1.6× a failed connect (1, 1.6, 2.6, 4.1 s …, up to 120 s) and a
channel in backoff fails every call at once: the soak's clients went on failing for seconds
after their daemon was back. Here a real server on loopback is down for 10.5 s while a client
calls every 0.1 s; after it is back, the first call that succeeds comes within the cap."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from corpusd import security

DOWN_S = 10.5  # the default backoff next connects ~15.9 s in (±1.4 s): 4 s late or more


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _late_by(options: list[tuple[str, int]]) -> float:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    ident = security.Identity()  # plaintext, no token: what a loopback test daemon serves
    ch = security.channel(address, options=options, ident=ident)
    stub = health_pb2_grpc.HealthStub(ch)
    t0 = time.monotonic()
    server: grpc.aio.Server | None = None
    up_at = None
    try:
        while True:
            if server is None and time.monotonic() - t0 >= DOWN_S:
                server = grpc.aio.server()
                health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
                server.add_insecure_port(address)
                await server.start()
                up_at = time.monotonic()
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                assert up_at is not None, "answered while no server listened"
                return time.monotonic() - up_at
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
            assert time.monotonic() - t0 < DOWN_S + 60
    finally:
        await ch.close()
        if server is not None:
            await server.stop(None)


def test_a_daemon_back_after_an_outage_is_reached_within_the_capped_backoff() -> None:
    late = asyncio.run(_late_by([]))
    cap = security.RECONNECT_BACKOFF_MS / 1000
    assert late <= cap * 1.2 + 0.5, f"reached {late:.2f} s after the server came back"


def test_a_slow_link_still_connects() -> None:
    """The cap must not shorten a connection attempt: gRPC takes its connect timeout from
    ``grpc.min_reconnect_backoff_ms`` (20 s by default). Set to 250 ms, every TLS handshake
    over a link delayed 0.4 s a chunk failed ("Handshake read failed (Endpoint closing)":
    7 sessions in the 60-minute soak, each during net_delay:agent)."""
    from corpusd.testing.tcp_proxy import Proxy

    async def go() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = Proxy(f"127.0.0.1:{port}")
        proxy.set("delay", delay_s=0.4)
        ch = security.channel(proxy.address, ident=security.Identity())
        try:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=20)
        finally:
            proxy.set("pass")
            await ch.close()
            await server.stop(None)

    asyncio.run(go())
