"""Replicas that follow load, on a real coordinator and real holders: synthetic load reports (the
holder's heartbeat, sent by the test) keep one holder past its elbow; the leader copies its
hottest pages to the other holder, attention over the copy equals attention over the corpus, and
when the reports fall under half the elbow the copy leaves the page table and, a grace later, the
holder: a reader still routing by the older table is served meanwhile. Both state stores."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError, PageTable
from corpusd.coordinator.launch import start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.kernels.reference import partial_attention
from corpusd.testing.holders import start_holders, synthetic_corpus
from holder.launch import HolderProcess
from tests.procs.test_coordinator_failures import SCALE, held, route, until

HOT = {2: 100, 5: 50, 9: 7}  # page → hits
GRACE_S = 4.0


def counted(metrics_port: int, action: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    line = f'corpusd_coordinator_load_replicas_total{{action="{action}"}} '
    return next((float(x.split()[-1]) for x in text.decode().splitlines() if x.startswith(line)), 0)


async def _empty(h: HolderProcess) -> bool:
    return await held(h) == {}


def test_a_hot_holder_gets_a_replica_of_its_hottest_pages_and_loses_it_when_cool(
    tmp_path: Path, tiny_dir: Path, state_flags: tuple[str, ...]
) -> None:
    store = tmp_path / "store"
    cid = synthetic_corpus(store, tiny_dir, 600)  # 10 pages
    profile = tmp_path / "profile.json"
    profile.write_text('{"cp_buckets": [[null, 1]]}')  # the whole corpus on one holder
    flags = ("--profile", str(profile), "--lease-s", "30", "--replica-window-s", "1")
    flags += ("--release-grace-s", str(GRACE_S))
    co = start_coordinator(tmp_path / "coord", store, *flags, *state_flags)
    hs = start_holders(store, tmp_path, tiny_dir, co.address, 2, "--capacity-tokens", "1024")
    lat, _ = PageStore(store).read_pages(cid, 1, list(range(10)))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 64, 576, generator=g)
    pos = torch.tensor([[p * 64 + 3 for p in HOT] + [0, 599]] * 2)
    ref, _ = partial_attention(q, lat.reshape(-1, 576)[:600], pos, SCALE, 512)

    async def go() -> None:
        async with CoordinatorClient(co.address) as c:
            await c.wait_holders(2)
            t = await c.pin(cid)
            (src,) = t.holders
            (dst,) = {h.info.holder_id for h in await c.list_holders()} - {src}
            dst_proc = next(h for h in hs if h.address != t.address(src))

            async def report(fanin: int, until_replicas: int) -> PageTable:
                deadline = time.monotonic() + 20
                while True:
                    hot = [(cid, p, n) for p, n in HOT.items()] if fanin else []
                    # the instant's count says idle; the time-averaged fan-in is what counts
                    await c.heartbeat(src, 10, 0, 8, 0, hot, fanin_mean=float(fanin))
                    table = await c.page_table(cid)
                    if max(len(r) for r in table.pages) == until_replicas:
                        return table
                    assert time.monotonic() < deadline, f"no change to {until_replicas} replicas"
                    await asyncio.sleep(0.2)

            with pytest.raises(CoordinatorError, match="fanin_mean: nan"):
                await c.heartbeat(src, 10, 0, 8, 0, [], fanin_mean=float("nan"))
            t2 = await report(20, 2)  # fan-in 20 past the elbow 8
            assert {p for p, r in enumerate(t2.pages) if len(r) == 2} == set(HOT)
            assert all(r[0] == t.pages[p][0] for p, r in enumerate(t2.pages))  # source kept
            assert await held(dst_proc) == {cid: t2.frames_on(dst)}
            out = await route(t2, cid, q, pos, replica=-1)  # the hot rows through the copy
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
            assert counted(co.metrics_port, "added") == 1
            status = {h.info.holder_id: h for h in await c.list_holders()}
            assert status[dst].placed_frames == len(HOT)

            t3 = await report(2, 1)  # under half the elbow: the copy leaves the page table
            removed = time.monotonic()
            assert t3.pages == t.pages and counted(co.metrics_port, "removed") == 1
            # a reader that has not re-read the table still routes to the copy: served
            out = await route(t2, cid, q, pos, replica=-1)
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
            assert time.monotonic() - removed < GRACE_S, "too slow to test the grace"
            await until(lambda: _empty(dst_proc), timeout=GRACE_S + 10)
            assert time.monotonic() - removed >= GRACE_S - 0.5, "released before its grace"

    try:
        asyncio.run(go())
        log_path = tmp_path / "coord" / "coordinator.log"
        deadline = time.monotonic() + 10  # the holder frees the frames before the leader logs it
        while "load replica released" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = log_path.read_text()
        assert "load replica added: 3 hot pages" in log and "load replica removed" in log
        assert "load replica released: 3 pages" in log
    finally:
        assert [h.stop() for h in hs] == [0, 0]
        assert co.stop() == 0
