"""``corpusd serve``: the coordinator process (Coordinator service, health, metrics).

Start-up: open ``state.db``, roll back pins a previous run left half-done, then serve. A
background loop retries queued pins whenever capacity frees (and every ``retry_s``). SIGTERM /
SIGINT drain like a holder: health NOT_SERVING, running RPCs get ``drain_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.config import CoordinatorConfig
from corpusd.coordinator.db import State
from corpusd.coordinator.links import Links
from corpusd.coordinator.metrics import CoordinatorMetrics
from corpusd.coordinator.publish import Publisher
from corpusd.coordinator.service import CoordinatorService
from corpusd.coordinator.upkeep import recover
from corpusd.corpus.store import PageStore
from corpusd.daemon import check_ports, listen, write_endpoint
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


async def serve(cfg: CoordinatorConfig) -> None:
    state_dir = Path(cfg.state_dir)
    buckets = CpBuckets.load(cfg.profile)
    state = State(state_dir / "state.db")
    metrics = CoordinatorMetrics(state.path)
    links = Links(cfg.rpc_timeout_s)
    pub = Publisher(state, links, buckets, metrics, cfg.max_queue)
    rolled_back = await recover(pub)
    svc = CoordinatorService(pub, PageStore(cfg.store), cfg.lease_s)

    up = await listen(
        lambda srv: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(svc, srv),
        SERVICE,
        cfg.host,
        cfg.port,
        cfg.metrics_port,
        metrics.registry,
    )
    metrics_port = up.metrics_port
    address = f"{cfg.host}:{up.port}"
    write_endpoint(
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

    retry = asyncio.create_task(_retry_queue(pub, cfg.retry_s))
    await up.until_signal("coordinator", cfg.drain_s, [retry])
    await links.close()
    state.close()
    log.info("coordinator stopped")


def run(cfg: CoordinatorConfig) -> None:
    check_ports(cfg.host, {"--port": cfg.port, "--metrics-port": cfg.metrics_port})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        uvloop.run(serve(cfg))
    except ImportError:  # uvloop is not built for every platform; asyncio's loop serves too
        asyncio.run(serve(cfg))
