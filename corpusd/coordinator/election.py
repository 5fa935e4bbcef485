"""Which coordinator leads: always this one on SQLite; on etcd, the holder of a lease key.

etcd: ``/prefix/leader`` holds the leader's address and is attached to its etcd lease (TTL
``lease_s``). A coordinator campaigns by creating the key only if it does not exist (one
transaction), keeps the lease alive every ``lease_s / 4`` and, once it leads, writes only
through transactions fenced on the key's create revision (etcd_state.py), so a leader that
lost its lease cannot write even before it notices. Standbys poll the key every ``poll_s``
and campaign as soon as it is gone: a dead leader is replaced within its lease plus one poll
(at once by a coordinator restarted on the leader's own address). Standbys answer reads;
writes get UNAVAILABLE naming the leader, and clients with several addresses move on to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the etcd client is imported only by a coordinator on etcd
    import aetcd

    from corpusd.coordinator.etcd_state import EtcdState

log = logging.getLogger("corpusd.coordinator")


class Leadership:
    """SQLite: one coordinator, always leading."""

    leading = True
    since = 0.0  # monotonic time it last became leader

    async def leader(self) -> str:
        return ""

    async def run(self, on_lead: Callable[[], Awaitable[None]]) -> None:
        await on_lead()
        await asyncio.Event().wait()


class EtcdElection(Leadership):
    def __init__(self, state: EtcdState, lease_s: float, poll_s: float = 0.25) -> None:
        from corpusd.coordinator.etcd_state import MIN_TTL_S

        self.state, self.poll_s = state, poll_s
        self.ttl = max(MIN_TTL_S, math.ceil(lease_s))
        self.leading = False

    async def leader(self) -> str:
        return await self.state.leader()

    async def run(self, on_lead: Callable[[], Awaitable[None]]) -> None:
        """Campaign, lead (``on_lead`` runs first: recovery, before any write is served),
        and campaign again if the lease is lost. Runs until cancelled."""
        c, tx, key = self.state.client, self.state.client.transactions, self.state.leader_key
        while True:
            lease = None
            try:
                lease = await c.lease(self.ttl)
                me = self.state.node.encode()
                won, _ = await c.transaction(
                    [tx.version(key) == 0], [tx.put(key, me, lease=lease)], []
                )
                if not won:  # a key naming our own address was left by a process before us
                    # here (we hold its port, so it is gone): take it over without waiting
                    won, _ = await c.transaction(
                        [tx.value(key) == me], [tx.delete(key), tx.put(key, me, lease=lease)], []
                    )
                if won:
                    kv = await c.get(key)
                    assert kv is not None, "the leader key we just created is gone"
                    self.state.leader_rev = kv.create_revision
                    log.info("leading (etcd lease %x, ttl %d s)", lease.id, self.ttl)
                    await self._lead(lease, on_lead)
                else:
                    await c.revoke_lease(lease.id)
            except asyncio.CancelledError:
                if lease is not None and self.leading:
                    with contextlib.suppress(Exception):  # give the lead up now, not in ttl s
                        await asyncio.wait_for(c.revoke_lease(lease.id), 1.0)
                raise
            except _etcd_error() as e:
                log.warning("election: etcd: %s", e)
            finally:
                self.leading = False
                self.state.leader_rev = 0
            await asyncio.sleep(self.poll_s)

    async def _lead(
        self, lease: aetcd.leases.Lease, on_lead: Callable[[], Awaitable[None]]
    ) -> None:
        """Keep the lease alive; return when it is lost."""
        await on_lead()
        self.leading, self.since = True, time.monotonic()
        while True:
            await asyncio.sleep(self.ttl / 4)
            try:
                reply = await self.state.client.refresh_lease(lease.id)
            except _etcd_error() as e:
                log.warning("leader lease keep-alive failed: %s", e)
                continue  # etcd may be electing its own leader; the fence guards our writes
            if reply is None or reply.TTL <= 0:
                log.error(
                    "lost the leadership (etcd lease %x expired); campaigning again", lease.id
                )
                return


def _etcd_error() -> type[Exception]:
    """aetcd's ClientError, imported when an etcd election runs (never on SQLite)."""
    from aetcd.exceptions import ClientError

    return ClientError
