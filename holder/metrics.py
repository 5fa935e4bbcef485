"""The holder's Prometheus metrics (one registry per process, served on ``--metrics-port``)."""

from __future__ import annotations

from corpusd.metrics import LATENCY_BUCKETS, Metrics


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


class HolderMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__("corpusd_holder_")
        self.flows = self.gauge("flows_active", "Attend/Fetch executions running now")
        self.queue = self.gauge("queue_depth", "requests waiting for a flow slot")
        self.queue_wait = self.histogram(
            "queue_wait_seconds",
            "time queued before a flow slot",
            buckets=(*LATENCY_BUCKETS, 30, 60),  # none on an idle GPU; tens of s past the elbow
        )
        self.partial = self.histogram(
            "partial_seconds", "partial-attention compute time", ["rows", "k"]
        )
        self.attend_stage = self.histogram(
            "attend_stage_seconds",
            "where an Attend's time goes: decode (wire → tensors, checks), queue (for a flow "
            "slot), compute (copies in, kernel, copies out), encode (tensors → wire)",
            ["stage"],
        )
        self.bytes_in = self.counter("bytes_in", "request payload bytes", ["method"])
        self.bytes_out = self.counter("bytes_out", "response payload bytes", ["method"])
        self.pages = self.gauge("pages_resident", "pages held in the pool")
        self.resident_bytes = self.gauge("bytes_resident", "bytes of the pool in use")
        self.capacity = self.gauge("capacity_frames", "frames in the pool")
        self.elbow = self.gauge(
            "elbow_flows",
            "its fan-in elbow: the admission cap on concurrent flows (--max-flows, the largest "
            "fan-in whose latency stays within 1.5x of one flow, from corpusd calibrate)",
        )
        self.corrupt = self.counter(
            "corrupt",
            "stored data refused on load because it failed its digest (what=page: pages) or "
            "could not be read (what=file: files), on Assign or on restore at start-up",
            ["when", "what"],
        )
        self.requests = self.counter(
            "requests", "requests by method and status", ["method", "code"]
        )
        self.transport = self.gauge(
            "transport_info",
            "data-plane transports offered (1) to requesters: grpc, nvshmem",
            ["transport"],
        )
        self.kernel = self.kernel_info()
