"""The coordinator's configuration (``corpusd serve`` flags derive from it) and ``pin``'s
publish options."""

from __future__ import annotations

from dataclasses import dataclass, field

from corpusd import env
from corpusd.daemon_config import DaemonConfig, non_negative, positive


@dataclass(frozen=True, slots=True)
class CoordinatorConfig(DaemonConfig):
    ROLE = "coordinator"
    STATE_HOME = "coordinator"

    state: str = field(
        default="sqlite",
        metadata={
            "help": "where the page table and registry live: sqlite (state.db in the state "
            "directory), sqlite:///path, or etcd://h1:2379,h2:2379/prefix (several coordinators, "
            "one leads)"
        },
    )
    profile: str = field(
        default="",
        metadata={
            "help": "calibration profile JSON whose cp_buckets set CP degrees "
            "(default: the shipped table)"
        },
    )
    lease_s: float = field(
        default=10.0, metadata={"help": "a holder silent this long is not placed on"}
    )
    leader_lease_s: float = field(
        default=0.0,
        metadata={
            "help": "etcd: the leader's lease; a standby takes over this long after the leader "
            "dies (0: --lease-s)"
        },
    )
    replica_window_s: float = field(
        default=30.0,
        metadata={
            "help": "a holder past its fan-in elbow this long gets a replica of its hottest "
            "pages on a cool holder (removed once it is under half its elbow as long); 0: never"
        },
    )
    release_grace_s: float = field(
        default=-1.0,
        metadata={
            "help": "a removed load replica's frames are released this long after the page-table "
            "write, so workers routing by the older table (they re-read it every lease/3) are "
            "not refused; -1: two re-reads, 2 x lease/3 (one to come, one for a step in flight)"
        },
    )
    rpc_timeout_s: float = field(
        default=60.0, metadata={"help": "deadline of each Assign/Release/Info to a holder"}
    )
    max_queue: int = field(default=64, metadata={"help": "pins waiting for room, at most"})
    retry_s: float = field(
        default=2.0, metadata={"help": "how often queued pins are retried (also on every unpin)"}
    )

    @property
    def grace_s(self) -> float:
        """Seconds between a load replica's removal from the page table and its Release."""
        return 2 * self.lease_s / 3 if self.release_grace_s == -1 else self.release_grace_s

    def __post_init__(self) -> None:
        DaemonConfig.__post_init__(self)
        positive(self, "lease_s", "rpc_timeout_s", "retry_s")
        if not (self.state in ("", "sqlite") or self.state.startswith(("sqlite://", "etcd://"))):
            raise ValueError(
                f"state must be sqlite, sqlite:///path or etcd://host:port[,…]/prefix, got "
                f"{self.state!r}"
            )
        if self.state.startswith("etcd://"):
            from corpusd.coordinator.etcd_state import parse_etcd_url

            parse_etcd_url(self.state)  # raises ValueError naming what is wrong
        non_negative(self, "replica_window_s", "leader_lease_s", "max_queue")
        if self.release_grace_s < 0 and self.release_grace_s != -1:
            raise ValueError(
                f"release_grace_s must be >= 0 or -1 (2 x lease/3), got {self.release_grace_s}"
            )


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """``corpusd pin --coordinator ADDR``: after the local pin, ask the coordinator to place it."""

    coordinator: str = field(
        default="",
        metadata={
            "help": "publish the pinned corpus through this coordinator "
            f"(default: {env.COORDINATOR_DEFAULT}; none found: only pin locally)"
        },
    )
    replicas: int = field(default=1, metadata={"help": "copies of each page on distinct holders"})
    wait_s: float = field(
        default=0.0,
        metadata={"help": "if it must queue for room, wait this long for it to be placed"},
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        non_negative(self, "wait_s")


@dataclass(frozen=True, slots=True)
class StatusConfig:
    coordinator: str = field(
        default="", metadata={"help": f"coordinator host:port (default: {env.COORDINATOR_DEFAULT})"}
    )
    timeout_s: float = field(default=10.0, metadata={"help": "deadline of each call"})

    def __post_init__(self) -> None:
        if not self.coordinator:
            raise ValueError(env.NO_COORDINATOR)
