"""The coordinator's Prometheus metrics: counters it bumps, and gauges read from state.db.

The gauges (holders live/expired, per-holder capacity/use/fan-in, corpora by state, queue depth)
are computed at scrape time from their own read-only SQLite connection, so they can never
disagree with what the coordinator answers (WAL lets it read while the server writes).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corpusd.coordinator.db import HolderRow
from corpusd.metrics import Metrics

_P = "corpusd_coordinator_"


class _StateCollector(Collector):
    def __init__(self, db: Path) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            holders = [HolderRow(*r) for r in conn.execute("SELECT * FROM holders")]
            states = dict(conn.execute("SELECT state, COUNT(*) FROM corpora GROUP BY state"))
            placed = dict(conn.execute("SELECT holder_id, COUNT(*) FROM pages GROUP BY holder_id"))
        finally:
            conn.close()
        now = time.time()
        live = GaugeMetricFamily(_P + "holders", "registered holders by lease", labels=["lease"])
        n_live = sum(h.live(now) for h in holders)
        live.add_metric(["live"], n_live)
        live.add_metric(["expired"], len(holders) - n_live)
        yield live
        corpora = GaugeMetricFamily(_P + "corpora", "corpora by state", labels=["state"])
        for s in ("queued", "pinning", "ready", "retired"):
            corpora.add_metric([s], states.get(s, 0))
        yield corpora
        yield GaugeMetricFamily(
            _P + "queue_depth", "pins waiting for room", states.get("queued", 0)
        )
        per = {
            "capacity_frames": ("frames in the holder's pool", lambda h: h.capacity_frames),
            "used_frames": (
                "frames in use (last heartbeat, or placed since)",
                lambda h: h.used_frames,
            ),
            "placed_frames": (
                "frames the page table gives it",
                lambda h: placed.get(h.holder_id, 0),
            ),
            "active_flows": ("fan-in at its last heartbeat", lambda h: h.active_flows),
        }
        for name, (text, value) in per.items():
            g = GaugeMetricFamily(_P + "holder_" + name, text, labels=["holder"])
            for h in holders:
                g.add_metric([h.holder_id], value(h))
            yield g


class CoordinatorMetrics(Metrics):
    def __init__(self, db: Path) -> None:
        super().__init__(_P)
        self.requests = self.counter(
            "requests", "requests by method and status", ["method", "code"]
        )
        self.pins = self.counter(
            "pins", "pin outcomes (placed, queued, failed, rejected)", ["outcome"]
        )
        self.publish_seconds = self.histogram(
            "publish_seconds",
            "time to assign a corpus's pages on its holders and commit the page table",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.reconciled = self.counter(
            "reconciled_pages",
            "pages fixed up on holders that (re)registered: orphans released, lost ones reloaded",
            ["action"],
        )
        self.registry.register(_StateCollector(db))
