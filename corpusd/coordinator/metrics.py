"""The coordinator's Prometheus metrics: counters it bumps, and gauges read from its state.

The gauges (holders live/expired, per-holder capacity/use/fan-in, corpora by state, queue depth,
whether it leads) are computed at scrape time by reading the state store on the coordinator's
event loop (the scrape runs on the metrics server's thread and waits for it), so they can never
disagree with what the coordinator answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corpusd.coordinator.db import HolderRow
from corpusd.metrics import Metrics

_P = "corpusd_coordinator_"


#: () → (holders, corpora by state, placed frames by holder, leading, holder → (elbow, fan-in)
#: as last reported): read at scrape time
Snapshot = Callable[
    [], tuple[list[HolderRow], dict[str, int], dict[str, int], bool, dict[str, tuple[int, int]]]
]


class _StateCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        holders, states, placed, leading, loads = self.snapshot()
        now = time.time()
        yield GaugeMetricFamily(
            _P + "leader",
            "1 while this coordinator leads (places and publishes), else 0",
            int(leading),
        )
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
        per["elbow_flows"] = (
            "its fan-in elbow, as it reports it (0: not reported)",
            lambda h: loads.get(h.holder_id, (0, 0))[0],
        )
        per["fanin"] = (
            "flows running + queued, time-averaged over the interval its last heartbeat closed",
            lambda h: loads.get(h.holder_id, (0, 0))[1],
        )
        for name, (text, value) in per.items():
            g = GaugeMetricFamily(_P + "holder_" + name, text, labels=["holder"])
            for h in holders:
                g.add_metric([h.holder_id], value(h))
            yield g


class CoordinatorMetrics(Metrics):
    def __init__(self) -> None:
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
        self.leader_changes = self.counter(
            "leader_changes", "times this coordinator became leader (etcd election)"
        )
        self.replicas = self.counter(
            "load_replicas",
            "replicas of a hot holder's pages added or removed by the leader (fan-in past the "
            "elbow, then back under it)",
            ["action"],
        )

    def watch_state(self, snapshot: Snapshot) -> None:
        """Serve the state's gauges from ``snapshot`` (called once, when the state is open)."""
        self.registry.register(_StateCollector(snapshot))
