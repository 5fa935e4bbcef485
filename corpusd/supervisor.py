"""What ``corpusd up`` does for the daemons it started: restart one that dies (same arguments,
ports and credentials) after a backoff, and say so in ``up``'s log, the daemon's own log,
``<state-dir>/supervisor.json`` (read by ``corpusd ps``) and ``<state-dir>/supervisor.prom``
(Prometheus text format, for node_exporter's textfile collector); find and stop the daemons of
an earlier ``up`` that died.

Backoff: 0.5 s after the first exit, doubling to 30 s while the daemon keeps dying; a daemon that
served a minute before it died starts over at 0.5 s. A restart asked for (``corpusd restart
<name>`` leaves ``<state-dir>/<name>/restart`` and stops it) waits for none.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from corpusd.daemon import Daemon, lock_holder

FIRST_S, MAX_S, STABLE_S = 0.5, 30.0, 60.0
RESTART_FILE = "restart"  # in a daemon's state dir: `corpusd restart` asked for this stop


@dataclass
class Backoff:
    """Seconds to wait before the next restart."""

    first_s: float = FIRST_S
    max_s: float = MAX_S
    stable_s: float = STABLE_S
    delay_s: float = FIRST_S

    def next(self, served_s: float) -> float:
        """The wait after an exit of a daemon that served ``served_s``; doubles the next."""
        if served_s >= self.stable_s:
            self.delay_s = self.first_s
        d = self.delay_s
        self.delay_s = min(self.max_s, d * 2)
        return d


@dataclass
class Child:
    """One supervised daemon: ``start`` runs it again with the arguments, ports and environment
    it first ran with, and returns once it serves (raises RuntimeError if it does not)."""

    name: str
    daemon: Daemon
    start: Callable[[], Daemon]
    backoff: Backoff = field(default_factory=Backoff)
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    due: float = 0.0  # monotonic time of the pending restart; 0: none pending
    last_exit: int | None = None

    @property
    def running(self) -> bool:
        return self.due == 0.0 and self.daemon.proc.poll() is None


class Supervisor:
    """The daemons of one ``up`` under ``root``, polled by :meth:`poll`; reports go to ``out``."""

    def __init__(self, root: Path, out: TextIO) -> None:
        self.root, self.out = root, out
        self.children: list[Child] = []

    def add(self, daemon: Daemon, start: Callable[[], Daemon]) -> None:
        self.children.append(Child(daemon.state_dir.name, daemon, start))
        self.save()

    def daemons(self) -> list[Daemon]:
        """The started daemons (running or not), in start order: ``up`` stops them reversed."""
        return [c.daemon for c in self.children]

    def poll(self, now: float | None = None) -> None:
        """Notice exits and run the restarts that are due (one at a time: a start blocks until
        the daemon serves)."""
        for c in self.children:
            now = time.monotonic() if now is None else now
            if c.due == 0.0:
                code = c.daemon.proc.poll()
                if code is None:
                    continue
                c.last_exit = code
                asked = c.daemon.state_dir / RESTART_FILE
                if asked.exists():
                    asked.unlink(missing_ok=True)
                    wait, why = 0.0, "asked by corpusd restart"
                else:
                    wait = c.backoff.next(now - c.started)
                    why = f"exited ({code})"
                c.due = now + wait
                self._say(c, f"{c.name} {why}; restarting in {wait:g} s (restart {c.restarts + 1})")
            if c.due and now >= c.due:
                self._restart(c)
                now = None

    def _restart(self, c: Child) -> None:
        c.restarts += 1
        try:
            c.daemon = c.start()
        except RuntimeError as e:
            wait = c.backoff.next(0.0)
            c.due = time.monotonic() + wait
            tail = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            self._say(c, f"{c.name} did not start again ({tail}); next try in {wait:g} s")
        else:
            c.due, c.started = 0.0, time.monotonic()
            self._say(c, f"{c.name} restarted (pid {c.daemon.proc.pid}, restart {c.restarts})")
        self.save()

    def _say(self, c: Child, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"corpusd up: {line}", file=self.out, flush=True)
        for log in c.daemon.state_dir.glob("*.log"):  # the daemon's own log, between its runs
            with contextlib.suppress(OSError), log.open("a") as f:
                f.write(f"{stamp} corpusd up: {line}\n")

    def save(self) -> None:
        """``supervisor.json`` (name → restarts, last exit code, pid) and ``supervisor.prom``."""
        state = {
            c.name: {"restarts": c.restarts, "last_exit": c.last_exit, "pid": c.daemon.proc.pid}
            for c in self.children
        }
        _write(self.root / "supervisor.json", json.dumps(state, indent=1))
        prom = [
            "# HELP corpusd_up_restarts_total Restarts of a daemon by its corpusd up.",
            "# TYPE corpusd_up_restarts_total counter",
            *(
                f'corpusd_up_restarts_total{{daemon="{c.name}"}} {c.restarts}'
                for c in self.children
            ),
        ]
        _write(self.root / "supervisor.prom", "\n".join(prom) + "\n")


def restarts(root: Path) -> dict[str, int]:
    """Daemon name → restarts by its ``up`` (``supervisor.json``; empty when there is none)."""
    try:
        state = json.loads((root / "supervisor.json").read_text())
        return {str(k): int(v["restarts"]) for k, v in state.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def ours(pid: int, state_dir: Path) -> bool:
    """Whether ``pid`` is a corpusd process started on ``state_dir`` (pids are reused)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return False
    dirs = [cwd / a for f, a in itertools.pairwise(args) if f == "--state-dir"]
    return "corpusd" in " ".join(args) and state_dir.resolve() in {d.resolve() for d in dirs}


def left_behind(root: Path) -> list[tuple[str, int]]:
    """``(name, pid)`` of every live daemon under ``root``: the processes that hold a state
    dir's lock, or (a daemon older than the locks) name in ``endpoint.json``, each checked to
    be corpusd on that directory."""
    found: dict[str, int] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        who = lock_holder(d)
        pid = who[0] if who else 0
        if not pid:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pid = int(json.loads((d / "endpoint.json").read_text())["pid"])
        if pid and pid != os.getpid() and alive(pid) and ours(pid, d):
            found[d.name] = pid
    return list(found.items())


def stop_pids(pids: list[int], timeout: float) -> None:
    """SIGTERM (a drain), then SIGKILL what is still alive after ``timeout``."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs a thread. A process whose main thread has exited shows as a
    zombie in ``/proc/<pid>/stat`` while its other threads still run and hold its sockets (a
    daemon stopping): only when every task is a zombie, or gone, are its ports free."""
    try:
        os.kill(pid, 0)
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{task}/stat").read_text().split(") ")[1][:1]
        except (OSError, IndexError):
            continue  # that thread ended while we looked
        if state != "Z":
            return True
    return False
