"""``start_coordinator``: :func:`corpusd.daemon.start` for the coordinator role, under the name
tests, tools and ``up`` use."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, start

CoordinatorProcess = Daemon


def start_coordinator(
    state_dir: Path,
    store: Path,
    *extra: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> Daemon:
    """``corpusd serve`` in ``state_dir`` on page store ``store``; see :func:`start`."""
    return start("coordinator", state_dir, *extra, store=store, timeout=timeout, env=env)
