"""``DaemonConfig``: what every daemon role's config shares (page store, state directory, listen
address, gRPC and metrics ports, drain), its checks, and the range checks every config uses.

The coordinator (``corpusd serve``), the holder and the agent extend it; their CLI flags derive
from the whole class (``corpusd.cli.add_dataclass_flags``), the base's fields first. TLS and
tokens are :class:`corpusd.security.SecurityConfig`, which clients share, so it stays apart.
Torch-free: the CLI builds its parser from these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from corpusd import env

C = TypeVar("C", bound="DaemonConfig")


def positive(cfg: object, *names: str) -> None:
    """Raise ValueError naming the first of ``cfg``'s fields ``names`` that is not > 0."""
    for key in names:
        value = getattr(cfg, key)
        if not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}")


def non_negative(cfg: object, *names: str) -> None:
    """Raise ValueError naming the first of ``cfg``'s fields ``names`` that is < 0 (or NaN)."""
    for key in names:
        value = getattr(cfg, key)
        if not value >= 0:
            raise ValueError(f"{key} must be >= 0, got {value}")


def check_address(name: str, address: str) -> None:
    """Raise ValueError unless ``address`` is one ``host:port`` with a port in 1..65535."""
    host, _, port = address.rpartition(":")
    if not host or "," in address or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{name} must be host:port with a port in 1..65535, got {address!r}")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    #: the role's name in messages, and its state directory under $CORPUSD_HOME
    ROLE: ClassVar[str] = "daemon"
    STATE_HOME: ClassVar[str] = "daemon"

    store: str = field(
        default="",
        metadata={"help": "page store the corpora are pinned in (default: $CORPUSD_STORE)"},
    )
    state_dir: str = field(
        default="",
        metadata={
            "help": "its state: endpoint.json (address and ports, written once it serves), its "
            "log and what it keeps across restarts (default: $CORPUSD_HOME/{state_home})"
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0: a free one (see endpoint.json)"})
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port; 0: a free one; -1: none"}
    )
    drain_s: float = field(
        default=5.0, metadata={"help": "on SIGTERM, seconds running requests get to finish"}
    )

    def __post_init__(self) -> None:
        # Subclasses call DaemonConfig.__post_init__(self) first (slots: no zero-argument super).
        if not self.store or not self.state_dir:
            raise ValueError(f"{self.ROLE}: needs a page store and a state directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: a free one), got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in -1..65535, got {self.metrics_port}")
        non_negative(self, "drain_s")

    @classmethod
    def from_flags(cls: type[C], flags: Any, **given: Any) -> C:
        """The config from parsed flags (an ``argparse.Namespace`` or a mapping with every field),
        ``given`` overriding them; an empty store or state directory defaults to
        ``$CORPUSD_STORE`` and ``$CORPUSD_HOME/<STATE_HOME>``. Raises ValueError (the checks)."""
        get = flags.get if isinstance(flags, Mapping) else lambda k: getattr(flags, k)
        values: dict[str, Any] = {f.name: get(f.name) for f in fields(cls)} | given
        values["store"] = values["store"] or str(env.default_store_dir())
        values["state_dir"] = values["state_dir"] or str(env.home() / cls.STATE_HOME)
        return cls(**values)
