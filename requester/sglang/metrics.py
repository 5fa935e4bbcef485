"""The plugin's Prometheus metrics, served from the SGLang process that runs the model.

The requester's names (:class:`requester.metrics.RequesterMetrics`) where they mean the same:
``corpusd_requester_decisions_total{primitive, forced}``, ``…_predicted_seconds``,
``…_measured_seconds``, ``…_last_measured_over_predicted``, ``…_measured_over_predicted_median``
(a closed window of :class:`requester.drift.Drift`), ``…_calibration_drift_windows_total``,
``…_fetched_bytes_total``, ``…_errors_total``, ``…_fallbacks_total``, ``…_table_rereads_total``
(host path: the link's page-table re-reads, :mod:`.follow`). Added for the plugin: the
decisions per layer and holder, and the fetch page cache.

``CORPUSD_SGLANG_METRICS_PORT`` starts one HTTP server per process (:func:`serve`); a port in use
is a warning, not a failed start (SGLang's TP ranks are separate processes: the first one
serves).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from corpusd import env
from requester.metrics import RequesterMetrics

log = logging.getLogger("corpusd.sglang")
ENV_PORT = "CORPUSD_SGLANG_METRICS_PORT"
ENV_PROFILE_SLOW = "CORPUSD_SGLANG_PROFILE_SLOW"


class PluginMetrics(RequesterMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.group_decisions = self.counter(
            "sglang_group_decisions",
            "SGLang plugin: primitive chosen per layer and holder group",
            ["primitive", "layer", "holder"],
        )
        self.cache_lookups = self.counter(
            "sglang_page_cache_lookups", "SGLang plugin: fetch page cache lookups", ["result"]
        )
        self.cache_evictions = self.counter(
            "sglang_page_cache_evictions", "SGLang plugin: fetch page cache pages evicted"
        )
        self.cache_pages = self.gauge(
            "sglang_page_cache_pages", "SGLang plugin: pages resident in the fetch page cache"
        )
        self.holder_transport = self.gauge(
            "sglang_holder_transport",
            "SGLang plugin, device path: 1 per holder mapped, labelled with how it is reached "
            "(cuda_ipc: on this GPU; cuda_p2p: another GPU's pool read over peer access)",
            ["holder", "transport"],
        )
        self.failed_holders = self.counter(
            "sglang_failed_holders",
            "SGLang plugin, device path: mapped holders found dead and failed over",
            ["holder"],
        )
        self.refused = self.counter(
            "sglang_requests_refused",
            "SGLang plugin: bound requests refused at admission (HTTP 400), by reason: binding "
            "(unknown, not ready, other model, too long), repeats_corpus (the prompt holds its "
            "corpus's head), error (the coordinator unreachable, say)",
            ["reason"],
        )
        self.failover_pages = self.counter(
            "sglang_failover_pages",
            "SGLang plugin, device path: corpus pages moved off a dead holder, to a live replica "
            "or kept on its still-mapped pool",
            ["to"],
        )

    def decided(self, pick: str, forced: bool, layer: int, holder: str) -> None:
        super().decided(pick, forced, layer, holder)
        self.group_decisions.labels(pick, str(layer), holder).inc()

    def cache_stats(self, before: Mapping[str, int], after: Mapping[str, int]) -> None:
        """Advance the cache counters by what happened between two ``PageCache.stats()``."""
        self.cache_lookups.labels("hit").inc(after["hits"] - before["hits"])
        self.cache_lookups.labels("miss").inc(after["misses"] - before["misses"])
        self.cache_evictions.inc(after["evictions"] - before["evictions"])
        self.cache_pages.set(after["resident"])


def metrics_port(environ: Mapping[str, str] | None = None) -> int | None:
    """``CORPUSD_SGLANG_METRICS_PORT``: None when unset or empty. Raises ValueError naming the
    variable for anything but a port number."""
    port: int | None = env.get(ENV_PORT, environ)
    return port


_SERVED: dict[int, bool] = {}


def serve(metrics: PluginMetrics, port: int, addr: str = "127.0.0.1") -> bool:
    """Serve ``metrics`` on ``addr:port`` (once per process and port). Returns whether this
    call's server runs; a port in use logs a warning and returns False."""
    from prometheus_client import start_http_server

    if port in _SERVED:
        return _SERVED[port]
    try:
        start_http_server(port, addr=addr, registry=metrics.registry)
        _SERVED[port] = True
        log.info("corpusd plugin: metrics on http://%s:%d/metrics", addr, port)
    except OSError as e:
        _SERVED[port] = False
        log.warning(
            "corpusd plugin: %s=%d: cannot serve metrics (%s); another process (a second TP "
            "rank?) may have the port; serving on without them", ENV_PORT, port, e,
        )  # fmt: skip
    return _SERVED[port]


