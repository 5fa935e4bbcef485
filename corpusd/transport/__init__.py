"""Data-plane transports by name: ``grpc`` (everywhere) and ``nvshmem`` (GPU to GPU).

A requester picks per holder at connect time: ``nvshmem`` when this process can run NVSHMEM,
the holder offers an NVSHMEM job (its Transport service answered Join with a job id) and the two
can reach each other through it (same node, or IBGDA configured for cross-node), else ``grpc``.
The choice is logged and exported by the caller; both carry the same Attend semantics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Peer:
    """What the requester knows about one holder when it connects."""

    nvshmem_job: str  # "" when the holder offers none
    same_node: bool


@dataclass(frozen=True, slots=True)
class Transport:
    name: str
    priority: int  # higher wins in "auto"
    usable: Callable[[Peer], bool]


def _cross_node_ready() -> bool:
    # Across nodes NVSHMEM needs an RDMA transport: IBGDA on, and the remote transport not "none".
    return (
        os.environ.get("NVSHMEM_IB_ENABLE_IBGDA") == "1"
        and os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "ibrc") != "none"
    )


def _nvshmem_usable(peer: Peer) -> bool:
    from corpusd.transport.nvshmem_ring import available

    return bool(peer.nvshmem_job) and (peer.same_node or _cross_node_ready()) and available()


REGISTRY: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport("grpc", 0, lambda peer: True),
        Transport("nvshmem", 10, _nvshmem_usable),
    )
}

#: what a ``--transport`` flag accepts: "auto" or a registered name
TRANSPORTS = ("auto", *REGISTRY)


def choose(name: str, peer: Peer) -> Transport:
    """``name`` = a registered transport or "auto" (the highest-priority usable one). Raises
    ValueError when the named transport is unknown or unusable for this peer."""
    if name == "auto":
        return max((t for t in REGISTRY.values() if t.usable(peer)), key=lambda t: t.priority)
    t = REGISTRY.get(name)
    if t is None:
        raise ValueError(f"unknown transport {name!r}; registered: {sorted(REGISTRY)}")
    if not t.usable(peer):
        raise ValueError(f"transport {name!r} is not usable for this holder ({peer})")
    return t
