"""A running session follows its corpus's page table: a coordinator, 2 holders and a
``corpusd agent`` as real processes on loopback. The corpus is pinned whole on one holder; while
a session decodes, synthetic load reports (the holder's heartbeat, sent by the test) make the
leader add a load replica on the other holder. The agent re-reads the bound page table
(``--table-refresh-s``), adopts the new view between steps, and the session's later steps route
to the copy (its holder's Attend count rises from 0) while its tokens stay transformers'."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.testing.holders import pin_sample, start_holders
from corpusd.testing.oracle import greedy
from requester.client import Client
from requester.launch import start_agent
from tests.support.checks import metric

NEW = 128
SUFFIX = "\nQ: what is on line 41?"


def test_a_replica_added_while_a_session_decodes_serves_its_later_steps(
    tmp_path: Path, tiny_dir: Path, hf_model
) -> None:  # type: ignore[no-untyped-def]
    cid = pin_sample(tmp_path, tiny_dir, tokens=700)
    store = tmp_path / "store"
    n_pages = PageStore(store).manifest(cid).n_pages
    profile = tmp_path / "profile.json"
    profile.write_text('{"cp_buckets": [[null, 1]]}')  # the whole corpus on one holder
    co = start_coordinator(
        tmp_path / "coord", store, "--profile", str(profile), "--lease-s", "30",
        "--replica-window-s", "1", "--release-grace-s", "30",
    )  # fmt: skip
    hs = start_holders(
        store, tmp_path, tiny_dir, co.address, 2, "--capacity-tokens", "4096", "--threads", "1"
    )
    agent = start_agent(
        store, tmp_path / "agent", tiny_dir, "--coordinator", co.address, "--threads", "1",
        "--max-new-tokens", str(NEW), "--primitive", "route", "--table-refresh-s", "0.3",
    )  # fmt: skip
    attends, rereads = 'method="Attend"', "corpusd_requester_table_rereads_total"

    async def go() -> tuple[list[int], int | None]:
        async with CoordinatorClient(co.address) as cc:
            await cc.wait_holders(2)
            t = await cc.pin(cid)
            (src,) = t.holders
            dst_port = next(h.metrics_port for h in hs if h.address != t.address(src))
            adopted_at: list[int] = []
            got: list[int] = []

            async def make_hot() -> None:  # fan-in 20 past the elbow 8 until the copy is there
                hot = [(cid, p, 10) for p in range(n_pages)]
                deadline = time.monotonic() + 60
                while max(len(r) for r in (await cc.page_table(cid)).pages) < 2:
                    assert time.monotonic() < deadline, "no load replica within 60 s"
                    await cc.heartbeat(src, n_pages, 8, 8, 12, hot)
                    await asyncio.sleep(0.1)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the agent sees it at its next re-read
                    if metric(agent.metrics_port, rereads, 'result="changed"') >= 1:
                        adopted_at.append(len(got))
                        return
                    await asyncio.sleep(0.05)

            async with Client(agent=agent.address) as c:
                s = await c.open_session(cid, list(SUFFIX.encode()))
                assert metric(dst_port, "corpusd_holder_requests_total", attends) == 0
                hot: asyncio.Task[None] | None = None
                async for chunk in c.generate(s, max_tokens=NEW):
                    got += chunk.token_ids
                    if hot is None:
                        hot = asyncio.create_task(make_hot())
                assert hot is not None
                await asyncio.wait_for(hot, 60)
            return got, adopted_at[0] if adopted_at else None

    try:
        got, adopted_at = asyncio.run(go())
        # only this session attends: the copy's holder served its steps after the re-read
        served = [metric(h.metrics_port, "corpusd_holder_requests_total", attends) for h in hs]
        assert all(n > 0 for n in served), f"{served=}: the copy was never routed to"
        assert adopted_at is not None and adopted_at < NEW, f"{adopted_at=}"
        # transformers' greedy, checked by one forward over the session's tokens (oracle.py)
        corpus = PageStore(store).read_tokens(cid)
        ((want, _),) = greedy(hf_model, corpus, [SUFFIX], NEW, guess=[got])
        assert got == want
        log = (tmp_path / "agent" / "agent.log").read_text()
        assert log.count("bound corpus") == 1, "the session's corpus was bound again"
        assert "page table changed" in log
        assert metric(agent.metrics_port, rereads, 'result="unchanged"') > 0  # the cheap path
        assert metric(agent.metrics_port, "corpusd_requester_fallbacks_total") == 0
    finally:
        for d in (agent, *hs, co):
            d.stop()
