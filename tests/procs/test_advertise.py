"""Holders behind TCP proxies (their ``--advertise`` addresses, as behind a NAT or a load
balancer): the coordinator's table names the proxies, the agent serves sessions through them,
and when the link to the holder it routes to resets mid-stream (every connection RST, new ones
too) the sessions fail over to the other replica, token-identical (issue 37, item 6: network
faults between daemons)."""

from __future__ import annotations

import asyncio
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.daemon import Daemon
from corpusd.testing.holders import pin_sample
from corpusd.testing.tcp_proxy import Proxy
from holder.launch import start_holder
from requester.client import Client
from requester.launch import start_agent

QUESTIONS = ["\nQ: where?", "\nQ: how many lines?"]
NEW = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _decode(c: Client, cid: str, at_token: object = None) -> list[list[int]]:
    """Each question's greedy tokens; ``at_token()`` is called once every stream has 3."""
    sessions = [await c.open_session(cid, q) for q in QUESTIONS]
    got: list[list[int]] = [[] for _ in sessions]
    called: list[bool] = []

    async def one(i: int) -> None:
        async for ch in c.generate(sessions[i], max_tokens=NEW):
            got[i] += ch.token_ids
            if at_token is not None and not called and all(len(g) >= 3 for g in got):
                called.append(True)
                at_token()  # type: ignore[operator]

    await asyncio.gather(*(one(i) for i in range(len(sessions))))
    for s in sessions:
        await c.close_session(s)
    return got


def test_a_holder_behind_a_proxy_serves_and_a_reset_link_fails_over(
    tmp_path: Path, tiny_dir: Path
) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=600)
    slow = 600  # seconds to start, on the shared 2-core machine under load
    store = tmp_path / "store"
    coord = start_coordinator(tmp_path / "coord", store, timeout=slow)
    running: list[Daemon] = [coord]
    ports = [_free_port(), _free_port()]
    proxies = [Proxy(f"127.0.0.1:{p}") for p in ports]
    try:

        def holder(i: int) -> Daemon:
            return start_holder(
                store, tmp_path / f"h{i}", tiny_dir, "--coordinator", coord.address,
                "--capacity-tokens", "1024", "--port", str(ports[i]),
                "--advertise", proxies[i].address, timeout=slow,
            )  # fmt: skip

        with ThreadPoolExecutor(2) as ex:
            holders = list(ex.map(holder, range(2)))
        running += holders
        agent = start_agent(
            store, tmp_path / "agent", tiny_dir, "--coordinator", coord.address,
            "--threads", "1", "--max-new-tokens", "64", "--primitive", "route", timeout=slow,
        )  # fmt: skip
        running.append(agent)

        async def go() -> tuple[list[list[int]], list[list[int]], set[str], Proxy]:
            async with CoordinatorClient(coord.address) as cc:
                await cc.wait_holders(2)
                table = await cc.pin(cid, replicas=2, wait=True, timeout=120)
                assert all(len(page) == 2 for page in table.pages), "two replicas"
                addresses = {h.address for h in table.holders.values()}
            # route (not fetch, which caches the pages here after the first step): every step
            # asks each page's first replica, whose link is the one to cut
            (victim,) = [p for p in proxies if p.address == table.address(table.pages[0][0][0])]
            async with Client(agent=agent.address) as c:
                before = victim.accepted
                want = await _decode(c, cid)
                assert victim.accepted > before, "the agent dials the advertised address"
                got = await _decode(c, cid, lambda: victim.set("reset"))
            return want, got, addresses, victim

        want, got, addresses, victim = asyncio.run(go())
        assert addresses == {p.address for p in proxies}, (addresses, ports)
        assert got == want
        log = (tmp_path / "agent" / "agent.log").read_text()
        assert re.search(rf"holder {re.escape(victim.address)} failed \(UNAVAILABLE", log), log
    finally:
        for d in reversed(running):
            if d.proc.poll() is None:
                d.stop()
