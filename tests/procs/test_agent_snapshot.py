"""An agent restarted while its coordinator is down binds a corpus from its snapshot of the
coordinator (issue 37's soak: every new session after ``kill:coordinator`` on a restarted
agent failed "UNAVAILABLE: coordinator: failed to connect"), decodes the same tokens, says so
(log and ``corpusd_requester_snapshot_binds_total``), and follows the coordinator's page table
again once it is back."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.daemon import Daemon
from corpusd.testing.holders import pin_sample
from holder.launch import start_holder
from requester.bind_snapshot import FILE
from requester.client import Client
from requester.launch import start_agent

NEW = 8


async def _decode(agent: str, cid: str) -> list[int]:
    async with Client(agent=agent) as c:
        s = await c.open_session(cid, "\nQ: what is on line 3?\nA:")
        got: list[int] = []
        async for ch in c.generate(s, max_tokens=NEW):
            got += ch.token_ids
        await c.close_session(s)
    return got


def _wait_for(path: Path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text()
        if re.search(pattern, text) or time.monotonic() > deadline:
            return text
        time.sleep(0.3)


def test_an_agent_restarted_while_the_coordinator_is_down_binds_from_its_snapshot(
    tmp_path: Path, tiny_dir: Path
) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=300)
    store, slow = tmp_path / "store", 600  # seconds to start, on the shared 2-core machine
    coord = start_coordinator(tmp_path / "coord", store, timeout=slow)
    port = coord.address.rsplit(":", 1)[1]
    running: list[Daemon] = [coord]
    try:
        holder = start_holder(
            store, tmp_path / "h0", tiny_dir, "--coordinator", coord.address,
            "--capacity-tokens", "1024", timeout=slow,
        )  # fmt: skip
        running.append(holder)
        flags = ("--coordinator", coord.address, "--threads", "1", "--table-refresh-s", "0.5")

        def agent() -> Daemon:
            a = start_agent(store, tmp_path / "agent", tiny_dir, *flags, timeout=slow)
            running.append(a)
            return a

        async def pin() -> None:
            async with CoordinatorClient(coord.address) as cc:
                await cc.wait_holders(1)
                await cc.pin(cid, replicas=1, wait=True, timeout=120)

        asyncio.run(pin())
        first = agent()
        want = asyncio.run(_decode(first.address, cid))
        assert (tmp_path / "agent" / FILE).is_file(), "the bind wrote the snapshot"
        first.stop()
        coord.kill()  # and the agent comes back while the coordinator is down
        second = agent()
        got = asyncio.run(_decode(second.address, cid))
        assert got == want
        log_path = tmp_path / "agent" / "agent.log"
        log = log_path.read_text()
        assert re.search(r"coordinator unavailable .* bound from the coordinator snapshot", log)
        url = f"http://127.0.0.1:{second.metrics_port}/metrics"
        with urllib.request.urlopen(url) as r:
            metrics = r.read().decode()
        assert re.search(r"corpusd_requester_snapshot_binds_total 1\.0", metrics), metrics
        assert not list((tmp_path / "agent").glob("*.tmp")), "the snapshot is written atomically"
        # the coordinator back on its port: the binding follows its page table again
        running.append(start_coordinator(tmp_path / "coord", store, "--port", port, timeout=slow))
        log = _wait_for(log_path, "follows the coordinator's page table again", 60)
        assert "follows the coordinator's page table again" in log, log[-3000:]
    finally:
        for d in reversed(running):
            if d.proc.poll() is None:
                d.stop()
