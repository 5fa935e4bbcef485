"""The state store on etcd (``--state etcd://h1:2379,h2:2379,h3:2379/prefix``).

Keys under ``/prefix/``, values JSON:

- ``holders/<id>``: the holder's spec, load and the id of its etcd lease;
- ``live/<id>``: empty, attached to that lease: the holder is live while it exists, so etcd's
  clock, not ours, decides liveness (a heartbeat is a lease keep-alive);
- ``corpora/<id>``: the corpus row; ``pages/<id>``: its whole page table (one key, so a
  publish is one put);
- ``seq``: the queue's last sequence number; ``leader``: the elected coordinator (election.py).

Every write is one etcd transaction guarded by the leader key's create revision (the fence: a
coordinator that lost its leadership cannot write, even if it does not know yet) and, for a
read-modify-write, by the mod revision of what it read; a lost race is retried, a lost fence
raises NotLeader. A pin's publish is one transaction: the page table and the corpus's ``ready``
row, compared against the ``pinning`` row's revision.

Client: aetcd (asyncio over grpc.aio, like the daemons; works with this repo's grpcio/protobuf
pins). Several endpoints become one gRPC channel over all of them (``ipv4:`` target, pick-first
with retries on UNAVAILABLE), so losing the etcd member we talk to is a reconnect, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any
from urllib.parse import urlsplit

import aetcd

from corpusd.coordinator.state_store import CorpusRow, HolderRow, NotLeader, StateStore, Table

#: etcd refuses shorter leases (3 election ticks of 1 s / 2 … rounded up to whole seconds)
MIN_TTL_S = 2
_RETRY = {
    "methodConfig": [
        {
            "name": [{"service": s} for s in ("etcdserverpb.KV", "etcdserverpb.Lease")],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/prefix`` → ([(h1, 2379), (h2, 2379)], "/prefix/"). Raises
    ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise ValueError(f"--state {url!r}: expected etcd://host:port[,host:port…]/prefix")
    endpoints = []
    for ep in parts.netloc.split(","):
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--state {url!r}: endpoint {ep!r} is not host:port")
        endpoints.append((host, int(port)))
    prefix = parts.path.strip("/")
    if not prefix or any(c in prefix for c in "\0 "):
        raise ValueError(f"--state {url!r}: name a key prefix, e.g. etcd://{parts.netloc}/corpusd")
    return endpoints, f"/{prefix}/"


def connect(endpoints: list[tuple[str, int]], timeout_s: float = 5.0) -> aetcd.Client:
    """One aetcd client whose channel spans every endpoint (resolved to IPv4 now)."""
    try:
        ips = [f"{socket.gethostbyname(h)}:{p}" for h, p in endpoints]
    except OSError as e:
        raise ValueError(f"--state: cannot resolve an etcd endpoint of {endpoints}: {e}") from None
    # aetcd builds its target as f"{host}:{port}": hand it "ipv4:a:1,b:2,c" and port 3
    head, _, last_port = ",".join(ips).rpartition(":")
    return aetcd.Client(
        host=f"ipv4:{head}",
        port=int(last_port),
        timeout=timeout_s,  # aetcd says int; grpc takes a float
        options={"grpc.enable_retries": 1, "grpc.service_config": json.dumps(_RETRY)},
    )


_HOLDER_KEYS = [f.name for f in fields(HolderRow) if f.name != "leased"]


class EtcdState(StateStore):
    def __init__(self, endpoints: list[tuple[str, int]], prefix: str, node: str) -> None:
        self.client = connect(endpoints)
        self.tx = self.client.transactions
        self.prefix, self.node = prefix, node
        self.where = ",".join(f"{h}:{p}" for h, p in endpoints) + prefix
        self.leader_key = self.k("leader")
        self.leader_rev = 0  # create revision of our leader key while we lead; 0: we do not

    def k(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode()

    async def close(self) -> None:
        await self.client.close()

    async def check(self, timeout_s: float = 10.0) -> None:
        """Raise ValueError naming the endpoints when etcd does not answer within
        ``timeout_s`` (a coordinator refuses to start on a store it cannot reach)."""
        try:
            await asyncio.wait_for(self.client.get(self.leader_key), timeout_s)
        except (aetcd.exceptions.ClientError, asyncio.TimeoutError) as e:
            raise ValueError(f"--state: etcd at {self.where} does not answer: {e!r}") from None

    # -- transactions ---------------------------------------------------------------------------
    async def _txn(self, compare: list[Any], ops: list[Any]) -> bool:
        """Run ``ops`` if ``compare`` holds and we still lead. False: a compare failed (the
        caller re-reads and retries). Raises NotLeader when the fence failed."""
        if not self.leader_rev:
            raise NotLeader(await self.leader())
        fence = self.tx.create(self.leader_key) == self.leader_rev
        ok, _ = await self.client.transaction([fence, *compare], ops, [])
        if ok:
            return True
        kv = await self.client.get(self.leader_key)
        if kv is None or kv.create_revision != self.leader_rev:
            self.leader_rev = 0
            raise NotLeader(kv.value.decode() if kv else "")
        return False

    async def _update(self, key: bytes, fn: Callable[[Any], Any]) -> bool:
        """Read ``key``'s JSON, write ``fn(value)`` back unless it returns None, atomically
        against concurrent writers. Returns whether it wrote."""
        for _ in range(64):
            kv = await self.client.get(key)
            new = fn(json.loads(kv.value) if kv else None)
            if new is None:
                return False
            guard = self.tx.mod(key) == kv.mod_revision if kv else self.tx.version(key) == 0
            if await self._txn([guard], [self.tx.put(key, json.dumps(new).encode())]):
                return True
        raise RuntimeError(f"etcd key {key!r}: 64 conflicting writes in a row")

    async def leader(self) -> str:
        """The leading coordinator's address, or "" when none leads."""
        kv = await self.client.get(self.leader_key)
        return kv.value.decode() if kv else ""

    # -- holders --------------------------------------------------------------------------------
    async def _grant(self, ttl_s: float) -> int:
        lease = await self.client.lease(max(MIN_TTL_S, math.ceil(ttl_s)))
        return int(lease.id)

    async def register(self, h: HolderRow, ttl_s: float) -> None:
        lease = await self._grant(ttl_s)
        row = {k: getattr(h, k) for k in _HOLDER_KEYS} | {"lease_id": lease}
        old = await self.client.get(self.k("holders", h.holder_id))
        ok = await self._txn(
            [],
            [
                self.tx.put(self.k("holders", h.holder_id), json.dumps(row).encode()),
                self.tx.put(self.k("live", h.holder_id), b"", lease=lease),
            ],
        )
        assert ok, "an unguarded registration cannot lose a race"
        if old is not None:  # the previous lease would otherwise linger until its TTL
            prev = json.loads(old.value).get("lease_id", 0)
            if prev and prev != lease:
                await self._revoke(prev)

    async def _revoke(self, lease_id: int) -> None:
        with contextlib.suppress(aetcd.exceptions.ClientError):  # expired already: the same
            await self.client.revoke_lease(lease_id)

    async def heartbeat(self, holder_id: str, used: int, flows: int, now: float) -> bool:
        kv = await self.client.get(self.k("holders", holder_id))
        if kv is None:
            return False
        row = json.loads(kv.value)
        reply = await self.client.refresh_lease(row["lease_id"])
        ops = []
        if reply is None or reply.TTL <= 0:  # lapsed (or revoked): a fresh lease revives it
            row["lease_id"] = await self._grant(row["lease_s"])
            ops.append(self.tx.put(self.k("live", holder_id), b"", lease=row["lease_id"]))
        row |= {"used_frames": used, "active_flows": flows, "last_heartbeat": now}
        ops.append(self.tx.put(self.k("holders", holder_id), json.dumps(row).encode()))
        if not await self._txn([self.tx.mod(kv.key) == kv.mod_revision], ops):
            return await self.heartbeat(holder_id, used, flows, now)  # raced an add_used
        return True

    async def mark_unreachable(self, holder_id: str) -> None:
        kv = await self.client.get(self.k("holders", holder_id))
        if kv is not None:
            await self._revoke(json.loads(kv.value)["lease_id"])

    async def add_used(self, holder_id: str, delta: int) -> None:
        def add(row: Any) -> Any:
            return (
                None if row is None else row | {"used_frames": max(0, row["used_frames"] + delta)}
            )

        await self._update(self.k("holders", holder_id), add)

    async def holders(self) -> list[HolderRow]:
        rows = await self.client.get_prefix(self.k("holders", ""))
        live = {kv.key for kv in await self.client.get_prefix(self.k("live", ""), keys_only=True)}
        out = []
        for kv in rows:
            row = json.loads(kv.value)
            leased = self.k("live", row["holder_id"]) in live
            out.append(HolderRow(**{k: row[k] for k in _HOLDER_KEYS}, leased=leased))
        return sorted(out, key=lambda h: h.holder_id)

    async def holder(self, holder_id: str) -> HolderRow | None:
        kv = await self.client.get(self.k("holders", holder_id))
        if kv is None:
            return None
        row = json.loads(kv.value)
        leased = await self.client.get(self.k("live", holder_id)) is not None
        return HolderRow(**{k: row[k] for k in _HOLDER_KEYS}, leased=leased)

    # -- corpora and the page table -------------------------------------------------------------
    async def corpus(self, corpus_id: str) -> CorpusRow | None:
        kv = await self.client.get(self.k("corpora", corpus_id))
        return CorpusRow(**json.loads(kv.value)) if kv else None

    async def corpora(self) -> list[CorpusRow]:
        rows = [
            CorpusRow(**json.loads(kv.value))
            for kv in await self.client.get_prefix(self.k("corpora", ""))
        ]
        return sorted(rows, key=lambda r: (r.name, r.corpus_id))

    async def put_corpus(self, row: CorpusRow) -> CorpusRow:
        seq_key, key = self.k("seq"), self.k("corpora", row.corpus_id)
        for _ in range(64):
            new = asdict(row) | {"updated_at": time.time()}
            guard = []
            ops = []
            if row.state == "queued" and row.queued_seq is None:
                kv = await self.client.get(seq_key)
                top = int(kv.value) if kv else 0
                guard = [
                    self.tx.mod(seq_key) == kv.mod_revision if kv else self.tx.version(seq_key) == 0
                ]
                new["queued_seq"] = top + 1
                ops.append(self.tx.put(seq_key, str(top + 1).encode()))
            ops.append(self.tx.put(key, json.dumps(new).encode()))
            if await self._txn(guard, ops):
                return CorpusRow(**new)
        raise RuntimeError("etcd queue sequence: 64 conflicting writes in a row")

    async def commit_pin(
        self, corpus_id: str, table: dict[tuple[int, int], tuple[str, int]], cp_degree: int
    ) -> None:
        pages: Table = {}
        for (p, _r), hf in sorted(table.items()):
            pages.setdefault(p, []).append(hf)
        key = self.k("corpora", corpus_id)
        kv = await self.client.get(key)
        assert kv is not None, f"corpus {corpus_id} has no row to publish"
        row = json.loads(kv.value)
        row |= {"state": "ready", "cp_degree": cp_degree, "plan": None, "queued_seq": None}
        row["updated_at"] = time.time()
        published = await self._txn(
            [self.tx.mod(key) == kv.mod_revision],
            [
                self.tx.put(self.k("pages", corpus_id), _dump_table(pages)),
                self.tx.put(key, json.dumps(row).encode()),
            ],
        )
        # the publisher holds the lock: no one else writes a pinning row we lead
        assert published, f"corpus {corpus_id} changed while it was being published"

    async def set_table(self, corpus_id: str, table: Table) -> None:
        key = self.k("corpora", corpus_id)
        for _ in range(64):
            kv = await self.client.get(key)
            if kv is None or json.loads(kv.value)["state"] != "ready":
                return  # unpinned meanwhile: its table is gone and stays gone
            if await self._txn(
                [self.tx.mod(key) == kv.mod_revision],
                [self.tx.put(self.k("pages", corpus_id), _dump_table(table))],
            ):
                return
        raise RuntimeError(f"corpus {corpus_id}: 64 conflicting writes in a row")

    async def drop_corpus(self, corpus_id: str) -> None:
        await self._txn(
            [],
            [
                self.tx.delete(self.k("pages", corpus_id)),
                self.tx.delete(self.k("corpora", corpus_id)),
            ],
        )

    async def retire(self, corpus_id: str) -> None:
        key = self.k("corpora", corpus_id)
        for _ in range(64):
            kv = await self.client.get(key)
            if kv is None:
                return
            row = json.loads(kv.value)
            row |= {"state": "retired", "plan": None, "queued_seq": None}
            row["updated_at"] = time.time()
            if await self._txn(
                [self.tx.mod(key) == kv.mod_revision],
                [
                    self.tx.delete(self.k("pages", corpus_id)),
                    self.tx.put(key, json.dumps(row).encode()),
                ],
            ):
                return
        raise RuntimeError(f"corpus {corpus_id}: 64 conflicting writes in a row")

    async def page_table(self, corpus_id: str) -> Table:
        kv = await self.client.get(self.k("pages", corpus_id))
        return _load_table(kv.value) if kv else {}

    async def tables(self) -> dict[str, Table]:
        head = len(self.k("pages", ""))
        return {
            kv.key[head:].decode(): _load_table(kv.value)
            for kv in await self.client.get_prefix(self.k("pages", ""))
        }


def _dump_table(table: Table) -> bytes:
    return json.dumps([[p, reps] for p, reps in sorted(table.items())]).encode()


def _load_table(raw: bytes) -> Table:
    return {int(p): [(h, int(f)) for h, f in reps] for p, reps in json.loads(raw)}
