"""An agent worker SIGKILLed mid-generation costs a coordinator-backed ``requester.Client`` no
token (issue 20, item 2): the client opens each broken session anew on the other worker from the
corpus id and the tokens it already streamed, and the streams it yields equal an uninterrupted
run's, without a gap or a repeat."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.testing.holders import pin_sample, start_holders
from holder.launch import HolderProcess
from requester.client import Client
from requester.launch import AgentProcess, start_agent

QUESTIONS = ["\nQ: where?", "\nQ: how many lines?", "\nQ: who?"]
NEW = 12


@dataclass
class Two:
    tmp: Path
    cid: str
    coord: CoordinatorProcess
    holders: list[HolderProcess]
    agents: list[AgentProcess]


def _agent(tmp: Path, tiny_dir: Path, coord: str, name: str) -> AgentProcess:
    return start_agent(
        tmp / "store", tmp / name, tiny_dir, "--coordinator", coord, "--report-s", "0.3",
        "--threads", "1", "--max-new-tokens", "32",
    )  # fmt: skip


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Two]:
    tmp = tmp_path_factory.mktemp("worker-death")
    cid = pin_sample(tmp, tiny_dir, tokens=400)
    coord = start_coordinator(tmp / "coord", tmp / "store", "--lease-s", "3")
    holders = start_holders(
        tmp / "store", tmp, tiny_dir, coord.address, 1, "--capacity-tokens", "2048"
    )
    agents = [_agent(tmp, tiny_dir, coord.address, f"agent{i}") for i in range(2)]

    async def publish() -> None:
        async with CoordinatorClient(coord.address) as cc:
            await cc.wait_holders(1)
            assert (await cc.pin(cid, wait=True, timeout=60)).corpus.state == "ready"
            for _ in range(100):  # both workers reported
                if sum(w.live for w in await cc.list_workers()) == 2:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("two agent workers did not report")

    asyncio.run(publish())
    yield Two(tmp, cid, coord, holders, agents)
    for d in (*agents, *holders, coord):
        d.stop()


async def _streams(
    c: Client, cid: str, hosts: dict[str, AgentProcess] | None
) -> tuple[list[list[int]], AgentProcess | None]:
    """Each question's NEW greedy tokens; with ``hosts``, the worker of the first session is
    SIGKILLed once every stream has yielded a few tokens (returned)."""
    sessions = [await c.open_session(cid, q) for q in QUESTIONS]
    got: list[list[int]] = [[] for _ in sessions]
    started = asyncio.Event()

    async def one(i: int) -> None:
        async for ch in c.generate(sessions[i], max_tokens=NEW):
            got[i] += ch.token_ids
            if all(len(g) >= 3 for g in got):
                started.set()

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(sessions))]
    victim = hosts[sessions[0].address] if hosts else None
    if victim is not None:
        await asyncio.wait_for(started.wait(), 120)
        victim.kill()
    await asyncio.gather(*tasks)
    for s in sessions:
        await c.close_session(s)
    return got, victim


def test_a_killed_worker_costs_the_client_no_token(two: Two) -> None:
    async def go() -> tuple[list[list[int]], list[list[int]], AgentProcess | None]:
        async with Client(coordinator=two.coord.address) as c:
            want, _ = await _streams(c, two.cid, None)
            got, victim = await _streams(c, two.cid, {a.address: a for a in two.agents})
            return want, got, victim

    want, got, victim = asyncio.run(go())
    assert victim is not None and victim.proc.poll() is not None  # it was killed mid-stream
    assert all(len(g) == NEW for g in got)
    assert got == want


def test_open_session_on_a_dead_worker_goes_to_another(two: Two, tiny_dir: Path) -> None:
    """A worker killed before the coordinator notices (its lease has not run out): the
    coordinator still picks it (idle, and its id sorts first), the client's OpenSession gets
    UNAVAILABLE, and it asks again excluding it; every session decodes what it would have."""
    victim = start_agent(
        two.tmp / "store", two.tmp / "victim", tiny_dir, "--coordinator", two.coord.address,
        "--report-s", "0.3", "--threads", "1", "--worker-id", "0-victim",
    )  # fmt: skip

    async def go() -> tuple[list[list[int]], list[list[int]], int]:
        async with CoordinatorClient(two.coord.address) as cc:
            for _ in range(100):  # the victim reported
                ws = [w for w in await cc.list_workers() if w.live]
                if any(w.report.worker_id == "0-victim" for w in ws):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the victim worker did not report")
        alive = next(a for a in two.agents if a.proc.poll() is None)
        async with Client(agent=alive.address) as ref:
            want, _ = await _streams(ref, two.cid, None)
        await asyncio.sleep(1.0)  # reports after the reference run: every worker idle
        victim.kill()
        async with Client(coordinator=two.coord.address) as c:
            got, _ = await _streams(c, two.cid, None)
            return want, got, c.reopened

    assert any(a.proc.poll() is None for a in two.agents), "a worker of the fixture is alive"
    try:
        want, got, reopened = asyncio.run(go())
    finally:
        if victim.proc.poll() is None:  # the test failed before killing it
            victim.kill()
    assert reopened >= 1  # the dead worker was picked, and the client went elsewhere
    assert got == want and all(len(g) == NEW for g in got)