#: The line a slow bound prefill logs (tokens, requests, host s, GPU ms, wall ms);
#: ``tools/diag_route_ttft.py`` parses it.
SLOW_PREFILL_LOG = (
    "corpusd plugin: a bound prefill of %d tokens (%d requests) held the host %.2f s, "
    "GPU %.1f ms, %.1f ms until done"
)


def slow_prefill_s(value: str | None) -> float | None:
    """``CORPUSD_SGLANG_PROFILE_SLOW``'s threshold in seconds from its text: unset → None (no
    profiling), a positive number → that, anything else (``1``, ``yes``) → 1 s."""
    seconds: float | None = env.VARS[ENV_PROFILE_SLOW].value(value)
    return seconds


def log_triton_compiles() -> bool:
    """Log every Triton kernel compiled in this process from now on, with its specialisation
    (module, kernel, argument types and value classes: Triton compiles a kernel again for an
    integer argument that is 1 or a multiple of 16, and for every new constexpr). A diagnosis
    aid (``CORPUSD_SGLANG_PROFILE_SLOW``); chains a hook already there. True when installed."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4: no hook to chain
        return False
    before = knobs.runtime.jit_cache_hook

    def hook(*args: Any, **kw: Any) -> Any:
        fn = kw.get("fn")
        log.warning(
            "corpusd plugin: Triton compiles %s.%s: %s",
            getattr(fn, "module", "?"), getattr(fn, "name", "?"), kw.get("repr", ""),
        )  # fmt: skip
        return before(*args, **kw) if before else None

    knobs.runtime.jit_cache_hook = hook
    return True


class Timings:
    """Where the plugin's time goes, logged every ``every_s`` seconds as mean ms per call of each
    stage (the SGLang log is where a user looks; SGLang's own metrics time the whole step).

    A stage is host seconds (:meth:`add`) or GPU time between two CUDA events (:meth:`add_gpu`),
    read at a flush once its end event is done (``query``); one still running waits for the next
    flush, so a flush never makes the host wait for the GPU."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._since = time.monotonic()
        self._sums: dict[str, list[float]] = {}
        self._events: list[tuple[str, Any, Any]] = []

    def add(self, stage: str, seconds: float) -> None:
        acc = self._sums.setdefault(stage, [0.0, 0.0])
        acc[0] += seconds
        acc[1] += 1
        if time.monotonic() - self._since >= self.every_s:
            self.flush()

    def add_gpu(self, stage: str, start: Any, end: Any) -> None:
        """GPU time from ``start`` to ``end`` (recorded ``torch.cuda.Event(enable_timing=True)``
        pairs), resolved at the next flush."""
        self._events.append((stage, start, end))
        if time.monotonic() - self._since >= self.every_s:
            self.flush()

    def flush(self) -> None:
        events, self._events = self._events, []
        for stage, start, end in events:
            if not end.query():  # still running: the next flush reads it
                self._events.append((stage, start, end))
                continue
            acc = self._sums.setdefault(stage, [0.0, 0.0])
            acc[0] += start.elapsed_time(end) / 1e3
            acc[1] += 1
        if self._sums:
            parts = [f"{k} {1e3 * s / n:.2f} ms × {n:.0f}" for k, (s, n) in self._sums.items()]
            log.info("corpusd plugin, per call: %s", ", ".join(parts))
        self._sums, self._since = {}, time.monotonic()
