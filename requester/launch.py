"""Start a ``corpusd agent`` subprocess and wait until it serves (tests, tools, ``up``)."""

from __future__ import annotations

import json
from pathlib import Path

from corpusd.daemon import Daemon, spawn


class AgentProcess(Daemon):
    """A running ``corpusd agent``."""

    @property
    def http_port(self) -> int:
        """Its OpenAI-compatible API's port (``--http-port``); -1: not served."""
        return int(json.loads((self.state_dir / "endpoint.json").read_text())["http_port"])


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
