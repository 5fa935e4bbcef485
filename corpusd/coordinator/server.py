"""``corpusd serve``: the coordinator process (Coordinator service, health, metrics).

Start-up: open the state (``--state``: SQLite in the state directory by default, or etcd),
roll back pins a previous run left half-done, then serve. On etcd several coordinators may run:
each serves reads at once, and the one the election makes leader rolls back what a previous
leader left half-done before it takes writes (election.py). A background loop on the leader
retries queued pins whenever capacity frees (and every ``retry_s``). SIGTERM / SIGINT drain
like a holder: health NOT_SERVING, running RPCs get ``drain_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from corpusd.coordinator.buckets import CpBuckets
from corpusd.coordinator.config import CoordinatorConfig
from corpusd.coordinator.db import open_state
from corpusd.coordinator.election import EtcdElection, Leadership
from corpusd.coordinator.links import Links
from corpusd.coordinator.metrics import CoordinatorMetrics
from corpusd.coordinator.publish import Publisher
from corpusd.coordinator.replicas import Replicator
from corpusd.coordinator.service import CoordinatorService
from corpusd.coordinator.upkeep import recover
from corpusd.corpus.store import PageStore
from corpusd.daemon import claim, listen, write_endpoint
from corpusd.v1 import coordinator_pb2_grpc

log = logging.getLogger("corpusd.coordinator")
SERVICE = "corpusd.v1.Coordinator"


async def _retry_queue(pub: Publisher, lead: Leadership, every_s: float) -> None:
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(pub.capacity_changed.wait(), every_s)
        pub.capacity_changed.clear()
        if not lead.leading:
            continue
        try:
            waiting = await pub.state.queued()
        except Exception:  # the state store may be electing; try again next round
            log.exception("reading the queue failed")
            continue
        if waiting:
            try:
                await pub.drain()
            except Exception:  # the loop must outlive one bad drain; the pin stays queued
                log.exception("retrying queued pins failed")


async def _follow_load(pub: Publisher, lead: Leadership, replicator: Replicator) -> None:
    """On the leader: add and remove load replicas as the holders' reports say (replicas.py)."""
    every = max(0.25, replicator.window_s / 8)
    while True:
        await asyncio.sleep(every)
        if not lead.leading:
            continue
        try:
            await replicator.step(pub)
        except Exception:  # the loop must outlive one bad round; the next one decides again
            log.exception("load replicas: a round failed")


async def serve(cfg: CoordinatorConfig) -> None:
    state_dir = Path(cfg.state_dir)
    buckets = CpBuckets.load(cfg.profile)
    state = open_state(cfg.state, state_dir)
    metrics = CoordinatorMetrics()
    links = Links(cfg.rpc_timeout_s)
    pub = Publisher(state, links, buckets, metrics, cfg.max_queue)
    lead: Leadership = Leadership()
    if cfg.state.startswith("etcd"):  # the etcd client is imported only then
        from corpusd.coordinator.etcd_state import EtcdState

        assert isinstance(state, EtcdState)
        await state.check()
        lead = EtcdElection(state, cfg.leader_lease_s or cfg.lease_s)
    loop = asyncio.get_running_loop()

    def snapshot() -> Any:  # on the metrics server's thread: read on the loop, wait for it
        async def read() -> Any:
            loads = {h: (r.elbow, r.fanin) for h, q in replicator.reports.items() for r in q}
            return (*await state.snapshot(), lead.leading, loads)

        return asyncio.run_coroutine_threadsafe(read(), loop).result(10)

    metrics.watch_state(snapshot)
    rolled_back = 0
    if not isinstance(lead, EtcdElection):  # the only coordinator: recover before serving
        rolled_back = await recover(pub)
    replicator = Replicator(cfg.replica_window_s, grace_s=cfg.grace_s)
    svc = CoordinatorService(pub, PageStore(cfg.store), cfg.lease_s, lead, replicator)

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
        "coordinator serving on %s (state %s, store %s, %d holders and %d corpora known, %d "
        "half-done pins rolled back, CP buckets %s); metrics on :%d",
        address,
        state.where,
        cfg.store,
        len(await state.holders()),
        len(await state.corpora()),
        rolled_back,
        list(buckets.bounds),
        metrics_port,
    )

    tasks = [asyncio.create_task(_retry_queue(pub, lead, cfg.retry_s))]
    if cfg.replica_window_s:
        tasks.append(asyncio.create_task(_follow_load(pub, lead, replicator)))
    if isinstance(lead, EtcdElection):
        lead.state.node = address  # what the leader key will say

        async def on_lead() -> None:
            n = await recover(pub)
            metrics.leader_changes.inc()
            log.info("leading: %d half-done pins rolled back", n)
            pub.capacity_changed.set()

        tasks.append(asyncio.create_task(lead.run(on_lead)))
    await up.until_signal("coordinator", cfg.drain_s, tasks)
    await asyncio.wait(tasks, timeout=2)  # the election gives its lead up (revokes its lease)
    await links.close()
    await state.close()
    log.info("coordinator stopped")


def ports(cfg: CoordinatorConfig) -> dict[str, int]:
    """The ports it binds, by flag (checked free before anything is written)."""
    return {"--port": cfg.port, "--metrics-port": cfg.metrics_port}


def run(cfg: CoordinatorConfig) -> None:
    claim(Path(cfg.state_dir), "coordinator", cfg.host, ports(cfg))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.run(serve(cfg))
    except ImportError:  # uvloop is not built for every platform; asyncio's loop serves too
        asyncio.run(serve(cfg))
