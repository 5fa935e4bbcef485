"""Soak (issue 37): one run of ``--minutes`` against ``corpusd up`` (TLS, the default secure
up) with sessions opening, generating and closing all the time and faults, single and
overlapping, injected throughout; then the checks a week of operation needs.

Load: ``--sessions`` loops open a session, decode ``--tokens`` greedy tokens and close it; a
share (``--abandon``) is left open without CloseSession, to be expired by the agent. ``up``
runs with ``--session-idle-s 60`` (it passes that to its agent): sessions are abandoned only
while at least 120 s of the run are left, and the end waits up to 120 s for the rest (those a
fault cut off mid-generate) to expire.

The agent routes (``--primitive route``, passed as ``up --agent-primitive``): every decode
step asks the holders, so a fault between the agent and a holder reaches the sessions. With
``auto`` the predicate fetches this small corpus once and serves it from the agent's page
cache, and faults of the holders then seldom reach a session.

Faults (counted by kind, each with its window in the JSON), from two fault threads so they
overlap:

- ``kill:<daemon>`` / ``stop:<daemon>``: SIGKILL, or SIGSTOP for 1–5 s then SIGCONT, of any
  daemon of ``corpusd ps``, ``up`` (the supervisor) included; a killed ``up`` is followed by
  ``corpusd up --detach 1`` again (it stops the daemons the dead one left and starts new ones);
- ``replicas_down``: two holders SIGKILLed at once (3 holders, the corpus on 2 replicas: the
  pages those two share have no live replica until the supervisor restarts them);
- ``coordinator_holder``: the coordinator and a holder SIGKILLed together;
- ``corrupt``: one byte of a stored page flipped on disk while it is served and a holder
  SIGKILLed so that it loads its pages from the damaged file; the byte is restored after;
- ``net_delay:<link>`` / ``net_drop:<link>`` / ``net_reset:<link>``: a TCP proxy delays,
  partitions (nothing passes until it heals) or resets (RST) the traffic to one daemon for
  1–4 s. Proxies sit in front of the coordinator (the holders and the agent dial it: ``up
  --coordinator-advertise``), of each holder (the agent and the coordinator dial it: ``up
  --holder-advertise``, which each holder registers as its address) and of the agent (the
  soak's clients dial it). TLS passes through them end to end.

Checks (exit 1 when one fails): every finished session's tokens equal a reference decode made
before any fault; every failed session overlaps a fault window that removed every copy of its
data (the agent, the only holder of a session's cache, killed or its clients cut off by a
partition or resets; ``up`` restarted), or windows open together that took from the agent
every holder of a replica of one of its pages (killed, stopped, partitioned or reset, in any
mix; the placement is read from the coordinator). A delay removes nothing, nor does a fault on
the coordinator's link: a session failing then is a defect; RSS growth per daemon after the
first ``--warmup-min`` minutes < 10 % (measured on each incarnation that lived long enough:
the ``--spare`` daemons are SIGKILLed only during the warm-up, so one of each lives the rest
of the run); the agent's open sessions back to 0 after load stops; file descriptors per
daemon at the end within a slack of those at the start; after ``corpusd down``, no daemon
left and no stray files in the state dirs.

    python -m tools.soak --minutes 60 --out bench/results/soak-cpu.json
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
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpusd.testing.holders import text_tar
from corpusd.testing.tcp_proxy import Proxy

QUESTIONS = [f"\nQ: what is on line {i * 7 % 50}?\nA:" for i in range(8)]
GRACE_S = 5.0  # a failure this long after a fault window closed is still the fault's
SKEW_S = 0.5  # a fault's window opens just before it acts, read from another thread
FD_SLACK = 16  # gRPC channels and thread pools come and go; a leak grows without bound
RSS_LIMIT = 0.10
IDLE_S = 60.0  # up's --session-idle-s, which it passes to its agent
#: faults that remove every copy of a session's data on their own: its cache lives on the agent
#: alone (killed, or the client cut off it by a partition or resets); a restarted ``up``
#: restarts every daemon
REMOVES_ALL = ("kill:agent", "kill:up", "net_drop:agent", "net_reset:agent")
#: faults that take holders from the agent while they last (killed, stopped, partitioned off or
#: reset): a failure is theirs when the holders taken at one moment held every replica of a
#: page. A delay takes none, nor does a fault on the coordinator's link.
CUTS = ("kill:", "stop:", "net_drop:", "net_reset:", "replicas_down", "coordinator_holder",
        "corrupt")  # fmt: skip
REJOIN_S = 1.0  # after its window, a holder's channels reconnect before the agent uses it again


# ---- the pure part: attribution and summaries (tests/unit/test_soak.py) ----


def removes_all(kind: str) -> bool:
    return kind in REMOVES_ALL


def cut_of(fault: dict[str, Any]) -> frozenset[str]:
    """The holders a fault window takes from the agent while it lasts: those it names in
    ``holders`` (else the one in its kind, ``kill:holder-0``), for the kinds of ``CUTS``."""
    if not fault["kind"].startswith(CUTS):
        return frozenset()
    named = fault.get("holders") or [fault["kind"].split(":", 1)[-1]]
    return frozenset(h for h in named if h.startswith("holder"))


def explain(
    fail: dict[str, Any],
    faults: list[dict[str, Any]],
    grace: float = GRACE_S,
    pages: list[list[str]] | None = None,
) -> str:
    """The fault (``kind``, ``t0``, ``t1`` seconds) that removed every copy of a failed
    session's data while it ran (``started``..``t``), as "kind@t0", or the faults that did it
    together, "kind@t0+kind@t0": those whose windows overlapped while the holders they took
    (:func:`cut_of`) held every replica of a page of ``pages`` (each page's holders; None:
    any two holders, as 3 holders with 2 replicas share pages). Of several, the latest to
    begin among those still open when it failed, else the latest to begin; "" when none did.
    A window still open (``t1`` None) reaches to the end."""
    near_ = near(fail, faults, grace)
    found = [([f], float(f["t0"]), _end(f)) for f in near_ if removes_all(f["kind"])]
    found += _cuts(fail, [f for f in near_ if cut_of(f)], grace, pages)
    active = [c for c in found if c[2] + SKEW_S >= fail["t"]]
    pick = active or found
    if not pick:
        return ""
    members = max(pick, key=lambda c: c[1])[0]
    return "+".join(f"{f['kind']}@{f['t0']}" for f in members)


def _cuts(
    fail: dict[str, Any],
    faults: list[dict[str, Any]],
    grace: float,
    pages: list[list[str]] | None,
) -> list[tuple[list[dict[str, Any]], float, float]]:
    """Each set of ``faults`` open together, at the start of one of them or of the session,
    whose holders held every replica of a page: (faults by start, when the last began, when
    the first ended)."""
    lo, hi = fail["started"] - grace, fail["t"] + SKEW_S
    out = []
    for x in sorted({min(max(float(f["t0"]), lo), hi) for f in faults}):
        on = [f for f in faults if f["t0"] - SKEW_S <= x <= _end(f) + REJOIN_S]
        taken = frozenset().union(*(cut_of(f) for f in on))
        every = any(set(p) <= taken for p in pages) if pages is not None else len(taken) >= 2
        if on and every:
            out.append((on, max(float(f["t0"]) for f in on), min(_end(f) for f in on)))
    return out


def _end(f: dict[str, Any]) -> float:
    return float("inf") if f.get("t1") is None else float(f["t1"])


def near(
    fail: dict[str, Any], faults: list[dict[str, Any]], grace: float = GRACE_S
) -> list[dict[str, Any]]:
    """Every fault window that overlapped the session (``started - grace``..``t``), by start;
    ``SKEW_S`` allows for the fault and the session reading the clock in different threads."""
    out = [
        f for f in faults if f["t0"] <= fail["t"] + SKEW_S and _end(f) + grace >= fail["started"]
    ]
    return sorted(out, key=lambda f: f["t0"])


def rss_growth(
    samples: list[tuple[float, int, int]], warmup_s: float, min_span_s: float = 60.0
) -> dict[str, Any]:
    """RSS growth of one daemon from ``samples`` (t seconds, pid, rss bytes): for each pid
    (incarnation) that lived ≥ ``warmup_s + min_span_s``, last / first-after-warmup - 1. The
    worst is ``growth`` (None when no incarnation lived that long)."""
    by_pid: dict[int, list[tuple[float, int]]] = {}
    for t, pid, rss in samples:
        by_pid.setdefault(pid, []).append((t, rss))
    growths = []
    for s in by_pid.values():
        t_start = s[0][0]
        if s[-1][0] - t_start < warmup_s + min_span_s:
            continue
        base = next(r for t, r in s if t - t_start >= warmup_s)
        growths.append(s[-1][1] / base - 1)
    mb = [r / 2**20 for _, _, r in samples]
    return {
        "incarnations": len(by_pid),
        "measured": len(growths),
        "growth": round(max(growths), 4) if growths else None,
        "rss_mb_first": round(mb[0], 1) if mb else None,
        "rss_mb_last": round(mb[-1], 1) if mb else None,
        "rss_mb_max": round(max(mb), 1) if mb else None,
        "samples": len(samples),
    }


def checks(s: dict[str, Any]) -> dict[str, bool]:
    """Each check of a summary ``s`` (the JSON's fields) and whether it passed."""
    return {
        "no wrong tokens": s["sessions_wrong"] == 0,
        "every failure explained": s["sessions_failed"] == s["sessions_explained"],
        "sessions finished": s["sessions_ok"] > 0,
        "rss growth < 10 %": all(
            r["growth"] is None or r["growth"] < RSS_LIMIT for r in s["rss"].values()
        ),
        "open sessions back to 0": s["open_sessions_end"] == 0,
        "no leaked fds": all(
            f["end"] is None or f["start"] is None or f["end"] <= f["start"] + FD_SLACK
            for f in s["fds"].values()
        ),
        "no daemon left after down": not s["left_running"],
        "no stray files": not s["stray_files"],
    }


def table(s: dict[str, Any]) -> str:
    lines = [f"soak: {s['minutes']} min, faults {sum(s['faults'].values())}: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["faults"].items()))]  # fmt: skip
    lines.append(
        f"sessions ok {s['sessions_ok']}, wrong {s['sessions_wrong']}, failed "
        f"{s['sessions_failed']} (explained {s['sessions_explained']}), abandoned "
        f"{s['sessions_abandoned']}; open at end {s['open_sessions_end']}"
    )
    lines.append(f"{'daemon':<14}{'rss MB first':>13}{'last':>8}{'growth':>9}{'fd start':>10}"
                 f"{'end':>6}")  # fmt: skip
    for name, r in sorted(s["rss"].items()):
        g = "-" if r["growth"] is None else f"{100 * r['growth']:.1f}%"
        f = s["fds"].get(name, {})
        lines.append(f"{name:<14}{r['rss_mb_first']!s:>13}{r['rss_mb_last']!s:>8}{g:>9}"
                     f"{f.get('start')!s:>10}{f.get('end')!s:>6}")  # fmt: skip
    if s.get("up_restart_failures"):
        lines.append(f"corpusd up refused to start again: {s['up_restart_failures']}")
    for name, ok in checks(s).items():
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return "\n".join(lines)


# ---- the system: corpusd up, its daemons, a proxy ----


def corpusd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corpusd", *args], capture_output=True, text=True, timeout=timeout
    )


def daemons(root: Path) -> dict[str, int]:
    """name → pid of every running daemon of the ``up`` in ``root``, ``up`` included."""
    from corpusd import ps

    return {p.name: p.pid for p in ps.processes(root) if p.running and p.pid}


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def corrupt_page(store: Path, cid: str, layer: int, page: int) -> Path:
    """Flip one byte of ``page`` of layer ``layer``'s latent tensor (again restores it)."""
    from corpusd.corpus.store import layer_file

    path = store / "corpora" / cid / layer_file(layer)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])["latent"]
    size = {"F32": 4, "BF16": 2}[entry["dtype"]]
    off = 8 + n + entry["data_offsets"][0] + page * entry["shape"][1] * entry["shape"][2] * size
    with path.open("r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 1]))
    return path


@dataclass
class Faults:
    root: Path
    t0: float
    store: Path = Path()
    cid: str = ""
    proxies: dict[str, Proxy] = field(default_factory=dict)  # by link: agent, coordinator, …
    windows: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    busy: set[str] = field(default_factory=set)  # daemons a fault holds now: no two at once
    spare: frozenset[str] = frozenset()  # SIGKILLed only in the first spare_after_s
    spare_after_s: float = 0.0
    up_flags: tuple[str, ...] = ()  # beside "up --detach 1 --calibrate off"

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def open(self, kind: str, note: str = "", holders: list[str] | None = None) -> dict[str, Any]:
        w = {"kind": kind, "t0": self.now(), "t1": None, "note": note}
        if holders:
            w["holders"] = [h for h in holders if h.startswith("holder")]
        with self.lock:
            self.windows.append(w)
        print(f"[{w['t0']:7.1f}s] fault {kind} {note}", flush=True)
        return w

    def close(self, w: dict[str, Any]) -> None:
        w["t1"] = self.now()

    def claim(self, names: list[str]) -> bool:
        with self.lock:
            if self.busy & set(names):
                return False
            self.busy |= set(names)
            return True

    def release(self, names: list[str]) -> None:
        with self.lock:
            self.busy -= set(names)

    def wait_back(self, names: list[str], old: dict[str, int], timeout: float = 240) -> None:
        """Until every one of ``names`` runs with a pid other than ``old``'s and serves (its
        endpoint.json, written once it listens, names that pid)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = daemons(self.root)
            if all(d.get(n, 0) not in (0, old.get(n)) and self.serving(n, d[n]) for n in names):
                return
            time.sleep(0.5)
        print(f"  {names} not back in {timeout} s", flush=True)

    def serving(self, name: str, pid: int) -> bool:
        if name == "up":
            return True
        try:
            return bool(json.loads((self.root / name / "endpoint.json").read_text())["pid"] == pid)
        except (OSError, ValueError, KeyError):
            return False

    def kill(self, names: list[str], kind: str) -> None:
        old = daemons(self.root)
        w = self.open(kind, ",".join(names), names)
        for n in names:
            with contextlib.suppress(ProcessLookupError, KeyError):
                os.kill(old[n], signal.SIGKILL)
        if "up" in names:  # the daemons it left run on; a new up stops them and starts its own
            time.sleep(1)
            for _ in range(3):  # a refusal is a finding (kept in the window); then again
                r = corpusd("up", "--detach", "1", "--calibrate", "off", *self.up_flags,
                            timeout=600)  # fmt: skip
                if r.returncode == 0:
                    break
                err = (r.stdout + r.stderr).strip().splitlines()[-1:]
                w.setdefault("up_failures", []).append(err[0] if err else f"rc {r.returncode}")
                print(f"  up again FAILED: {r.stdout[-2000:]}{r.stderr[-2000:]}", flush=True)
                time.sleep(2)
            self.wait_back(["coordinator", "agent"] + [n for n in old if n.startswith("holder")],
                           old)  # fmt: skip
        else:
            self.wait_back(names, old)
        self.close(w)

    def stop(self, name: str, rng: random.Random) -> None:
        pid = daemons(self.root).get(name)
        if not pid:
            return
        pause = rng.uniform(1, 5)
        w = self.open(f"stop:{name}", f"{pause:.1f} s", [name])
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.close(w)

    def corrupt(self, holder: str, rng: random.Random) -> None:
        """Flip a byte of a stored page and SIGKILL ``holder``, so it loads its pages again
        from the damaged file (the store fallback reads it too) while the other replica
        serves; the byte is restored after 5–15 s."""
        layer, page = rng.randrange(2), rng.randrange(4)
        old = daemons(self.root)
        w = self.open("corrupt", f"layer {layer} page {page}, {holder} reloads", [holder])
        path = corrupt_page(self.store, self.cid, layer, page)
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(old[holder], signal.SIGKILL)
        time.sleep(rng.uniform(5, 15))
        corrupt_page(self.store, self.cid, layer, page)  # restored
        self.wait_back([holder], old)
        self.close(w)
        w["file"] = str(path)

    def net(self, mode: str, link: str, rng: random.Random) -> None:
        """``mode`` on the proxy in front of ``link`` (the agent: the clients' link; a holder:
        the agent's and the coordinator's; the coordinator: the holders' and the agent's) for
        1–4 s."""
        held, delay = rng.uniform(1, 4), rng.uniform(0.05, 0.5)
        note = f"{held:.1f} s" + (f", {delay:.2f} s a chunk" if mode == "delay" else "")
        w = self.open(f"net_{mode}:{link}", note, [link])
        self.proxies[link].set(mode, delay_s=delay)
        time.sleep(held)
        self.proxies[link].set("pass")
        self.close(w)

    def one(self, rng: random.Random, forced: tuple[str, list[str]] | None = None) -> bool:
        """A random fault, or ``forced`` (act, victims); skipped (False) when another fault
        holds one of its victims."""
        names = sorted(daemons(self.root))
        # the spared live on after the warm-up, so that their RSS growth can be measured
        killable = [n for n in names if self.now() < self.spare_after_s or n not in self.spare]
        holders = [n for n in killable if n.startswith("holder")]
        r = rng.random()
        if r < 0.2 and names:
            victim, act = [rng.choice(names)], "stop"
        elif r < 0.35 and killable:
            victim, act = [rng.choice(killable)], "kill"
        elif r < 0.5 and len(holders) >= 2:
            victim, act = rng.sample(holders, 2), "replicas_down"
        elif r < 0.6 and holders and "coordinator" in killable:
            victim, act = ["coordinator", rng.choice(holders)], "coordinator_holder"
        elif r < 0.7 and holders:
            victim, act = ["store", rng.choice(holders)], "corrupt"
        else:
            victim = ["link:" + rng.choice(sorted(self.proxies))]
            act = "net_" + rng.choice(["delay", "drop", "reset"])
        if forced is not None:
            act, victim = forced
        # up's restart touches every daemon: it goes alone; others wait for it
        links = [f"link:{n}" for n in self.proxies]
        claim = [*names, *links, "store"] if "up" in victim and act == "kill" else victim
        if not self.claim(claim):
            return False
        try:
            if act == "kill":
                self.kill(victim, f"kill:{victim[0]}")
            elif act == "stop":
                self.stop(victim[0], rng)
            elif act in ("replicas_down", "coordinator_holder"):
                self.kill(victim, act)
            elif act == "corrupt":
                self.corrupt(victim[1], rng)
            else:
                self.net(act[4:], victim[0].removeprefix("link:"), rng)
        finally:
            self.release(claim)
        return True


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """``n`` free ports below the kernel's ephemeral range: a fixed port inside it can be
    taken as the local port of an outgoing connection while its daemon restarts."""
    rng = rng or random.Random()
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


# fixed ports, so a restarted `up` serves where the first did, and the proxies in front of the
# coordinator and the holders (_P[10:14]) are named to it as their advertised addresses
_P = free_ports(14)
HOLDERS = 3
UP_FLAGS = (
    "--holders", str(HOLDERS), "--capacity-tokens", "4096", "--coordinator-port", str(_P[0]),
    "--holder-ports", ",".join(map(str, _P[1:4])), "--agent-port", str(_P[4]),
    "--metrics-ports", ",".join(map(str, _P[5:10])), "--session-idle-s", str(IDLE_S),
    "--coordinator-advertise", f"127.0.0.1:{_P[10]}",
    "--holder-advertise", ",".join(f"127.0.0.1:{p}" for p in _P[11:14]),
)  # fmt: skip


def start_proxies() -> dict[str, Proxy]:
    """A proxy in front of every daemon, by link: the coordinator (for the holders and the
    agent), each holder (for the agent and the coordinator) and the agent (for the soak's
    clients; on a free port)."""
    out = {"coordinator": Proxy(f"127.0.0.1:{_P[0]}", _P[10])}
    for i in range(HOLDERS):
        out[f"holder-{i}"] = Proxy(f"127.0.0.1:{_P[1 + i]}", _P[11 + i])
    out["agent"] = Proxy(f"127.0.0.1:{_P[4]}")
    return out


async def placement(coordinator: str, ident: Any, cid: str, root: Path) -> list[list[str]]:
    """Each page's replicas as up's daemon names (holder-0 …), from the coordinator's table."""
    from corpusd.coordinator.client import CoordinatorClient

    names = {}
    for ep in root.glob("holder-*/endpoint.json"):
        names[json.loads(ep.read_text())["holder_id"]] = ep.parent.name
    async with CoordinatorClient(coordinator, ident=ident) as cc:
        table = await cc.page_table(cid)
    return [sorted(names.get(h, h) for h, _ in reps) for reps in table.pages if reps]


# ---- load ----


@dataclass
class Tally:
    ok: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    abandoned: int = 0
    codes: Counter[str] = field(default_factory=Counter)


async def session(c: Any, cid: str, q: int, tokens: int, close: bool = True) -> list[int]:
    s = await c.open_session(cid, QUESTIONS[q], reserve_tokens=tokens)
    got: list[int] = []
    async for ch in c.generate(s, max_tokens=tokens):
        got += ch.token_ids
    if close:
        with contextlib.suppress(Exception):
            await c.close_session(s)
    return got


async def runner(
    agent: str, ident: Any, cid: str, a: argparse.Namespace, until: float, abandon_until: float,
    want: dict[int, list[int]], tally: Tally, faults: Faults, seed: int,
) -> None:  # fmt: skip
    from requester.client import Client

    rng = random.Random(seed)
    backoff = 0.5  # after a failure, doubling to 8 s while they repeat (the system is down)
    while time.monotonic() < until:
        async with Client(agent=agent, timeout=60, ident=ident) as c:
            for _ in range(20):  # a fresh client (channel) now and then, as real clients come
                if time.monotonic() >= until:
                    break
                q = rng.randrange(len(QUESTIONS))
                close = not (time.monotonic() < abandon_until and rng.random() < a.abandon)
                t = faults.now()
                try:
                    got = await asyncio.wait_for(session(c, cid, q, a.tokens, close), 180)
                except Exception as e:
                    code = _code(e)
                    tally.codes[code] += 1
                    tally.failed.append({"started": t, "t": faults.now(), "question": q,
                                         "error": str(e)[:300]})  # fmt: skip
                    await asyncio.sleep(backoff)
                    backoff = min(8.0, backoff * 2)
                    # a fresh channel: a gRPC channel that failed to connect backs off up to
                    # 120 s and fails calls at once until then, long after the daemon is back
                    break
                backoff = 0.5
                tally.codes["OK"] += 1
                tally.abandoned += not close
                if got == want[q]:
                    tally.ok += 1
                else:
                    tally.wrong.append({"t": faults.now(), "question": q, "got": got,
                                        "want": want[q]})  # fmt: skip


def _code(e: BaseException) -> str:
    code = getattr(e, "code", None)
    return str(getattr(code(), "name", type(e).__name__)) if callable(code) else type(e).__name__


async def reference(agent: str, ident: Any, cid: str, tokens: int) -> dict[int, list[int]]:
    from requester.client import Client

    async with Client(agent=agent, ident=ident) as c:
        outs = [await session(c, cid, q, tokens) for q in range(len(QUESTIONS))]
    return dict(enumerate(outs))


def open_sessions(info: dict[str, Any]) -> float | None:
    """The agent's ``corpusd_requester_sessions`` gauge, over its TLS metrics port."""
    sec = Path(info["security"]["dir"])
    ctx = ssl.create_default_context(cafile=str(sec / "ca.pem"))
    from corpusd.local_ca import LocalCA

    ca = LocalCA(sec)
    ctx.load_cert_chain(str(ca.cert), str(ca.key))
    url = f"https://127.0.0.1:{info['agent']['metrics']}/metrics"
    try:
        text = urllib.request.urlopen(url, context=ctx, timeout=10).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("corpusd_requester_sessions "):
            return float(line.split()[1])
    return None


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def stray(start: set[str], end: set[str]) -> list[str]:
    """Files at the end that were not there at the start and are not logs or state a daemon
    rewrites (rotated logs, the supervisor's reports)."""
    ok_suffix = (".log", ".prom", ".json", ".db", ".db-wal", ".db-shm")
    return sorted(
        f for f in end - start
        if not f.endswith(ok_suffix) and ".log." not in f and not f.endswith("lock")
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--every-s", type=float, default=8.0, help="between faults per thread (±50 %%)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent session loops")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per session")
    p.add_argument("--abandon", type=float, default=0.1, help="share of sessions left open")
    p.add_argument("--warmup-min", type=float, default=10.0, help="RSS growth counts after it")
    p.add_argument(
        "--spare",
        default="up,coordinator,agent,holder-2",
        help="daemons SIGKILLed only during the warm-up (then SIGSTOP, network and corruption\n"
        "faults only), so that one incarnation of each lives long enough to show RSS growth",
    )
    p.add_argument("--rss-every-s", type=float, default=10.0)
    p.add_argument(
        "--primitive",
        default="route",
        choices=("auto", "route", "fetch", "local"),
        help="the agent's (up --agent-primitive): route asks the holders every step, so their\n"
        "faults reach the sessions; auto fetches this small corpus once and serves it from\n"
        "the agent's page cache",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/soak-cpu.json")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    home = Path(tmp.name)
    os.environ["CORPUSD_HOME"] = str(home)  # this up, its store and model, apart from any other
    for k in ("CORPUSD_STORE", "CORPUSD_MODEL", "CORPUSD_COORDINATOR", "CORPUSD_TOKEN"):
        os.environ.pop(k, None)
    root = home / "up"
    try:
        return _run(a, home, root, argv)
    finally:
        corpusd("down", timeout=300)
        tmp.cleanup()


def _run(a: argparse.Namespace, home: Path, root: Path, argv: list[str] | None) -> int:
    from corpusd import env, security
    from corpusd.coordinator.client import CoordinatorClient
    from corpusd.corpus.config import PinConfig
    from corpusd.corpus.pin import pin
    from corpusd.local_ca import LocalCA

    proxies = start_proxies()  # before up: its daemons dial the coordinator's and holders' own
    print(f"corpusd up --detach 1 (TLS) under {root}", flush=True)
    flags = (*UP_FLAGS, "--agent-primitive", a.primitive)
    r = corpusd("up", "--detach", "1", "--calibrate", "off", *flags, timeout=600)
    if r.returncode:
        raise RuntimeError(f"corpusd up failed: {r.stdout[-3000:]}{r.stderr[-3000:]}")
    got = env.running_up()
    assert got is not None and got["security"], "up must run with TLS"
    info: dict[str, Any] = got
    ca = LocalCA(Path(info["security"]["dir"]))
    ident = security.identity_from(str(ca.ca), str(ca.cert), str(ca.key), ca.token("admin"))
    store, model = Path(info["store"]), Path(info["model"])
    body = "".join(f"line {i}: the quick brown fox {i * 7919 % 1000}\n" for i in range(400))[:1500]
    cid = pin(PinConfig(corpus=str(text_tar(home / "repo.tar", body)), model=str(model),
                        store=str(store)),
              io.StringIO()).manifest.corpus_id  # fmt: skip

    async def publish() -> None:
        async with CoordinatorClient(info["coordinator"]["address"], ident=ident) as cc:
            t = await cc.pin(cid, replicas=2, wait=True, timeout=300)
            assert t.corpus.state == "ready", t.corpus

    asyncio.run(publish())
    pages = asyncio.run(placement(info["coordinator"]["address"], ident, cid, root))
    print(f"placement: {len(pages)} pages on {sorted({h for p in pages for h in p})}", flush=True)
    proxy = proxies["agent"]
    spare = frozenset(a.spare.split(",")) - {""}
    faults = Faults(root, time.monotonic(), store, cid, proxies, spare=spare,
                    spare_after_s=a.warmup_min * 60, up_flags=flags)  # fmt: skip
    want = asyncio.run(reference(proxy.address, ident, cid, a.tokens))
    print(f"reference decode: {len(want)} questions × {a.tokens} tokens", flush=True)
    start_files = listing(root)
    pids0 = daemons(root)
    fds: dict[str, dict[str, Any]] = {n: {"start": fd_count(p), "end": None, "pid_start": p}
                                      for n, p in pids0.items()}  # fmt: skip
    rss: dict[str, list[tuple[float, int, int]]] = {}
    duration = a.minutes * 60
    until = time.monotonic() + duration
    abandon_until = until - (IDLE_S + 60)
    stop = threading.Event()

    # the spared daemons are SIGKILLed only during the warm-up: so that each kind shows in
    # every run, the first fault thread begins with these
    script: list[tuple[str, list[str]]] = [("kill", ["agent"]), ("kill", ["coordinator"]),
                                           ("kill", ["up"])]  # fmt: skip

    def fault_thread(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.wait(a.every_s * rng.uniform(0.5, 1.5)):
            if time.monotonic() >= until - 5:
                return
            try:
                forced = script[0] if seed % 10 == 0 and script else None
                if faults.one(rng, forced) and forced:
                    script.pop(0)
            except Exception as e:  # a fault that could not be made is reported, not fatal
                print(f"  fault error: {e!r}"[:500], flush=True)

    def sampler() -> None:
        while not stop.is_set():
            for n, pid in daemons(root).items():
                if (b := rss_bytes(pid)) is not None:
                    rss.setdefault(n, []).append((faults.now(), pid, b))
            stop.wait(a.rss_every_s)

    threads = [threading.Thread(target=fault_thread, args=(a.seed * 10 + i,), daemon=True)
               for i in range(2)] + [threading.Thread(target=sampler, daemon=True)]  # fmt: skip
    for th in threads:
        th.start()
    tally = Tally()

    async def load() -> None:
        await asyncio.gather(*(
            runner(proxy.address, ident, cid, a, until, abandon_until, want, tally, faults,
                   a.seed * 1000 + i)
            for i in range(a.sessions)
        ))  # fmt: skip

    asyncio.run(load())
    stop.set()
    for th in threads[:2]:
        th.join(600)  # a fault in progress finishes (a restarted up included)
    for px in proxies.values():
        px.set("pass")
    print(f"[{faults.now():7.1f}s] load stopped; waiting for open sessions to reach 0", flush=True)
    info = env.running_up() or info
    deadline = time.monotonic() + IDLE_S + 60
    while (n_open := open_sessions(info)) != 0 and time.monotonic() < deadline:
        time.sleep(2)
    try:  # the table again: a page re-placed during the run explains by either placement
        pages_end = asyncio.run(placement(info["coordinator"]["address"], ident, cid, root))
    except Exception as e:
        print(f"  page table at the end: {e!r}"[:300], flush=True)
        pages_end = []
    pids1 = daemons(root)
    for n, pid in pids1.items():
        fds.setdefault(n, {"start": None, "pid_start": None})
        fds[n].update(end=fd_count(pid), pid_end=pid)
    r = corpusd("down", timeout=300)
    left = [n for n, pid in pids1.items() if rss_bytes(pid) is not None and not env.zombie(pid)]
    end_files = listing(root)
    stray_files = stray(start_files, end_files)
    stray_files += [f for f in listing(store) if f.endswith((".tmp", ".partial"))]
    for f in faults.windows:
        if f["t1"] is None:
            f["t1"] = faults.now()
    for fail in tally.failed:
        fail["explained_by"] = explain(fail, faults.windows, pages=pages + pages_end)
        fail["faults_near"] = [f"{f['kind']}@{f['t0']}" for f in near(fail, faults.windows)]
    summary: dict[str, Any] = {
        "what": "corpusd up (TLS) under continuous sessions and overlapping faults; tokens vs an "
        "undisturbed reference decode",
        "command": "python -m tools.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "minutes": a.minutes,
        "setup": {
            "holders": HOLDERS,
            "replicas": 2,
            "sessions": a.sessions,
            "tokens": a.tokens,
            "abandon": a.abandon,
            "agent_session_idle_s": IDLE_S,
            "agent_primitive": a.primitive,
            "proxies": "a TCP proxy in front of the coordinator (for the holders and the "
            "agent: up --coordinator-advertise), each holder (for the agent and the "
            "coordinator: up --holder-advertise) and the agent (for the soak's clients)",
            "proxy_addresses": {n: px.address for n, px in proxies.items()},
            "agent_address": info["agent"]["address"],
            "placement_start": pages,
            "placement_end": pages_end,
        },
        "faults": dict(Counter(f["kind"] for f in faults.windows)),
        "sessions_ok": tally.ok,
        "sessions_wrong": len(tally.wrong),
        "sessions_failed": len(tally.failed),
        "sessions_explained": sum(bool(f["explained_by"]) for f in tally.failed),
        "sessions_abandoned": tally.abandoned,
        "codes": dict(tally.codes),
        "proxy_upstream_errors": {
            n: dict(px.upstream_errors) for n, px in proxies.items() if px.upstream_errors
        },
        "up_restart_failures": [e for f in faults.windows for e in f.get("up_failures", [])],
        "rss": {n: rss_growth(s, a.warmup_min * 60) for n, s in rss.items()},
        "fds": fds,
        "open_sessions_end": n_open,
        "left_running": left,
        "stray_files": stray_files,
        "wrong": tally.wrong,
        "failed": tally.failed,
        "fault_windows": faults.windows,
    }
    summary["checks"] = checks(summary)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {a.out}")
    print(table(summary))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
