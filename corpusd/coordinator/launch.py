"""Start a ``corpusd serve`` subprocess and wait until it serves (tests, tools, ``up``)."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, spawn


class CoordinatorProcess(Daemon):
    """A running ``corpusd serve``."""


def start_coordinator(
    state_dir: Path,
    store: Path,
    *extra: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> CoordinatorProcess:
    """Run ``corpusd serve`` with its log in ``state_dir/coordinator.log``; returns once it
    serves. ``env`` replaces this process's environment. Raises RuntimeError (with the log's
    tail) if it exits or times out."""
    args = ["--store", str(store), *extra]
    return CoordinatorProcess(*spawn("coordinator", "serve", args, state_dir, timeout, env))
