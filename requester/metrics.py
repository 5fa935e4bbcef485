"""The requester's Prometheus metrics: steps, fan-out, and the predicate's decisions with their
predicted and measured cost (so a user can see when the cost model is wrong)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from holder.metrics import _LATENCY_BUCKETS


class RequesterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "corpusd_requester_"
        self.step = Histogram(
            p + "step_seconds", "one forward step of a batch", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.rows = Counter(p + "rows", "query rows stepped (tokens of all sessions)", registry=r)
        self.fanout = Histogram(
            p + "fanout_holders",
            "holders one layer step sends to",
            buckets=(0, 1, 2, 3, 4, 8, 16, 32),
            registry=r,
        )
        self.decisions = Counter(
            p + "decisions",
            "primitive chosen per holder group",
            ["primitive", "forced"],
            registry=r,
        )
        self.predicted = Histogram(
            p + "predicted_seconds",
            "predicted cost of the chosen primitive",
            ["primitive"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.measured = Histogram(
            p + "measured_seconds",
            "measured cost of the chosen primitive",
            ["primitive"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.misprediction = Gauge(
            p + "last_measured_over_predicted",
            "measured / predicted cost of the last decision",
            ["primitive"],
            registry=r,
        )
        self.fetched_bytes = Counter(p + "fetched_bytes", "corpus page bytes pulled", registry=r)
        self.prefilled = Counter(p + "reprefilled_tokens", "corpus tokens re-prefilled", registry=r)
        self.sessions = Gauge(p + "sessions", "open sessions", registry=r)
        self.errors = Counter(
            p + "errors", "failed holder calls by gRPC status", ["kind"], registry=r
        )
        self.transport = Gauge(
            p + "transport_info",
            "how routes to each holder travel (1: in use): grpc or nvshmem",
            ["holder", "transport"],
            registry=r,
        )
        self.fallbacks = Counter(
            p + "fallbacks",
            "groups recomputed another way after a failure",
            ["from", "to"],
            registry=r,
        )
        # the agent API (corpusd agent)
        self.batch = Histogram(
            p + "batch_sessions",
            "sessions stepped together (continuous batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.generating = Gauge(p + "generating", "Generate streams in flight", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Generate call to its first token (queueing and prompt prefill included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            p + "inter_token_seconds",
            "between consecutive tokens of one Generate stream",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            p + "requests", "agent API calls by method and status", ["method", "code"], registry=r
        )
