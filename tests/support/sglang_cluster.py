"""A coordinator, one holder with a pinned synthetic corpus and an agent, on loopback: the corpusd
side the SGLang plugin's link talks to in the CPU tests (tests/procs/test_sglang_link.py,
test_sglang_overlap.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.testing.holders import start_holders, synthetic_corpus
from holder.launch import HolderProcess
from requester.launch import AgentProcess, start_agent

TOKENS = 200  # three whole pages and a partial one


@dataclass
class Cluster:
    store: Path
    corpus_id: str
    coord: CoordinatorProcess
    holders: list[HolderProcess]
    agent: AgentProcess


def start_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    """The cluster for a module-scoped fixture to yield from; stopped (each exiting 0) after."""
    tmp = tmp_path_factory.mktemp("sglang-link")
    store = tmp / "store"
    cid = synthetic_corpus(store, tiny_dir, TOKENS, seed=7)
    co = start_coordinator(tmp / "coord", store)
    hs = start_holders(store, tmp, tiny_dir, co.address, 1)

    async def pin() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(1)
            assert (await c.pin(cid)).corpus.state == "ready"

    asyncio.run(pin())
    agent = start_agent(
        store, tmp / "agent", tiny_dir, "--coordinator", co.address, "--max-batch", "4"
    )
    yield Cluster(store, cid, co, hs, agent)
    assert agent.stop() == 0
    assert [h.stop() for h in hs] == [0]
    assert co.stop() == 0
