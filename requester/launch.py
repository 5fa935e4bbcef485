"""Start a ``corpusd agent`` subprocess and wait until it serves (tests, tools, ``up``)."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, spawn


class AgentProcess(Daemon):
    """A running ``corpusd agent``."""


def start_agent(
    store: Path,
    state_dir: Path,
    model_dir: Path,
    *extra: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> AgentProcess:
    """Run ``corpusd agent`` with its log in ``state_dir/agent.log``; returns once it serves.
    ``env`` replaces this process's environment. Raises RuntimeError (with the log's tail) if
    it exits or times out."""
    args = ["--store", str(store), "--model", str(model_dir), *extra]
    return AgentProcess(*spawn("agent", "agent", args, state_dir, timeout, env))
