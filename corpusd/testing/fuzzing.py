"""Fuzzing corpusd's three gRPC services with requests drawn around valid ones.

Each request starts from a valid request of one RPC (``TARGETS``: every RPC of Holder,
Coordinator and Agent) and is then, at random (seeded), left as it is or mutated: fields set to
edge values of their type (0, 2³²−1, NaN, ±inf, empty, 1 MB strings, unknown ids, 100k-element
lists), tensor fields given wrong dtypes, negative, huge or mismatched shapes, random or
non-finite bytes, or the serialised message truncated, bit-flipped or replaced by random
bytes. Requests go out as raw bytes (so a message that does not parse is sent as it is), several
at once, and every answer's status code is counted per RPC. ``BAD`` codes are failures: a
daemon must answer every request with a precise status and keep serving.

The valid requests are built in :mod:`corpusd.testing.fuzz_requests`, the mutations drawn in
:mod:`corpusd.testing.fuzz_mutate`; this module sends them, counts the answers (``Fuzzer``,
``Tally``) and starts the daemons under test (``fuzz_cluster``).

Used by ``tests/procs/test_fuzz.py`` (a CI-sized run) and ``tools/fuzz.py`` (≥ 10,000).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.model import ModelConfig, fingerprint
from corpusd.testing.fuzz_mutate import Case, draw
from corpusd.testing.fuzz_requests import TARGETS, Ctx
from corpusd.testing.holders import pin_sample, start_holders, synthetic_corpus
from corpusd.v1 import agent_pb2, agent_pb2_grpc
from holder.launch import HolderProcess
from requester.launch import AgentProcess, start_agent

S = grpc.StatusCode
#: answers that are failures whatever the request: an unexpected exception (INTERNAL, UNKNOWN),
#: a request that hung (DEADLINE_EXCEEDED: the fuzzer's deadline is generous), a daemon gone
BAD = frozenset({S.INTERNAL, S.UNKNOWN, S.DEADLINE_EXCEEDED, S.UNAVAILABLE, S.DATA_LOSS})
#: UNAVAILABLE is a precise answer here: a pin placed on a holder that the fuzzer registered
#: with an address nobody serves ("was not published (nothing kept)")
ALSO_FINE = {
    ("coordinator", "Pin"): frozenset({S.UNAVAILABLE}),
    ("coordinator", "ChooseWorker"): frozenset({S.UNAVAILABLE}),  # "no live agent worker"
}
DEADLINE_S = 60.0


# -- sending and counting ------------------------------------------------------------------------
@dataclass
class Tally:
    """Status codes per RPC; failures kept with what was sent."""

    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    failures: list[tuple[str, str, str, str]] = field(default_factory=list)  # rpc, kind, code, msg
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    def by_code(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, code), n in self.codes.items():
            out[code] += n
        return out

    def table(self) -> str:
        codes = sorted({c for _, c in self.codes})
        rpcs = sorted({r for r, _ in self.codes})
        w = max(len(r) for r in rpcs) if rpcs else 10
        short = {c: c.replace("INVALID_ARGUMENT", "INVALID_ARG")[:12] for c in codes}
        lines = [f"{'rpc':<{w}} " + " ".join(f"{short[c]:>12}" for c in codes)]
        for r in rpcs:
            lines.append(f"{r:<{w}} " + " ".join(f"{self.codes[(r, c)]:>12}" for c in codes))
        lines.append(f"{'total':<{w}} " + " ".join(f"{self.by_code()[c]:>12}" for c in codes))
        return "\n".join(lines)


class Fuzzer:
    """Sends drawn requests to the daemons, ``concurrency`` at a time, and tallies answers."""

    def __init__(
        self,
        ctx: Ctx,
        addresses: dict[str, list[str]],
        seed: int,
        only: frozenset[str] = frozenset(),
    ) -> None:
        """``only``: the RPCs to fuzz (``holder.Attend``, or a service: ``agent``); all when
        empty."""
        self.ctx, self.addresses, self.rng = ctx, addresses, random.Random(seed)
        self.targets = [
            t for t in TARGETS if not only or t.name in only or t.service in only
        ] or list(TARGETS)
        torch.manual_seed(seed)
        opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.channels = {
            a: grpc.aio.insecure_channel(a, options=opts) for al in addresses.values() for a in al
        }
        self.tally = Tally()

    async def close(self) -> None:
        for s in list(self.ctx.sessions):
            await self._close_session(s)
        for ch in self.channels.values():
            await ch.close()

    async def send(self, case: Case) -> tuple[grpc.StatusCode, str, bytes]:
        ch = self.channels[case.address]
        try:
            if case.target.streaming:
                replies = [
                    r async for r in ch.unary_stream(case.target.path)(case.raw, timeout=DEADLINE_S)
                ]
                return S.OK, "", replies[-1] if replies else b""
            reply = await ch.unary_unary(case.target.path)(case.raw, timeout=DEADLINE_S)
            return S.OK, "", reply
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", b""

    async def _close_session(self, sid: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            req = agent_pb2.CloseSessionRequest(session_id=sid).SerializeToString()
            await self.channels[self.addresses["agent"][0]].unary_unary(
                "/corpusd.v1.Agent/CloseSession"
            )(req, timeout=DEADLINE_S)
        if sid in self.ctx.sessions:
            self.ctx.sessions.remove(sid)

    async def one(self, case: Case) -> None:
        code, detail, reply = await self.send(case)
        t = case.target
        self.tally.codes[(t.name, code.name)] += 1
        self.tally.kinds[case.kind] += 1
        if code in BAD and code not in ALSO_FINE.get((t.service, t.method), frozenset()):
            self.tally.failures.append((t.name, case.kind, code.name, detail[:300]))
        if t.name == "agent.OpenSession" and code == S.OK:
            sid = agent_pb2.OpenSessionResponse.FromString(reply).session_id
            self.ctx.sessions.append(sid)
            if len(self.ctx.sessions) > 12:  # bounded: the agent's session cap is not the point
                await self._close_session(self.ctx.sessions[0])

    async def run(self, n: int, concurrency: int = 8) -> Tally:
        t0 = time.perf_counter()
        queue: asyncio.Queue[Case | None] = asyncio.Queue(maxsize=concurrency * 2)

        async def worker() -> None:
            while (case := await queue.get()) is not None:
                await self.one(case)

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        for _ in range(n):
            await queue.put(draw(self.rng, self.ctx, self.addresses, self.targets))
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
        self.tally.seconds += time.perf_counter() - t0
        return self.tally


# -- the daemons under test --------------------------------------------------------------------
@dataclass
class FuzzCluster:
    coord: CoordinatorProcess
    holders: list[HolderProcess]
    agent: AgentProcess
    ctx: Ctx
    store: Path

    @property
    def daemons(self) -> dict[str, Any]:
        return {
            "coordinator": self.coord,
            **{f"holder{i}": h for i, h in enumerate(self.holders)},
            "agent": self.agent,
        }

    @property
    def addresses(self) -> dict[str, list[str]]:
        return {
            "holder": [h.address for h in self.holders],
            "coordinator": [self.coord.address],
            "agent": [self.agent.address],
        }

    def alive(self) -> dict[str, bool]:
        return {name: d.proc.poll() is None for name, d in self.daemons.items()}

    def rss_kib(self) -> dict[str, int]:
        out = {}
        for name, d in self.daemons.items():
            status = Path(f"/proc/{d.proc.pid}/status")
            if d.proc.poll() is not None or not status.exists():
                continue
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = int(line.split()[1])
        return out


@contextlib.contextmanager
def fuzz_cluster(tmp: Path, model_dir: Path, corpus_tokens: int = 300) -> Iterator[FuzzCluster]:
    """A coordinator, two holders and an agent worker on loopback; a corpus pinned and published
    (two replicas: each holder has every page), and a small victim corpus in the store."""
    cid = pin_sample(tmp, model_dir, tokens=corpus_tokens)
    store = tmp / "store"
    victim = synthetic_corpus(store, model_dir, 150, seed=7)
    coord = start_coordinator(tmp / "coord", store, "--rpc-timeout-s", "5")
    started: list[Any] = [coord]
    try:
        holders = start_holders(
            store, tmp, model_dir, coord.address, 2, "--capacity-tokens", "4096", "--threads", "1"
        )
        started += holders
        agent = start_agent(
            store, tmp / "agent", model_dir, "--coordinator", coord.address,
            "--max-prompt-tokens", "64", "--max-new-tokens", "8", "--max-sessions", "64",
            "--report-s", "0.5", "--threads", "1", "--primitive", "route",
        )  # fmt: skip
        started.append(agent)
        ctx = asyncio.run(_context(coord.address, store, model_dir, cid, victim))
        yield FuzzCluster(coord, holders, agent, ctx, store)
    finally:
        for d in reversed(started):
            d.stop()


async def _context(coord: str, store: Path, model_dir: Path, cid: str, victim: str) -> Ctx:
    mc = ModelConfig.from_dir(model_dir)
    async with CoordinatorClient(coord) as c:
        await c.wait_holders(2)
        table = await c.pin(cid, replicas=2, wait=True, timeout=60)
    m = PageStore(store).manifest(cid)
    return Ctx(
        corpus_id=cid,
        corpus_name=m.name,
        victim_id=victim,
        victim_name=PageStore(store).manifest(victim).name,
        tokens=m.token_count,
        n_pages=m.n_pages,
        page_size=m.page_size,
        n_layers=mc.num_hidden_layers,
        heads=mc.num_attention_heads,
        kv_dim=mc.kv_dim,
        index_heads=mc.index_n_heads,
        index_dim=mc.index_head_dim,
        vocab=mc.vocab_size,
        fingerprint=fingerprint(model_dir),
        holders={table.address(h): table.frames_on(h) for h in table.holders},
        holder_ids=sorted(table.holders),
    )


async def decode(agent: str, corpus: str, prompt: list[int], tokens: int) -> list[int]:
    """A normal session on ``agent``: ``tokens`` greedy tokens after ``prompt``."""
    async with grpc.aio.insecure_channel(agent) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        s = await stub.OpenSession(
            agent_pb2.OpenSessionRequest(corpus=corpus, tokens=agent_pb2.TokenList(ids=prompt))
        )
        out: list[int] = []
        async for chunk in stub.Generate(
            agent_pb2.GenerateRequest(
                session_id=s.session_id, params=agent_pb2.SamplingParams(max_tokens=tokens)
            )
        ):
            out += list(chunk.token_ids)
        await stub.CloseSession(agent_pb2.CloseSessionRequest(session_id=s.session_id))
        return out
