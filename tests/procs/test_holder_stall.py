"""A holder SIGKILLed under decoding sessions, its pages on no other holder (one replica): the
sessions on it stall at most 2 s before they go on (issue 37, item 5), token-identical, and the
fallback is logged and counted. The stall was the local recompute of the corpus (42 s in the
issue; 47 s for these 1,500 tokens at load 18): the agent now reads the dead holder's pages
from the page store it shares with the holders. A SIGSTOPped holder (accepts, never answers)
is bounded the same way, by the agent's per-step holder deadline."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.launch import start_coordinator
from corpusd.daemon import Daemon
from corpusd.testing.holders import pin_sample
from holder.launch import HolderProcess, start_holder
from requester.client import Client
from requester.launch import start_agent

QUESTIONS = ["\nQ: where?", "\nQ: how many lines?"]
NEW = 24
STALL_S = 2.0


async def _streams(
    c: Client, cid: str, kill: Callable[[], None] | None = None
) -> tuple[list[list[int]], list[float], list[float]]:
    """Each question's greedy tokens, and the gaps between two chunks of one stream before and
    after ``kill()`` (called once every stream has yielded 4 tokens)."""
    sessions = [await c.open_session(cid, q) for q in QUESTIONS]
    got: list[list[int]] = [[] for _ in sessions]
    killed_at: list[float] = []
    before: list[float] = []
    after: list[float] = []

    async def one(i: int) -> None:
        last = 0.0
        async for ch in c.generate(sessions[i], max_tokens=NEW):
            now = time.monotonic()
            if killed_at:
                after.append(now - max(last, killed_at[0]))
            elif last:
                before.append(now - last)
            last = now
            got[i] += ch.token_ids
            if kill is not None and not killed_at and all(len(g) >= 4 for g in got):
                killed_at.append(time.monotonic())
                kill()

    await asyncio.gather(*(one(i) for i in range(len(sessions))))
    for s in sessions:
        await c.close_session(s)
    return got, before, after


@dataclass
class Stall:
    """What one run saw: each question's tokens undisturbed and with the fault, the gaps
    between chunks before and after it, the agent's log and metrics."""

    want: list[list[int]]
    got: list[list[int]]
    before: list[float]
    after: list[float]
    log: str
    metrics: str

    def check(self, code: str) -> None:
        assert self.got == self.want
        pattern = rf"holder \S+ failed \({code}.*from the page store here"
        assert re.search(pattern, self.log), self.log
        fell = r'fallbacks_total\{from="route",to="store"\} [1-9]'
        assert re.search(fell, self.metrics), self.metrics
        # the stall: the longest gap after the fault beyond the slowest step before it (on a
        # loaded 2-core machine a step alone can take a second)
        stall = max(self.after) - max(self.before)
        gaps = f"before the fault up to {max(self.before):.2f} s, after {max(self.after):.2f} s"
        print(f"gaps {gaps}")
        assert stall <= STALL_S, (
            f"sessions stalled {stall:.1f} s after the holder's {code} (gaps before "
            f"{self.before}, after {self.after})"
        )


def _run(tmp_path: Path, tiny_dir: Path, fault: int) -> Stall:
    """Two holders, the corpus on one replica, two streams; ``fault`` (a signal) sent to the
    holder of page 0 once every stream has 4 tokens. A stopped holder is continued before
    everything is stopped, whatever fails."""
    cid = pin_sample(tmp_path, tiny_dir, tokens=1500)
    slow = 600  # seconds to start, on the shared 2-core machine at load 20
    coord = start_coordinator(tmp_path / "coord", tmp_path / "store", timeout=slow)
    running: list[Daemon] = [coord]  # stopped at the end, whatever fails
    victim: list[HolderProcess] = []
    try:
        with ThreadPoolExecutor(2) as ex:
            started = [
                ex.submit(
                    start_holder,
                    tmp_path / "store",
                    tmp_path / f"h{i}",
                    tiny_dir,
                    "--coordinator",
                    coord.address,
                    "--capacity-tokens",
                    "2048",
                    timeout=slow,
                )
                for i in range(2)
            ]
            holders = [f.result() for f in started]
        running += holders
        # route forced: left to the predicate (auto), a loaded machine's slow holder calls
        # can make it fetch or recompute instead, and a stopped holder is then never called
        # (a CI run saw no failure and no fallback at all)
        agent = start_agent(
            tmp_path / "store", tmp_path / "agent", tiny_dir, "--coordinator", coord.address,
            "--threads", "1", "--max-new-tokens", "64", "--primitive", "route", timeout=slow,
        )  # fmt: skip
        running.append(agent)

        async def go() -> tuple[list[list[int]], list[list[int]], list[float], list[float]]:
            async with CoordinatorClient(coord.address) as cc:
                await cc.wait_holders(2)
                table = await cc.pin(cid, replicas=1, wait=True, timeout=120)
                assert all(len(page) == 1 for page in table.pages), "one replica"
                first = table.address(table.pages[0][0][0])  # holds page 0, at least
                victim.extend(h for h in holders if h.address == first)
            async with Client(agent=agent.address) as c:
                want, _, _ = await _streams(c, cid)
                got, before, after = await _streams(
                    c, cid, lambda: victim[0].proc.send_signal(fault)
                )
            return want, got, before, after

        want, got, before, after = asyncio.run(go())
        if fault == signal.SIGKILL:
            assert victim[0].proc.poll() is not None, "the holder was killed mid-stream"
        log = (tmp_path / "agent" / "agent.log").read_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics") as r:
            metrics = r.read().decode()
        return Stall(want, got, before, after, log, metrics)
    finally:
        for v in victim:  # nothing is left frozen
            if v.proc.poll() is None:
                v.proc.send_signal(signal.SIGCONT)
        for d in reversed(running):
            if d.proc.poll() is None:
                d.stop()


def test_a_killed_single_replica_holder_stalls_its_sessions_at_most_2_s(
    tmp_path: Path, tiny_dir: Path
) -> None:
    _run(tmp_path, tiny_dir, signal.SIGKILL).check("UNAVAILABLE")


def test_a_stopped_single_replica_holder_stalls_its_sessions_at_most_2_s(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """SIGSTOP: the holder's kernel still accepts and its connection stays up, but nothing
    answers. Only the agent's per-step deadline (--holder-deadline-s, 1 s) bounds the stall;
    before it, the 60 s --rpc-timeout-s did."""
    _run(tmp_path, tiny_dir, signal.SIGSTOP).check("DEADLINE_EXCEEDED")
