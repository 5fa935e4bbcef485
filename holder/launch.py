"""Start a ``corpusd holder`` subprocess and wait until it serves (tests, tools, ``up``)."""

from __future__ import annotations

from pathlib import Path

from corpusd.daemon import Daemon, spawn


class HolderProcess(Daemon):
    """A running ``corpusd holder``."""


def start_holder(
    store: Path,
    state_dir: Path,
    model_dir: Path,
    *extra: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> HolderProcess:
    """Run ``corpusd holder`` with its log in ``state_dir/holder.log``; returns once it serves.
    ``env`` replaces this process's environment (e.g. ``CUDA_VISIBLE_DEVICES``). Raises
    RuntimeError (with the log's tail) if it exits or times out."""
    args = ["--store", str(store), "--model", str(model_dir), *extra]
    return HolderProcess(*spawn("holder", "holder", args, state_dir, timeout, env))
