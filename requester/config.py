"""The requester's configuration: ``WorkerConfig`` (the decode worker and its fan-out) and
``AgentConfig`` (``corpusd agent``); the agent's flags derive from both."""

from __future__ import annotations

from dataclasses import dataclass, field

from corpusd import env
from corpusd.daemon_config import DaemonConfig, non_negative, positive
from corpusd.transport import TRANSPORTS
from requester.predicate import PRIMITIVES

INDEXER_MODES = ("replica", "distributed")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    indexer: str = field(
        default="replica",
        metadata={
            "help": "corpus index keys held here (replica) or top-k on holders",
            "choices": INDEXER_MODES,
        },
    )
    primitive: str = field(
        default="auto",
        metadata={
            "help": "force route/fetch/local, or let the predicate pick",
            "choices": ("auto", *PRIMITIVES),
        },
    )
    fetch_cache_bytes: int = field(default=1 << 30, metadata={"help": "fetched-page cache"})
    rpc_timeout_s: float = field(
        default=60.0, metadata={"help": "per holder call, at most (a holder's first call too)"}
    )
    holder_deadline_s: float = field(
        default=1.0,
        metadata={
            "help": "a decode step's call to a holder that has answered that shape before "
            "(route or fetch) waits this long per 256 query rows, at least this long; past it, "
            "a holder that does not answer a health check within 0.5 s counts as failed and "
            "its rows fail over (replica, page store, local), so a stopped holder stalls its "
            "sessions about this long plus 0.5 s"
        },
    )
    profile: str = field(
        default="",
        metadata={
            "help": "calibration profile JSON (default: $CORPUSD_HOME/profile.json if present)"
        },
    )
    transport: str = field(
        default="auto",
        metadata={
            "help": "routes to a holder: nvshmem when both ends share an NVSHMEM job (auto), "
            "or force one",
            "choices": TRANSPORTS,
        },
    )
    nvshmem_device: int = field(
        default=0, metadata={"help": "the CUDA device this worker's NVSHMEM transport runs on"}
    )
    trace: bool = field(default=False, metadata={"help": "keep every decision in .trace"})

    def __post_init__(self) -> None:
        if self.indexer not in INDEXER_MODES:
            raise ValueError(f"indexer must be one of {INDEXER_MODES}, got {self.indexer!r}")
        if self.primitive not in ("auto", *PRIMITIVES):
            raise ValueError(f"primitive must be auto or one of {PRIMITIVES}")
        non_negative(self, "fetch_cache_bytes")
        positive(self, "rpc_timeout_s", "holder_deadline_s")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.transport == "nvshmem" and not _nvshmem_available():
            raise ValueError("transport nvshmem needs a CUDA GPU and nvshmem4py (.gpu-deps)")


@dataclass(frozen=True, slots=True)
class AgentConfig(DaemonConfig):
    """``corpusd agent``; the page store gives corpus tokens for local recompute."""

    ROLE = "agent"
    STATE_HOME = "agent"

    model: str = field(default="", metadata={"help": "model directory (default: the tiny model)"})
    http_port: int = field(
        default=-1,
        metadata={"help": "OpenAI-compatible HTTP API (/v1/...) port; 0: pick a free one, -1: off"},
    )
    http_client_cert: str = field(
        default="optional",
        metadata={
            "help": "the HTTP API over TLS: a client certificate is optional (verified when "
            "given; OpenAI clients send the token as their API key) or required",
            "choices": ("optional", "required"),
        },
    )
    worker_id: str = field(default="", metadata={"help": "name in the coordinator's registry"})
    coordinator: str = field(
        default="",
        metadata={"help": f"coordinator for page tables (default: {env.COORDINATOR_DEFAULT})"},
    )
    holders: str = field(
        default="",
        metadata={"help": "without a coordinator: comma-separated holder addresses to ask"},
    )
    max_prompt_tokens: int = field(default=8192, metadata={"help": "per OpenSession"})
    max_new_tokens: int = field(default=4096, metadata={"help": "per Generate"})
    default_max_tokens: int = field(
        default=64, metadata={"help": "when Generate gives none (capped by max_new_tokens)"}
    )
    max_sessions: int = field(default=1024, metadata={"help": "open sessions, at most"})
    session_idle_s: float = field(
        default=600.0,
        metadata={
            "help": "close a session no call has used for this long (seconds; a client that "
            "exits without CloseSession leaves one); 0: never"
        },
    )
    kv_capacity_tokens: int = field(
        default=1 << 20, metadata={"help": "sessions' own cache rows (prompts and answers)"}
    )
    max_batch: int = field(default=64, metadata={"help": "sessions stepped together, at most"})
    max_attend_rows: int = field(default=4096, metadata={"help": "query rows of one Attend"})
    report_s: float = field(
        default=2.0, metadata={"help": "how often load is reported to the coordinator"}
    )
    table_refresh_s: float = field(
        default=0.0,
        metadata={
            "help": "re-read each bound corpus's page table this often, so running sessions "
            "follow load replicas (adopted between steps); 0: the coordinator's lease / 3; "
            "-1: never (only on bind and failover)"
        },
    )
    threads: int = field(default=0, metadata={"help": "torch intra-op threads; 0: torch's"})

    def __post_init__(self) -> None:
        DaemonConfig.__post_init__(self)
        positive(
            self,
            "max_prompt_tokens",
            "max_new_tokens",
            "default_max_tokens",
            "max_sessions",
            "kv_capacity_tokens",
            "max_batch",
            "max_attend_rows",
            "report_s",
        )
        if self.http_port < -1 or self.http_port > 65535:
            raise ValueError(f"http_port must be in -1..65535, got {self.http_port}")
        if self.http_client_cert not in ("optional", "required"):
            raise ValueError(
                f"http_client_cert must be optional or required, got {self.http_client_cert!r}"
            )
        if not self.session_idle_s >= 0:
            raise ValueError(f"session_idle_s must be >= 0 (0: never), got {self.session_idle_s}")
        if not (self.table_refresh_s >= 0 or self.table_refresh_s == -1):
            raise ValueError(
                f"table_refresh_s must be > 0, 0 (lease / 3) or -1 (never), got "
                f"{self.table_refresh_s}"
            )


def _nvshmem_available() -> bool:
    from corpusd.transport import nvshmem_ring  # torch: only when nvshmem is asked for

    return nvshmem_ring.available()
