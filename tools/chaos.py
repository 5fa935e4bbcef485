"""Fault script (issue 20): while sessions run, SIGKILL or SIGSTOP/SIGCONT a random daemon
every few seconds for ``--minutes``, and check every finished session's tokens against a
reference decode made before any fault (same questions, same greedy decode, undisturbed).

The system is a coordinator (fixed port), ``--holders`` holders (the corpus on 2 replicas) and
``--agents`` agent workers, real processes on loopback. This script is also their supervisor:
a SIGKILLed daemon is started again (same state directory, so a holder comes back with its
pages and id) after ``--restart-s``, as systemd would; a SIGSTOPped one gets SIGCONT after 1–5
s. One daemon is disturbed at a time. The coordinator is a victim only with
``--coordinator-too`` (it is restarted on its port, with its SQLite state).

Sessions are opened by ``requester.Client`` through the coordinator (it retries OpenSession on
another worker and resumes a broken stream elsewhere). A session whose tokens differ from the
reference is WRONG (exit 1). A session that raised is FAILED, counted by its status and
explained by the events around it; the JSON lists every failure with the daemon events of
the seconds before it.

    python -m tools.chaos --minutes 10 --out bench/results/chaos-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpusd.daemon import Daemon

QUESTIONS = [f"\nQ: what is on line {i * 7 % 50}?\nA:" for i in range(8)]


@dataclass
class Member:
    """One supervised daemon: how to start it, the running process, its state."""

    name: str
    kind: str  # coordinator | holder | agent
    start: Any  # () -> Daemon
    proc: Daemon | None = None
    stopped: bool = False


@dataclass
class Chaos:
    members: list[Member]
    t0: float
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, member: str, what: str) -> None:
        with self.lock:
            self.events.append(
                {"t": round(time.monotonic() - self.t0, 2), "daemon": member, "event": what}
            )
        print(f"[{time.monotonic() - self.t0:7.1f}s] {member}: {what}", flush=True)

    def disturb(self, rng: random.Random, restart_s: float) -> None:
        """One fault on a random victim, then bring it back."""
        m = rng.choice(self.members)
        assert m.proc is not None
        if rng.random() < 0.5:
            m.proc.proc.send_signal(signal.SIGKILL)
            m.proc.proc.wait(30)
            self.log(m.name, "SIGKILL")
            time.sleep(restart_s)
            try:
                m.proc = m.start()
                self.log(m.name, f"restarted ({m.proc.address})")
            except Exception as e:  # counted: a daemon that cannot come back is a finding
                self.log(m.name, f"restart FAILED: {e}"[:300])
                time.sleep(2)
                m.proc = m.start()
                self.log(m.name, f"restarted on retry ({m.proc.address})")
        else:
            pause = rng.uniform(1, 5)
            m.proc.proc.send_signal(signal.SIGSTOP)
            self.log(m.name, f"SIGSTOP for {pause:.1f} s")
            time.sleep(pause)
            m.proc.proc.send_signal(signal.SIGCONT)
            self.log(m.name, "SIGCONT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(
    root: Path, model: Path, holders: int, agents: int, members: list[Member]
) -> tuple[list[Member], str, str]:
    """Start the system (into ``members``, so a failure can stop what started), pin a corpus
    on 2 replicas; returns (members, coordinator, corpus id)."""
    from corpusd.coordinator.client import CoordinatorClient
    from corpusd.coordinator.launch import start_coordinator
    from corpusd.corpus.config import PinConfig
    from corpusd.corpus.pin import pin
    from corpusd.testing.holders import text_tar
    from holder.launch import start_holder
    from requester.launch import start_agent

    store = root / "store"
    # ~1,500 byte tokens: a prefill of seconds on a shared 2-core CPU, 24 pages over 3 holders
    body = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(400))[:1500]
    cid = pin(PinConfig(corpus=str(text_tar(root / "repo.tar", body)), model=str(model),
                        store=str(store)),
              io.StringIO()).manifest.corpus_id  # fmt: skip
    port = free_port()
    coord_addr = f"127.0.0.1:{port}"

    def coordinator() -> Daemon:
        return start_coordinator(
            root / "coord", store, "--port", str(port), "--lease-s", "3", "--rpc-timeout-s", "10"
        )

    def holder(i: int) -> Any:
        return lambda: start_holder(
            store, root / f"holder-{i}", model, "--coordinator", coord_addr,
            "--capacity-tokens", "4096", "--threads", "1",
        )  # fmt: skip

    def agent(i: int) -> Any:
        return lambda: start_agent(
            store, root / f"agent-{i}", model, "--coordinator", coord_addr, "--report-s", "0.5",
            "--threads", "1", "--worker-id", f"agent-{i}",
        )  # fmt: skip

    members += [Member("coordinator", "coordinator", coordinator)]
    members += [Member(f"holder-{i}", "holder", holder(i)) for i in range(holders)]
    members += [Member(f"agent-{i}", "agent", agent(i)) for i in range(agents)]
    for m in members:
        m.proc = m.start()

    async def publish() -> None:
        async with CoordinatorClient(coord_addr) as cc:
            await cc.wait_holders(holders, 120)
            t = await cc.pin(cid, replicas=2, wait=True, timeout=120)
            assert t.corpus.state == "ready", t.corpus
            for _ in range(200):
                if sum(w.live for w in await cc.list_workers()) == agents:
                    return
                await asyncio.sleep(0.1)
            raise RuntimeError("agents did not report")

    asyncio.run(publish())
    return members, coord_addr, cid


@dataclass
class Tally:
    done: int = 0
    correct: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)
    reopened: int = 0


async def session(c: Any, cid: str, q: int, tokens: int) -> list[int]:
    s = await c.open_session(cid, QUESTIONS[q], reserve_tokens=tokens)
    got: list[int] = []
    async for ch in c.generate(s, max_tokens=tokens):
        got += ch.token_ids
    # the worker it ended on may be down now; the tokens are what counts
    with contextlib.suppress(Exception):
        await c.close_session(s)
    return got


async def runner(
    coord: str, cid: str, tokens: int, until: float, want: dict[int, list[int]],
    tally: Tally, chaos: Chaos, seed: int,
) -> None:  # fmt: skip
    from requester.client import Client

    rng = random.Random(seed)
    async with Client(coordinator=coord, timeout=60) as c:
        while time.monotonic() < until:
            q = rng.randrange(len(QUESTIONS))
            t = time.monotonic() - chaos.t0
            try:
                got = await asyncio.wait_for(session(c, cid, q, tokens), 180)
            except Exception as e:
                code = getattr(getattr(e, "code", None), "name", type(e).__name__)
                tally.codes[code] += 1
                now = time.monotonic() - chaos.t0
                with chaos.lock:
                    near = [ev for ev in chaos.events if t - 5 <= ev["t"] <= now]
                fail: dict[str, Any] = {"t": round(now, 1), "started": round(t, 1), "question": q}
                fail.update(error=str(e)[:300], events_during=near)
                tally.failed.append(fail)
                await asyncio.sleep(0.5)
                continue
            tally.done += 1
            tally.codes["OK"] += 1
            if got == want[q]:
                tally.correct += 1
            else:
                tally.wrong.append({"t": round(time.monotonic() - chaos.t0, 1), "question": q,
                                    "got": got, "want": want[q]})  # fmt: skip
        tally.reopened += c.reopened


async def reference(coord: str, cid: str, tokens: int) -> dict[int, list[int]]:
    from requester.client import Client

    async with Client(coordinator=coord) as c:
        outs = await asyncio.gather(*(session(c, cid, q, tokens) for q in range(len(QUESTIONS))))
    return dict(enumerate(outs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every-s", type=float, default=4.0, help="between faults (± 50 %%)")
    p.add_argument("--restart-s", type=float, default=1.0, help="a killed daemon's downtime")
    p.add_argument("--holders", type=int, default=3)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--sessions", type=int, default=4, help="concurrent session loops")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per session")
    p.add_argument("--coordinator-too", action="store_true", help="the coordinator is a victim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    from corpusd.model.tiny import init_tiny

    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so the finally below stops every daemon
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tmp = tempfile.TemporaryDirectory(prefix="chaos-")
    root = Path(tmp.name)
    init_tiny(root / "model")
    print(f"starting a coordinator, {a.holders} holders, {a.agents} agents in {root}", flush=True)
    members: list[Member] = []
    try:
        members, coord, cid = build(root, root / "model", a.holders, a.agents, members)
    except BaseException:
        _stop(members)
        tmp.cleanup()
        raise
    victims = [m for m in members if a.coordinator_too or m.kind != "coordinator"]
    chaos = Chaos(victims, time.monotonic())
    try:
        want = asyncio.run(reference(coord, cid, a.tokens))
        print(f"reference decode: {len(want)} questions × {a.tokens} tokens", flush=True)
        until = time.monotonic() + a.minutes * 60
        stop = threading.Event()

        def faults() -> None:
            rng = random.Random(a.seed)
            while not stop.is_set() and time.monotonic() < until:
                stop.wait(a.every_s * rng.uniform(0.5, 1.5))
                if not stop.is_set() and time.monotonic() < until:
                    chaos.disturb(rng, a.restart_s)

        th = threading.Thread(target=faults, daemon=True)
        th.start()
        tally = Tally()

        async def sessions() -> None:
            await asyncio.gather(*(
                runner(coord, cid, a.tokens, until, want, tally, chaos, a.seed * 1000 + i)
                for i in range(a.sessions)
            ))  # fmt: skip

        asyncio.run(sessions())
        stop.set()
        th.join(60)
        kinds = Counter(
            f"{e['daemon'].split('-')[0]} {e['event'].split()[0]}" for e in chaos.events
        )
        out = {
            "what": "sessions under SIGKILL / SIGSTOP of a random daemon; tokens vs an undisturbed "
            "reference decode",
            "command": "python -m tools.chaos " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "setup": {
                "holders": a.holders,
                "agents": a.agents,
                "replicas": 2,
                "concurrent_sessions": a.sessions,
                "tokens_per_session": a.tokens,
                "minutes": a.minutes,
                "every_s": a.every_s,
                "restart_s": a.restart_s,
                "coordinator_too": a.coordinator_too,
            },
            "faults": dict(sorted(kinds.items())),
            "sessions_finished": tally.done,
            "sessions_correct": tally.correct,
            "sessions_wrong": len(tally.wrong),
            "sessions_failed": len(tally.failed),
            "codes": dict(tally.codes),
            "client_open_retries": tally.reopened,
            "wrong": tally.wrong,
            "failed": tally.failed,
            "events": chaos.events,
        }
        print(
            json.dumps(
                {k: v for k, v in out.items() if k not in ("events", "failed", "wrong")}, indent=1
            )
        )
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {a.out}")
        return 1 if tally.wrong else 0
    finally:
        _stop(members)
        tmp.cleanup()


def _stop(members: list[Member]) -> None:
    for m in members:
        if m.proc is not None and m.proc.proc.poll() is None:
            m.proc.proc.send_signal(signal.SIGCONT)
            try:
                m.proc.stop(timeout=20)
            except Exception:
                m.proc.kill()


if __name__ == "__main__":
    sys.exit(main())
