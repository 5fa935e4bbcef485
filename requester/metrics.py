"""The requester's Prometheus metrics: steps, fan-out, and the predicate's decisions with their
predicted and measured cost (so a user can see when the cost model is wrong)."""

from __future__ import annotations

from corpusd.metrics import REQUEST_BUCKETS, Metrics


class RequesterMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__("corpusd_requester_")
        self.step = self.histogram(
            "step_seconds", "one forward step of a batch", buckets=REQUEST_BUCKETS
        )
        self.rows = self.counter("rows", "query rows stepped (tokens of all sessions)")
        self.kernel = self.kernel_info()  # where this process attends corpus rows itself
        self.fanout = self.histogram(
            "fanout_holders", "holders one layer step sends to", buckets=(0, 1, 2, 3, 4, 8, 16, 32)
        )
        self.decisions = self.counter(
            "decisions", "primitive chosen per holder group", ["primitive", "forced"]
        )
        self.predicted = self.histogram(
            "predicted_seconds",
            "predicted cost of the chosen primitive",
            ["primitive"],
            buckets=REQUEST_BUCKETS,
        )
        self.measured = self.histogram(
            "measured_seconds",
            "measured cost of the chosen primitive",
            ["primitive"],
            buckets=REQUEST_BUCKETS,
        )
        self.misprediction = self.gauge(
            "last_measured_over_predicted",
            "measured / predicted cost of the last decision",
            ["primitive"],
        )
        self.ratio_median = self.gauge(
            "measured_over_predicted_median",
            "median measured / predicted cost over the last closed window of decisions",
            ["primitive"],
        )
        self.drift = self.counter(
            "calibration_drift_windows",
            "windows whose measured/predicted median fell outside [1/2, 2] (a warning each)",
            ["primitive"],
        )
        self.fetched_bytes = self.counter("fetched_bytes", "corpus page bytes pulled")
        self.prefilled = self.counter("reprefilled_tokens", "corpus tokens re-prefilled")
        self.sessions = self.gauge("sessions", "open sessions")
        self.session_rows = self.gauge(
            "session_kv_rows", "cache rows the open sessions hold (prompts and answers)"
        )
        self.sessions_closed = self.counter(
            "sessions_closed",
            "sessions ended, by why: close (CloseSession or the HTTP request's end), idle "
            "(--session-idle-s), client_gone (its Generate stream was cancelled or its client "
            "died mid-stream), unpinned",
            ["reason"],
        )
        self.sessions_refused = self.counter(
            "sessions_refused",
            "OpenSession refused RESOURCE_EXHAUSTED, by limit: max_sessions or kv_capacity",
            ["limit"],
        )
        self.prompts_refused = self.counter(
            "prompts_refused",
            "OpenSession refused INVALID_ARGUMENT for what its prompt holds, by reason: "
            "repeats_corpus (the corpus's head, so the corpus would be attended twice)",
            ["reason"],
        )
        self.errors = self.counter("errors", "failed holder calls by gRPC status", ["kind"])
        self.transport = self.gauge(
            "transport_info",
            "how routes to each holder travel (1: in use): grpc or nvshmem",
            ["holder", "transport"],
        )
        self.rereads = self.counter(
            "table_rereads",
            "periodic re-reads of a bound corpus's page table: unchanged, changed (a new view, "
            "adopted at the next step), revived (a holder that failed over REVIVE_S ago holds a "
            "live lease: used again from the next step) or failed",
            ["result"],
        )
        self.rebalances = self.counter(
            "replica_rebalances",
            "views re-spread over a corpus's replicas by the holders' measured speeds",
        )
        self.replica_weight = self.gauge(
            "replica_weight",
            "a holder's measured speed (rows/s, mean 1 over the holders of a view), by which "
            "replicated pages are spread",
            ["holder"],
        )
        self.slow_calls = self.counter(
            "slow_calls",
            "holder calls past the holder deadline whose holder answered a health check (busy, "
            "not stopped): waited for, not failed over",
            ["primitive"],
        )
        self.fallbacks = self.counter(
            "fallbacks", "groups recomputed another way after a failure", ["from", "to"]
        )
        # the agent API (corpusd agent)
        self.snapshot_binds = self.counter(
            "snapshot_binds",
            "corpora bound from the agent's coordinator snapshot while the coordinator was "
            "unavailable (bind_snapshot.py)",
        )
        self.batch = self.histogram(
            "batch_sessions",
            "sessions stepped together (continuous batching)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.generating = self.gauge("generating", "Generate streams in flight")
        self.ttft = self.histogram(
            "time_to_first_token_seconds",
            "Generate call to its first token (queueing and prompt prefill included)",
            buckets=REQUEST_BUCKETS,
        )
        self.inter_token = self.histogram(
            "inter_token_seconds",
            "between consecutive tokens of one Generate stream",
            buckets=REQUEST_BUCKETS,
        )
        self.requests = self.counter(
            "requests", "agent API calls by method and status", ["method", "code"]
        )

    def decided(self, pick: str, forced: bool, layer: int, holder: str) -> None:
        """Count one holder group's decision (``forced``: not the predicate's own pick); the
        layer and holder are for a subclass that breaks decisions down by them."""
        self.decisions.labels(pick, "yes" if forced else "no").inc()
