"""``start_agent``: :func:`corpusd.daemon.start` for the agent role, under the name tests,
tools and ``up`` use."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, start

AgentProcess = Daemon


def start_agent(
    store: Path,
    state_dir: Path,
    model_dir: Path,
    *extra: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Daemon:
    """``corpusd agent`` in ``state_dir`` over ``store`` with ``model_dir``; see :func:`start`."""
    return start("agent", state_dir, *extra, store=store, model=model_dir, timeout=timeout, env=env)
