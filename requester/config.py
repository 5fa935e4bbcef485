"""``corpusd agent``'s configuration (its flags derive from it, beside WorkerConfig's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AgentConfig:
    store: str = field(
        default="",
        metadata={
            "help": "page store (corpus tokens for local recompute; default: $CORPUSD_STORE)"
        },
    )
    state_dir: str = field(
        default="", metadata={"help": "endpoint.json and the log (default: $CORPUSD_HOME/agent)"}
    )
    model: str = field(default="", metadata={"help": "model directory (default: the tiny model)"})
    host: str = "127.0.0.1"
    port: int = field(default=0, metadata={"help": "0: pick a free port (see endpoint.json)"})
    metrics_port: int = field(default=0, metadata={"help": "0: pick a free port; -1: none"})
    worker_id: str = field(default="", metadata={"help": "name in the coordinator's registry"})
    coordinator: str = field(
        default="",
        metadata={"help": "coordinator for page tables (default: $CORPUSD_COORDINATOR)"},
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
    kv_capacity_tokens: int = field(
        default=1 << 20, metadata={"help": "sessions' own cache rows (prompts and answers)"}
    )
    max_batch: int = field(default=64, metadata={"help": "sessions stepped together, at most"})
    max_attend_rows: int = field(default=4096, metadata={"help": "query rows of one Attend"})
    report_s: float = field(
        default=2.0, metadata={"help": "how often load is reported to the coordinator"}
    )
    threads: int = field(default=0, metadata={"help": "torch intra-op threads; 0: torch's"})
    drain_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.store or not self.state_dir:
            raise ValueError("an agent needs a page store and a state directory")
        for key in (
            "max_prompt_tokens",
            "max_new_tokens",
            "default_max_tokens",
            "max_sessions",
            "kv_capacity_tokens",
            "max_batch",
            "max_attend_rows",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if not self.report_s > 0:
            raise ValueError(f"report_s must be > 0, got {self.report_s}")
