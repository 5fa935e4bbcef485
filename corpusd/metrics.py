"""What every process's Prometheus metrics share: one registry per process role whose metrics
carry the role's prefix, and the latency buckets its histograms default to."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: seconds, 100 µs … 2.5 s: a partial, a layer step, a token
LATENCY_BUCKETS = (
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


class Metrics:
    """A role's registry (``self.registry``, what ``/metrics`` serves); each metric is declared
    by its name after ``prefix`` (e.g. ``corpusd_holder_``), help text and label names."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix

    def counter(self, name: str, text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, text, labels, registry=self.registry)

    def gauge(self, name: str, text: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, text, labels, registry=self.registry)

    def histogram(
        self,
        name: str,
        text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """``buckets``: upper bounds in the metric's unit (default: seconds of latency)."""
        return Histogram(self.prefix + name, text, labels, buckets=buckets, registry=self.registry)
