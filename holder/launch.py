"""``start_holder``: :func:`corpusd.daemon.start` for the holder role, under the name tests,
tools and ``up`` use."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, start

HolderProcess = Daemon


def start_holder(
    store: Path,
    state_dir: Path,
    model_dir: Path,
    *extra: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Daemon:
    """``corpusd holder`` in ``state_dir`` serving ``store`` with ``model_dir``'s geometry; see
    :func:`start`."""
    return start(
        "holder", state_dir, *extra, store=store, model=model_dir, timeout=timeout, env=env
    )
