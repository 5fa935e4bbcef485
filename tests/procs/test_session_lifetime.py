"""Sessions with a lifetime (issue 37): a gRPC client that exits without CloseSession, or is
killed mid-stream, left its session and cache rows on the agent forever. Against a real
``corpusd agent`` beside a coordinator and a holder on loopback: idle sessions expire after
``--session-idle-s`` and a later call says so (NOT_FOUND); a client killed mid-stream closes
its session at once; ``--max-sessions`` refuses RESOURCE_EXHAUSTED naming the limit; open
sessions and their cache rows are metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.testing.holders import start_holders, synthetic_corpus
from holder.launch import HolderProcess
from requester.client import AgentError, Client, SessionRef
from requester.launch import AgentProcess, start_agent
from tests.support.checks import metric

IDLE_S = 3.0
MAX_SESSIONS = 3


@dataclass
class Agent:
    cid: str
    coord: CoordinatorProcess
    holder: HolderProcess
    agent: AgentProcess

    def metric(self, name: str, *labels: str) -> float:
        return metric(self.agent.metrics_port, name, *labels)

    def wait(self, name: str, want: float, wait_s: float, *labels: str) -> float:
        deadline = time.monotonic() + wait_s
        while (n := self.metric(name, *labels)) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        return n


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("lifetime")
    store = tmp / "store"
    cid = synthetic_corpus(store, tiny_dir, 200, name="docs")
    coord = start_coordinator(tmp / "coord", store)
    (holder,) = start_holders(store, tmp, tiny_dir, coord.address, 1, "--capacity-tokens", "1024")
    agent = start_agent(
        store, tmp / "agent", tiny_dir, "--coordinator", coord.address, "--threads", "1",
        "--session-idle-s", str(IDLE_S), "--max-sessions", str(MAX_SESSIONS),
        "--primitive", "route", "--max-new-tokens", "4096",
    )  # fmt: skip

    async def publish() -> None:
        async with CoordinatorClient(coord.address) as cc:
            await cc.wait_holders(1)
            await cc.pin(cid, replicas=1, wait=True, timeout=60)

    asyncio.run(publish())
    yield Agent(cid, coord, holder, agent)
    for d in (agent, holder, coord):
        d.stop()


def test_sessions_left_open_expire_and_say_so(agent: Agent) -> None:
    addr = agent.agent.address
    closed_idle = agent.metric("corpusd_requester_sessions_closed_total", 'reason="idle"')

    async def leave_open() -> list[str]:
        async with Client(agent=addr) as c:  # exits without CloseSession, like a crashed client
            refs = [await c.open_session("docs", [5, 6, 7, 8 + i]) for i in range(2)]
            await c.complete(refs[0], max_tokens=2)
            return [r.session_id for r in refs]

    ids = asyncio.run(leave_open())
    assert agent.metric("corpusd_requester_sessions") == 2
    assert agent.metric("corpusd_requester_session_kv_rows") >= 4 + 4 + 2 - 1
    t0 = time.monotonic()
    assert agent.wait("corpusd_requester_sessions", 0, IDLE_S + 10) == 0
    assert time.monotonic() - t0 <= IDLE_S + 3, "expired late"
    assert agent.metric("corpusd_requester_session_kv_rows") == 0
    closed = agent.metric("corpusd_requester_sessions_closed_total", 'reason="idle"')
    assert closed - closed_idle == 2

    async def generate_on(sid: str) -> AgentError:
        async with Client(agent=addr) as c:
            with pytest.raises(AgentError) as e:
                await c.complete(SessionRef(sid, addr, 0, 0), max_tokens=1)
            return e.value

    e = asyncio.run(generate_on(ids[1]))
    assert e.code == grpc.StatusCode.NOT_FOUND
    assert f"expired after idle {IDLE_S:g} s" in str(e), e


def test_max_sessions_is_refused_naming_the_limit(agent: Agent) -> None:
    async def go() -> None:
        async with Client(agent=agent.agent.address) as c:
            refs = [await c.open_session("docs", [9, 9, i]) for i in range(MAX_SESSIONS)]
            with pytest.raises(AgentError) as e:
                await c.open_session("docs", [9, 9, 9])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"max sessions {MAX_SESSIONS} reached" in str(e.value), e.value
            for r in refs:
                await c.close_session(r)

    before = agent.metric("corpusd_requester_sessions_refused_total", 'limit="max_sessions"')
    asyncio.run(go())
    after = agent.metric("corpusd_requester_sessions_refused_total", 'limit="max_sessions"')
    assert after - before == 1
    assert agent.wait("corpusd_requester_sessions", 0, 5) == 0


CLIENT = """
import asyncio, sys
from requester.client import Client

async def main():
    async with Client(agent=sys.argv[1]) as c:
        s = await c.open_session("docs", [5, 6, 7])
        async for chunk in c.generate(s, max_tokens=4000):
            print(s.session_id, flush=True)

asyncio.run(main())
"""


def test_a_client_killed_mid_stream_closes_its_session(agent: Agent) -> None:
    gone = agent.metric("corpusd_requester_sessions_closed_total", 'reason="client_gone"')
    idle = agent.metric("corpusd_requester_sessions_closed_total", 'reason="idle"')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, agent.agent.address],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for _ in range(3):  # three tokens streamed: the session is generating
            assert proc.stdout.readline(), "the client streamed nothing"
        assert agent.metric("corpusd_requester_sessions") == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # closed as the client's leaving, not by the idle sweep: the reason tells them apart (a
        # wall-clock bound under IDLE_S failed on a loaded 2-core machine, the close taking 3.03 s)
        assert agent.wait("corpusd_requester_sessions", 0, 4 * IDLE_S) == 0
        after = agent.metric("corpusd_requester_sessions_closed_total", 'reason="client_gone"')
        assert after - gone == 1
        assert agent.metric("corpusd_requester_sessions_closed_total", 'reason="idle"') == idle
    finally:
        proc.kill()
