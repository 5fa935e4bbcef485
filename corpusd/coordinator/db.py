"""The coordinator's durable state: ``open_state(url)`` picks the store by the ``--state`` URL,
``sqlite`` (one file in the state directory, the embedded default; ``sqlite:///path/state.db``
names another file) or ``etcd://h1:2379,h2:2379/prefix`` (several coordinators share it; see
``etcd_state``). The rows and the interface are in ``state_store``, re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from corpusd.coordinator.state_store import (
    CorpusRow,
    HolderRow,
    NotLeader,
    StateStore,
    Table,
)

__all__ = ["CorpusRow", "HolderRow", "NotLeader", "StateStore", "Table", "open_state"]


def open_state(url: str, state_dir: str | Path, node: str = "") -> StateStore:
    """The store ``url`` names: "" or ``sqlite`` (``state_dir/state.db``), ``sqlite:///path``,
    or ``etcd://host:port[,host:port…]/prefix`` (``node``: this coordinator's address, what the
    election records). Raises ValueError for any other URL."""
    if url in ("", "sqlite"):
        from corpusd.coordinator.sqlite_state import SqliteState

        return SqliteState(Path(state_dir) / "state.db")
    if url.startswith("sqlite://"):
        from corpusd.coordinator.sqlite_state import SqliteState

        path = url.removeprefix("sqlite://")
        if not path:
            raise ValueError(f"--state {url!r}: name a file, e.g. sqlite:///var/corpusd/state.db")
        return SqliteState(Path(path))
    if url.startswith("etcd://"):
        from corpusd.coordinator.etcd_state import EtcdState, parse_etcd_url

        endpoints, prefix = parse_etcd_url(url)
        return EtcdState(endpoints, prefix, node)
    raise ValueError(
        f"--state {url!r}: expected sqlite, sqlite:///path or etcd://host:port[,host:port]/prefix"
    )
