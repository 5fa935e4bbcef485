"""``PluginConfig``: the SGLang plugin's settings, read once from the ``CORPUSD_*`` variables
(:mod:`corpusd.env`) when the model class is built, checked together, and handed to the parts
that need them (the link, the chooser, the device path's tables, metrics, the prefill timer).

Each field names its variable in ``metadata["env"]``; its default is that variable's default in
the registry, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from corpusd import env


def _from(name: str) -> Any:
    """A field read from variable ``name``, defaulting to the registry's default for it."""
    return field(default=env.VARS[name].value(None), metadata={"env": name})


@dataclass(frozen=True, slots=True)
class PluginConfig:
    coordinator: str = _from("CORPUSD_COORDINATOR")
    #: a page store this process can read (engine pins have their keys scored as SGLang's)
    store: Path | None = _from("CORPUSD_STORE")  # noqa: RUF009 (a field())
    path: str = _from("CORPUSD_SGLANG_PATH")
    window_tokens: int = _from("CORPUSD_SGLANG_WINDOW")
    arena_tokens: int = _from("CORPUSD_SGLANG_ARENA")
    primitive: str = _from("CORPUSD_SGLANG_PRIMITIVE")
    page_cache_mb: int = _from("CORPUSD_SGLANG_PAGE_CACHE_MB")
    table_refresh_s: float = _from("CORPUSD_SGLANG_TABLE_REFRESH_S")
    holder_deadline_s: float = _from("CORPUSD_SGLANG_HOLDER_DEADLINE_S")
    holder_probe_s: float = _from("CORPUSD_SGLANG_HOLDER_PROBE_S")
    peer: bool = _from("CORPUSD_SGLANG_PEER")
    stage_rows: int = _from("CORPUSD_SGLANG_STAGE_ROWS")
    one_call: bool = _from("CORPUSD_SGLANG_ONE_CALL")
    profile: Path | None = _from("CORPUSD_SGLANG_PROFILE")  # noqa: RUF009 (a field())
    metrics_port: int | None = _from("CORPUSD_SGLANG_METRICS_PORT")
    trace: Path | None = _from("CORPUSD_SGLANG_TRACE")  # noqa: RUF009 (a field())
    slow_prefill_s: float | None = _from("CORPUSD_SGLANG_PROFILE_SLOW")

    def __post_init__(self) -> None:
        # The registry checks each variable; this checks values built by hand and combinations.
        if not self.coordinator:
            raise ValueError(
                "corpusd plugin: no coordinator address; set CORPUSD_COORDINATOR=host:port"
            )
        if self.path not in env.SGLANG_PATHS:
            raise ValueError(f"corpusd plugin: path {self.path!r}: one of {env.SGLANG_PATHS}")
        if self.primitive not in env.SGLANG_PRIMITIVES:
            raise ValueError(
                f"corpusd plugin: primitive {self.primitive!r}: one of {env.SGLANG_PRIMITIVES}"
            )
        if min(self.window_tokens, self.arena_tokens) <= 0 or self.page_cache_mb < 0:
            raise ValueError(
                f"corpusd plugin: window_tokens and arena_tokens must be > 0, page_cache_mb >= 0, "
                f"got {self.window_tokens}, {self.arena_tokens}, {self.page_cache_mb}"
            )
        if not (self.table_refresh_s >= 0 or self.table_refresh_s == -1):
            raise ValueError(
                f"corpusd plugin: table_refresh_s must be >= 0 or -1, got {self.table_refresh_s}"
            )
        if not self.holder_deadline_s >= 0:
            raise ValueError(
                f"corpusd plugin: holder_deadline_s must be >= 0, got {self.holder_deadline_s}"
            )
        if not self.holder_probe_s >= 0:
            raise ValueError(
                f"corpusd plugin: holder_probe_s must be >= 0, got {self.holder_probe_s}"
            )
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"corpusd plugin: metrics_port {self.metrics_port}: 1-65535")
        if self.slow_prefill_s is not None and not self.slow_prefill_s > 0:
            raise ValueError(f"corpusd plugin: slow_prefill_s must be > 0: {self.slow_prefill_s}")
        if self.primitive == "fetch" and self.page_cache_mb == 0:
            raise ValueError(
                "corpusd plugin: CORPUSD_SGLANG_PRIMITIVE=fetch needs a page cache; "
                "CORPUSD_SGLANG_PAGE_CACHE_MB is 0"
            )
        if self.primitive == "fetch" and self.path == "device":
            raise ValueError(
                "corpusd plugin: CORPUSD_SGLANG_PRIMITIVE=fetch is for the host path "
                "(CORPUSD_SGLANG_PATH=host): on the device path route already reads the "
                "holders' pools in place on this GPU, and a copy into the page cache would only "
                "add work"
            )

    @property
    def cache_bytes(self) -> int:
        """The fetch page cache's budget for all layers, in bytes (0: no fetch)."""
        return self.page_cache_mb << 20

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginConfig:
        """The plugin's settings from ``environ`` (default: this process's environment).
        Raises ValueError naming the variable that is wrong, or the combination."""
        values = {}
        for f in fields(cls):
            try:
                values[f.name] = env.get(f.metadata["env"], environ)
            except env.EnvError as e:
                raise ValueError(f"corpusd plugin: {e}") from None
        return cls(**values)
