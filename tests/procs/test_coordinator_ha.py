"""Several coordinators on one etcd cluster: a real 3-member etcd on loopback, 2 coordinators,
2 holders that know both. The leader is SIGKILLed in the middle of a publish; the standby must
lead within the lease plus 2 s, no reader may ever see a half-published corpus, and the pin the
client retries (it fails over by itself) must succeed with nothing of the first attempt left.
Then the etcd leader is SIGKILLed: the page table stays, and reads and writes go on. Sessions
decoding through both kills give transformers' greedy tokens, every one."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from corpusd.coordinator.client import CoordinatorClient, CoordinatorError
from corpusd.coordinator.etcd_local import etcd_binary, start_etcd
from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator
from corpusd.corpus.store import PageStore
from corpusd.testing.holders import pin_sample, start_holders, synthetic_corpus
from corpusd.testing.oracle import greedy
from requester.client import Client
from requester.launch import start_agent
from tests.procs.test_coordinator_failures import held, until

pytestmark = pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd binary: apt-get install etcd-server"
)
LEASE_S = 2


def leads(co: CoordinatorProcess) -> bool:
    url = f"http://127.0.0.1:{co.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return "\ncorpusd_coordinator_leader 1.0" in text


def test_leader_killed_mid_publish_standby_takes_over_and_the_retried_pin_succeeds(
    tmp_path: Path, tiny_dir: Path
) -> None:
    store = tmp_path / "store"
    cid = synthetic_corpus(store, tiny_dir, 1050)  # 17 pages
    etcd = start_etcd(tmp_path / "etcd", 3)
    # holders' leases outlast the SIGSTOP below under any load (a stopped holder whose lease
    # ran out before the pin arrived would be refused: replicas 2 > 1 live); the leader's is short
    flags = ("--state", etcd.url("ha"), "--leader-lease-s", str(LEASE_S), "--lease-s", "30")
    flags += ("--retry-s", "0.2")
    cos = [start_coordinator(tmp_path / f"c{i}", store, *flags) for i in range(2)]
    both = ",".join(c.address for c in cos)
    hs = start_holders(store, tmp_path, tiny_dir, both, 2, "--capacity-tokens", "2048")
    seen: list[str] = []  # every state a reader saw, and a failure if a table was partial

    async def watch(stop: asyncio.Event) -> None:
        """Read the page table from each coordinator on its own, until stopped."""
        clients = [CoordinatorClient(c.address, timeout=2) for c in cos]
        while not stop.is_set():
            for c in clients:
                try:
                    t = await c.page_table(cid)
                except CoordinatorError as e:
                    seen.append(e.code.name)  # NOT_FOUND, FAILED_PRECONDITION (not ready), …
                    continue
                full = len(t.pages) == 17 and all(len(r) == 2 for r in t.pages)
                seen.append("ready" if full else f"PARTIAL {t.pages}")
            await asyncio.sleep(0.02)
        for c in clients:
            await c.close()

    async def go() -> float:
        async with CoordinatorClient(both, timeout=30) as c:
            await until(lambda: asyncio.to_thread(leads, cos[0]), 20)  # the first one started
            await c.wait_holders(2)
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            os.kill(hs[1].proc.pid, signal.SIGSTOP)  # its Assign hangs: the publish is in flight
            # wait: the retry may queue until heartbeats show the first attempt's frames freed
            pin = asyncio.create_task(c.pin(cid, replicas=2, wait=True, timeout=30))

            async def publishing() -> bool:
                states = {x.corpus_id: x.state for x in await c.list_corpora()}
                return states.get(cid) == "pinning" and cid in await held(hs[0])

            await until(publishing, task=pin)
            cos[0].kill()  # SIGKILL, mid-publish
            t0 = time.monotonic()
            os.kill(hs[1].proc.pid, signal.SIGCONT)
            await until(lambda: asyncio.to_thread(leads, cos[1]), LEASE_S + 10)
            takeover = time.monotonic() - t0
            t = await pin  # the client failed over and retried by itself
            assert t.corpus.state == "ready", t.corpus
            assert len(t.pages) == 17 and all(len(r) == 2 for r in t.pages)
            for h in hs:  # exactly the new table's frames: the first attempt left nothing
                hid = next(i for i, x in t.holders.items() if x.address == h.address)
                assert await held(h) == {cid: t.frames_on(hid)}

            # the etcd leader dies: reads and writes go on, the page table is unchanged
            etcd.kill(etcd.leader())
            await asyncio.sleep(1.5)
            assert (await c.page_table(cid)).pages == t.pages
            assert await c.unpin(cid) == 34
            # the freed frames reach the leader with the holders' next heartbeats: until then a
            # pin queues (a loaded CI machine answered "queued" here), so wait for it
            again = await c.pin(cid, replicas=2, wait=True, timeout=30)
            assert again.corpus.state == "ready", again.corpus
            stop.set()
            await watcher
            return takeover

    try:
        takeover = asyncio.run(go())
        assert takeover <= LEASE_S + 2, f"{takeover=:.2f} s"
        assert not [s for s in seen if s.startswith("PARTIAL")], seen
        assert "ready" in seen and "FAILED_PRECONDITION" in seen  # saw it pinning, then ready
        log = (tmp_path / "c1" / "coordinator.log").read_text()
        assert "leading: 1 half-done pins rolled back" in log, log[-2000:]
    finally:
        for h in hs:
            if h.proc.poll() is None:
                os.kill(h.proc.pid, signal.SIGCONT)
                h.stop()
        for co in cos:
            if co.proc.poll() is None:
                co.stop()
        etcd.stop()


SUFFIXES = ["\nQ0: what is on line 0?", "\nQ1: what is on line 41?"]
NEW = 12


def test_sessions_decoding_through_a_leader_kill_and_an_etcd_leader_kill_lose_no_token(
    tmp_path: Path,
    tiny_dir: Path,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    cid = pin_sample(tmp_path, tiny_dir, tokens=400)
    store = tmp_path / "store"
    etcd = start_etcd(tmp_path / "etcd", 3)
    flags = ("--state", etcd.url("dec"), "--leader-lease-s", str(LEASE_S), "--lease-s", "8")
    cos = [start_coordinator(tmp_path / f"c{i}", store, *flags) for i in range(2)]
    both = ",".join(c.address for c in cos)
    hs = start_holders(store, tmp_path, tiny_dir, both, 2, "--capacity-tokens", "2048",
                       "--threads", "1")  # fmt: skip
    agent = start_agent(store, tmp_path / "agent", tiny_dir, "--coordinator", both,
                        "--report-s", "0.3", "--threads", "1", "--primitive", "route")  # fmt: skip

    async def go() -> list[list[int]]:
        async with CoordinatorClient(both, timeout=30) as cc:
            await until(lambda: asyncio.to_thread(leads, cos[0]), 20)
            await cc.wait_holders(2)
            assert (await cc.pin(cid, replicas=2, wait=True, timeout=60)).corpus.state == "ready"
        async with Client(coordinator=both) as c:
            s = await c.open_session("repo", list(SUFFIXES[0].encode()))
            first: list[int] = []
            async for chunk in c.generate(s, max_tokens=NEW):
                first += chunk.token_ids
                if len(first) >= 3 and cos[0].proc.poll() is None:
                    cos[0].kill()  # the leader coordinator dies while the session decodes
                if len(first) >= 6 and len(etcd.procs) == 3 and all(etcd.procs):
                    etcd.kill(etcd.leader())  # and then etcd's leader
            assert cos[0].proc.poll() is not None and None in etcd.procs, "decoded too fast"
            # a session opened now is placed by the standby once it leads
            late = await c.open_session("repo", list(SUFFIXES[1].encode()))
            return [first, list((await c.complete(late, max_tokens=NEW)).token_ids)]

    try:
        got = asyncio.run(go())
        toks = PageStore(store).read_tokens(cid)
        assert got == [t for t, _ in greedy(hf_model, toks, SUFFIXES, NEW, guess=got)]
    finally:
        for d in (agent, *hs, *cos):
            if d.proc.poll() is None:
                d.stop()
        etcd.stop()
