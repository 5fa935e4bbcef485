"""What every process's Prometheus metrics share: one registry per process role whose metrics
carry the role's prefix, and the latency buckets its histograms default to."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: seconds, 25 µs … 10 s: one partial, one holder call, one layer's wait (a GPU partial is
#: ~65 µs; a CPU holder's 64-row partial ~270 ms; a large CPU batch takes seconds)
LATENCY_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                   0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # fmt: skip
#: seconds, 1 ms … 120 s: what a user waits for — a decode step, a token, a first token (GPU
#: inter-token ~5–50 ms; the tiny model on 2 CPU cores ~80 ms a token, 2–18 s to a first token)
REQUEST_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20,
                   30, 60, 120)  # fmt: skip


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

    def kernel_info(self) -> Gauge:
        """``kernel_info{kernel, device}`` = 1: the attention-partial kernel this process chose
        at start-up (``corpusd.kernels.registry.choose``, set by its ``report``)."""
        return self.gauge(
            "kernel_info",
            "attention-partial kernel chosen at start-up by capability (corpusd.kernels)",
            ["kernel", "device"],
        )

    def histogram(
        self,
        name: str,
        text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """``buckets``: upper bounds in the metric's unit (default: seconds of latency)."""
        return Histogram(self.prefix + name, text, labels, buckets=buckets, registry=self.registry)
