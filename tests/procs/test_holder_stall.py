"""A holder SIGKILLed under decoding sessions, its pages on no other holder (one replica): the
sessions on it stall at most 2 s before they go on from local recompute (issue 37, item 5),
token-identical, and the fallback is logged and counted."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from requester.client import Client
from requester.launch import start_agent
from tests.support.coordinators import start_holders
from tests.support.holders import pin_sample

QUESTIONS = ["\nQ: where?", "\nQ: how many lines?"]
NEW = 24
STALL_S = 2.0


async def _streams(c: Client, cid: str, kill: object = None) -> tuple[list[list[int]], float]:
    """Each question's greedy tokens, and the longest gap between two chunks of one stream
    after ``kill()`` (called once every stream has yielded 4 tokens)."""
    sessions = [await c.open_session(cid, q) for q in QUESTIONS]
    got: list[list[int]] = [[] for _ in sessions]
    killed_at: list[float] = []
    gaps: list[float] = []

    async def one(i: int) -> None:
        last = time.monotonic()
        async for ch in c.generate(sessions[i], max_tokens=NEW):
            now = time.monotonic()
            if killed_at:
                gaps.append(now - max(last, killed_at[0]))
            last = now
            got[i] += ch.token_ids
            if kill is not None and not killed_at and all(len(g) >= 4 for g in got):
                killed_at.append(time.monotonic())
                kill()  # type: ignore[operator]

    await asyncio.gather(*(one(i) for i in range(len(sessions))))
    for s in sessions:
        await c.close_session(s)
    return got, max(gaps, default=0.0)


def test_a_killed_single_replica_holder_stalls_its_sessions_at_most_2_s(
    tmp_path: Path, tiny_dir: Path
) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=1500)
    coord = start_coordinator(tmp_path / "coord", tmp_path / "store")
    holders = start_holders(
        tmp_path / "store", tmp_path, tiny_dir, coord.address, 2, "--capacity-tokens", "2048"
    )
    agent = start_agent(
        tmp_path / "store", tmp_path / "agent", tiny_dir, "--coordinator", coord.address,
        "--threads", "1", "--max-new-tokens", "64",
    )  # fmt: skip
    try:

        async def go() -> tuple[list[list[int]], list[list[int]], float]:
            async with CoordinatorClient(coord.address) as cc:
                await cc.wait_holders(2)
                table = await cc.pin(cid, replicas=1, wait=True, timeout=120)
                on = {h for page in table.pages for h, _ in page}
                assert len(on) == 2, "the corpus spans both holders"
            async with Client(agent=agent.address) as c:
                want, _ = await _streams(c, cid)
                got, stall = await _streams(c, cid, holders[0].proc.kill)
            return want, got, stall

        want, got, stall = asyncio.run(go())
        assert holders[0].proc.poll() is not None, "holder 0 was killed mid-stream"
        assert got == want
        log = (tmp_path / "agent" / "agent.log").read_text()
        assert re.search(r"holder \S+ failed \(UNAVAILABLE.*recomputing its rows here", log), log
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics") as r:
            metrics = r.read().decode()
        assert re.search(r'fallbacks_total\{from="route",to="local"\} [1-9]', metrics), metrics
        print(f"longest gap after the kill: {stall:.2f} s")
        assert stall <= STALL_S, f"sessions stalled {stall:.1f} s after the holder died"
    finally:
        for d in (agent, *holders, coord):
            if d.proc.poll() is None:
                d.stop()
