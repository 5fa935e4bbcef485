"""Requester: agent sessions, the decode worker, the one fan-out engine (route / fetch / local,
failover, LSE merge), the cost predicate, the Agent API and its client, the SGLang plugin.

``from requester import Client`` gives the Agent API's Python client (imported on first use, so
``import requester.config`` stays light).
"""

from __future__ import annotations

from typing import Any

_CLIENT = ("Client", "AgentError", "SessionRef", "Chunk", "Completion")


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from requester import client

        return getattr(client, name)
    raise AttributeError(f"module 'requester' has no attribute {name!r}")
