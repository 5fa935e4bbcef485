"""``corpusd up``'s flags: :class:`UpConfig` and its port lists, checked before any daemon starts
(torch-free, so the CLI parser is built without importing the daemons)."""

from __future__ import annotations

from dataclasses import dataclass, field

from corpusd import env
from corpusd.daemon_config import check_address, positive
from corpusd.formats import KV_FORMATS

#: the agent's ``--primitive`` (requester.predicate.PRIMITIVES, which this torch-free module does
#: not import: corpusd imports no daemon package)
AGENT_PRIMITIVES = ("auto", "route", "fetch", "local")


@dataclass(frozen=True, slots=True)
class UpConfig:
    holders: int = field(default=2, metadata={"help": "holder processes"})
    state_dir: str = field(
        default="", metadata={"help": "every daemon's state and log (default: $CORPUSD_HOME/up)"}
    )
    store: str = field(default="", metadata={"help": "page store (default: $CORPUSD_STORE)"})
    model: str = field(default="", metadata={"help": "model directory (default: the tiny model)"})
    capacity_tokens: int = field(
        default=65536, metadata={"help": "per holder (its pool is allocated up front)"}
    )
    kv_format: str = field(
        default="plain",
        metadata={"help": "the holders' latent rows: plain, or fp8_e4m3 for pins made with "
                  "--kv-format fp8_e4m3", "choices": KV_FORMATS},
    )  # fmt: skip
    detach: int = field(
        default=0,
        metadata={"help": "1 (or the flag alone): start in the background, return once serving",
                  "const": 1},
    )  # fmt: skip
    timeout_s: float = field(default=180.0, metadata={"help": "for everything to come up"})
    insecure: int = field(
        default=0,
        metadata={"help": "1 (or the flag alone): plaintext and no tokens (default: TLS with a "
                  "local CA and tokens made in <state-dir>/tls)", "const": 1},
    )  # fmt: skip
    coordinator_port: int = field(default=0, metadata={"help": "0: pick a free port"})
    holder_ports: str = field(
        default="", metadata={"help": "comma-separated, one per holder ('': free ports)"}
    )
    coordinator_advertise: str = field(
        default="",
        metadata={
            "help": "host:port the holders and the agent dial for the coordinator: a NAT, load "
            "balancer or TCP proxy in front of it that forwards to --coordinator-port (--state "
            "etcd: two, comma-separated, one per coordinator; '': its own address)"
        },
    )
    holder_advertise: str = field(
        default="",
        metadata={
            "help": "comma-separated host:port, one per holder: the address each registers "
            "for the agent and the coordinator to dial, in front of its --holder-ports port "
            "('', or an empty entry: its own)"
        },
    )
    agent_port: int = field(default=0, metadata={"help": "the agent's gRPC port; 0: a free one"})
    agent_primitive: str = field(
        default="auto",
        metadata={
            "help": "the agent's --primitive: route, fetch or local for every holder group, "
            "or auto (the predicate picks; fetched pages stay in the agent's cache)",
            "choices": AGENT_PRIMITIVES,
        },
    )
    metrics_ports: str = field(
        default="",
        metadata={
            "help": "Prometheus ports: one base port P (coordinator P, holders P+1…, agent last) "
            "or one per daemon in that order, comma-separated ('': free ports)"
        },
    )
    http_port: int = field(
        default=-1,
        metadata={"help": "the agent's OpenAI-compatible HTTP API; 0: a free port, -1: off"},
    )
    calibrate: str = field(
        default="",
        metadata={
            "help": "the cost model's profile ($CORPUSD_HOME/profile.json): auto = a quick "
            "calibration when it is missing or stale (another model or device, or older than "
            "--calibration-max-age-days), always, or off (default: $CORPUSD_CALIBRATE, else auto)",
            "choices": ("", *env.CALIBRATE_MODES),
        },
    )
    calibration_max_age_days: float = field(
        default=30.0, metadata={"help": "a profile older than this is stale"}
    )
    session_idle_s: float = field(
        default=600.0,
        metadata={
            "help": "the agent closes a session no call has used for this long (seconds); 0: never"
        },
    )
    max_sessions: int = field(default=1024, metadata={"help": "the agent's open sessions, at most"})
    state: str = field(
        default="sqlite",
        metadata={
            "help": "sqlite: one coordinator; etcd: a 3-member etcd on loopback and 2 "
            "coordinators sharing it (one leads; every daemon knows both)"
        },
    )

    def __post_init__(self) -> None:
        if self.state not in ("sqlite", "etcd"):
            raise ValueError(f"state must be sqlite or etcd, got {self.state!r}")
        if not 1 <= self.holders <= 64:
            raise ValueError(f"holders must be in 1..64, got {self.holders}")
        ports = self.ports()  # raises ValueError for a malformed list
        named = [(f, p) for f, ps in ports.items() for p in ps if p > 0]
        seen: dict[int, str] = {}
        for flag, port in named:
            if port in seen:
                raise ValueError(f"port {port} is given twice ({seen[port]} and {flag})")
            seen[port] = flag
        positive(self, "capacity_tokens", "timeout_s", "calibration_max_age_days", "max_sessions")
        if not self.session_idle_s >= 0:
            raise ValueError(f"session_idle_s must be >= 0 (0: never), got {self.session_idle_s}")
        self.advertised()  # raises ValueError for a malformed address
        if self.agent_primitive not in AGENT_PRIMITIVES:
            raise ValueError(
                f"agent_primitive must be one of {AGENT_PRIMITIVES}, got {self.agent_primitive!r}"
            )
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.detach not in (0, 1) or self.insecure not in (0, 1):
            raise ValueError(
                f"detach and insecure must be 0 or 1, got {self.detach}, {self.insecure}"
            )

    def agent_flags(self) -> tuple[str, ...]:
        """The agent's session-lifetime flags, as ``corpusd agent`` takes them (the agent's own
        defaults are the same; they are passed anyway so what ``up`` was told is what runs)."""
        return (
            "--session-idle-s", str(self.session_idle_s),
            "--max-sessions", str(self.max_sessions),
        )  # fmt: skip

    def ports(self) -> dict[str, list[int]]:
        """Every port asked for, by flag: ``--holder-ports`` one per holder, ``--metrics-ports``
        coordinator, holders, agent (0: a free one; ``--http-port`` -1: none). Raises ValueError
        for a list of the wrong length or a port outside 0..65535."""
        n = self.holders
        holders = _port_list("--holder-ports", self.holder_ports) or [0] * n
        if len(holders) != n:
            raise ValueError(f"--holder-ports: {len(holders)} ports for {n} holders")
        metrics = _port_list("--metrics-ports", self.metrics_ports) or [0]
        if len(metrics) == 1 and metrics[0] > 0:
            metrics = [metrics[0] + i for i in range(n + 2)]
            if metrics[-1] > 65535:
                raise ValueError(f"--metrics-ports: {metrics[0]}…{metrics[-1]} pass 65535")
        elif len(metrics) == 1:
            metrics = [0] * (n + 2)
        if len(metrics) != n + 2:
            raise ValueError(
                f"--metrics-ports: {len(metrics)} ports; give one base port or {n + 2} "
                f"(coordinator, {n} holders, agent)"
            )
        for flag, port in (
            ("--coordinator-port", self.coordinator_port),
            ("--agent-port", self.agent_port),
        ):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag}: {port}; must be in 0..65535 (0: a free port)")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port: {self.http_port}; must be in -1..65535")
        return {
            "--coordinator-port": [self.coordinator_port],
            "--holder-ports": holders,
            "--agent-port": [self.agent_port],
            "--metrics-ports": metrics,
            "--http-port": [self.http_port],
        }

    def advertised(self) -> tuple[str, list[str]]:
        """``--coordinator-advertise`` ("" or one address per coordinator, comma-separated)
        and ``--holder-advertise`` (one per holder; "" where a holder's own address serves).
        Raises ValueError for a malformed address or a list of the wrong length."""
        holders = [a.strip() for a in self.holder_advertise.split(",")]
        if self.holder_advertise and len(holders) != self.holders:
            raise ValueError(
                f"--holder-advertise: {len(holders)} addresses for {self.holders} holders"
            )
        for a in holders:
            if a:  # "" in the list: that holder's own address
                check_address("--holder-advertise", a)
        coordinators = [a.strip() for a in self.coordinator_advertise.split(",")]
        n = 2 if self.state == "etcd" else 1
        if self.coordinator_advertise and len(coordinators) != n:
            raise ValueError(
                f"--coordinator-advertise: {len(coordinators)} addresses for {n} coordinators "
                f"(--state {self.state})"
            )
        for a in coordinators if self.coordinator_advertise else []:
            check_address("--coordinator-advertise", a)
        return ",".join(coordinators), holders if self.holder_advertise else [""] * self.holders


def _port_list(flag: str, text: str) -> list[int]:
    try:
        ports = [int(x) for x in text.split(",")] if text.strip() else []
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of ports") from None
    bad = [p for p in ports if not 0 <= p <= 65535]
    if bad:
        raise ValueError(f"{flag}: {bad[0]} is outside 0..65535")
    return ports
