"""``corpusd serve``: the coordinator process (Coordinator service, health, metrics).

Start-up: open ``state.db``, roll back pins a previous run left half-done, then serve. A
background loop retries queued pins whenever capacity frees (and every ``retry_s``). SIGTERM /
SIGINT drain like a holder: health NOT_SERVING, running RPCs get ``drain_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import start_http_server

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.config import CoordinatorConfig
from corpusd.coordinator.db import State
from corpusd.coordinator.links import Links
from corpusd.coordinator.metrics import CoordinatorMetrics
from corpusd.coordinator.publish import Publisher
from corpusd.coordinator.service import CoordinatorService
from corpusd.coordinator.upkeep import recover
from corpusd.corpus.store import PageStore
from corpusd.v1 import coordinator_pb2_grpc

log = logging.getLogger("corpusd.coordinator")
SERVICE = "corpusd.v1.Coordinator"


async def _retry_queue(pub: Publisher, every_s: float) -> None:
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(pub.capacity_changed.wait(), every_s)
        pub.capacity_changed.clear()
        if pub.state.queued():
            try:
                await pub.drain()
            except Exception:  # the loop must outlive one bad drain; the pin stays queued
                log.exception("retrying queued pins failed")


def _write_endpoint(state_dir: Path, endpoint: dict[str, object]) -> None:
    tmp = state_dir / "endpoint.json.tmp"
    tmp.write_text(json.dumps(endpoint))
    os.replace(tmp, state_dir / "endpoint.json")


async def serve(cfg: CoordinatorConfig) -> None:
    state_dir = Path(cfg.state_dir)
    buckets = CpBuckets.load(cfg.profile)
    state = State(state_dir / "state.db")
    metrics = CoordinatorMetrics(state.path)
    links = Links(cfg.rpc_timeout_s)
    pub = Publisher(state, links, buckets, metrics, cfg.max_queue)
    rolled_back = await recover(pub)
    svc = CoordinatorService(pub, PageStore(cfg.store), cfg.lease_s)

    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(svc, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    metrics_port = -1
    if cfg.metrics_port >= 0:
        httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
        metrics_port = httpd.server_address[1]
    for name in (SERVICE, ""):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{cfg.host}:{port}"
    _write_endpoint(
        state_dir, {"address": address, "metrics_port": metrics_port, "pid": os.getpid()}
    )
    log.info(
        "coordinator serving on %s (store %s, %d holders and %d corpora known, %d half-done "
        "pins rolled back, CP buckets %s); metrics on :%d",
        address,
        cfg.store,
        len(state.holders()),
        len(state.corpora()),
        rolled_back,
        list(buckets.bounds),
        metrics_port,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    retry = asyncio.create_task(_retry_queue(pub, cfg.retry_s))
    await stop.wait()
    log.info("coordinator draining (up to %.1f s)", cfg.drain_s)
    await health.enter_graceful_shutdown()
    await server.stop(cfg.drain_s)
    retry.cancel()
    await links.close()
    state.close()
    log.info("coordinator stopped")


def run(cfg: CoordinatorConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        uvloop.run(serve(cfg))
    except ImportError:  # uvloop is not built for every platform; asyncio's loop serves too
        asyncio.run(serve(cfg))
