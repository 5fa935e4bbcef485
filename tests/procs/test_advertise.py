"""Holders behind TCP proxies (their ``--advertise`` addresses, as behind a NAT or a load
balancer): the coordinator's table names the proxies, the agent serves sessions through them,
and when the link to the holder it routes to resets mid-stream (every connection RST, new ones
too) the sessions fail over to the other replica, token-identical (issue 37, item 6: network
faults between daemons). And ``corpusd up`` with TLS (its default) behind such proxies: the
daemons verify each other's certificates through them."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import tarfile
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
from tests.procs.test_up import corpusd
from tests.procs.test_up import home as home  # the fixture

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


def test_up_with_tls_peers_dial_the_advertised_proxies(
    home: dict[str, str], tmp_path: Path
) -> None:
    c, h = _free_port(), _free_port()
    to_c, to_h = Proxy(f"127.0.0.1:{c}"), Proxy(f"127.0.0.1:{h}")
    (tmp_path / "src.txt").write_text("".join(f"line {i}: a fox\n" for i in range(60)))
    with tarfile.open(tmp_path / "repo.tar", "w") as tar:
        tar.add(tmp_path / "src.txt", arcname="repo/src.txt")
    out = corpusd(home, "up", "--holders", "1", "--capacity-tokens", "2048", "--detach", "1",
                  "--coordinator-port", str(c), "--holder-ports", str(h),
                  "--coordinator-advertise", to_c.address, "--holder-advertise", to_h.address,
                  "--agent-primitive", "route")  # fmt: skip
    root = Path(home["CORPUSD_HOME"]) / "up"
    try:
        assert f"(peers dial {to_c.address})" in out and f"(peers dial {to_h.address})" in out
        info = json.loads((root / "up.json").read_text())
        assert info["security"], "TLS: up's default"
        assert info["coordinator"]["advertise"] == to_c.address
        assert info["holders"][0] == {**info["holders"][0], "advertise": to_h.address}
        ep = json.loads((root / "holder-0" / "endpoint.json").read_text())
        assert ep["advertise"] == to_h.address and ep["address"] == f"127.0.0.1:{h}"
        # registered (and ready) through the coordinator's proxy, over TLS
        assert to_c.accepted > 0 and not to_c.upstream_errors
        corpusd(home, "pin", "--corpus", str(tmp_path / "repo.tar"), "--name", "repo")
        before = to_h.accepted
        out = corpusd(home, "agents", "--corpus", "repo", "--agents", "1", "--tokens", "4")
        assert out.count("  Q: ") == 1
        assert to_h.accepted > before, "the agent routed through the holder's advertised proxy"
        agent_log = (root / "agent" / "agent.log").read_text()
        assert f"holder {to_h.address}: transport grpc" in agent_log, agent_log
    finally:
        corpusd(home, "down")
