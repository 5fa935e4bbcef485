"""The holder's Prometheus metrics (one registry per process, served on ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
)


def rows_bucket(n: int) -> str:
    """Label for a row count: the power of two at or above it (1, 2, 4, … 1024, "more")."""
    b = 1
    while b < n and b < 1024:
        b *= 2
    return str(b) if n <= 1024 else "more"


def k_bucket(k: int) -> str:
    for b in (128, 256, 512, 1024, 2048, 4096):
        if k <= b:
            return str(b)
    return "more"


class HolderMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "corpusd_holder_"
        self.flows = Gauge(p + "flows_active", "Attend/Fetch executions running now", registry=r)
        self.queue = Gauge(p + "queue_depth", "requests waiting for a flow slot", registry=r)
        self.queue_wait = Histogram(
            p + "queue_wait_seconds",
            "time queued before a flow slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.partial = Histogram(
            p + "partial_seconds",
            "partial-attention compute time",
            ["rows", "k"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.attend_stage = Histogram(
            p + "attend_stage_seconds",
            "where an Attend's time goes: decode (wire → tensors, checks), queue (for a flow "
            "slot), compute (copies in, kernel, copies out), encode (tensors → wire)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter(p + "bytes_in", "request payload bytes", ["method"], registry=r)
        self.bytes_out = Counter(p + "bytes_out", "response payload bytes", ["method"], registry=r)
        self.pages = Gauge(p + "pages_resident", "pages held in the pool", registry=r)
        self.resident_bytes = Gauge(p + "bytes_resident", "bytes of the pool in use", registry=r)
        self.capacity = Gauge(p + "capacity_frames", "frames in the pool", registry=r)
        self.requests = Counter(
            p + "requests", "requests by method and status", ["method", "code"], registry=r
        )
        self.transport = Gauge(
            p + "transport_info",
            "data-plane transports offered (1) to requesters: grpc, nvshmem",
            ["transport"],
            registry=r,
        )
        self.kernel = Gauge(
            p + "kernel_info", "partial-attention kernel in use", ["kernel", "device"], registry=r
        )
