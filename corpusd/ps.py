"""``corpusd ps`` and ``corpusd logs``: the daemons a ``corpusd up`` started (pids, addresses,
uptime) and their logs, read from its state directory: ``up.json`` and ``up.log`` of ``up``
itself, and each daemon's directory (``coordinator``, ``holder-0`` …, ``agent``) with its
``endpoint.json`` and ``<role>.log``. Both work after ``up`` is gone: the logs stay."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from corpusd import env


@dataclass(frozen=True, slots=True)
class Proc:
    """One daemon of a ``corpusd up``."""

    name: str  # "up", "coordinator", "holder-0", …, "agent": its directory's name
    pid: int  # 0 when it never wrote one
    running: bool  # the pid is alive and a corpusd process (pids are reused)
    daemon_id: str  # a holder's or agent worker's id ("" for up and the coordinator)
    address: str  # its gRPC host:port ("" for up)
    metrics_port: int  # -1: none
    uptime_s: float  # 0 when not running
    log: str  # its log file
    restarts: int = 0  # by its `corpusd up` (supervisor.json)


def _order(name: str) -> tuple[int, int, str]:
    """up, coordinator, holder-0, holder-1, …, agent: the order ``up`` starts them."""
    m = re.fullmatch(r"holder-(\d+)", name)
    rank = {"up": 0, "coordinator": 1, "agent": 3}.get(name, 2 if m else 4)
    return rank, int(m.group(1)) if m else 0, name


def uptime(pid: int) -> float:
    """Seconds since ``pid`` started (Linux ``/proc``); 0.0 when unknown."""
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return max(0.0, since_boot - start / os.sysconf("SC_CLK_TCK"))


def is_corpusd(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) corpusd process."""
    try:
        os.kill(pid, 0)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"corpusd" in cmdline and not env.zombie(pid)


def tls(root: Path) -> bool:
    """Whether the ``up`` of ``root`` serves TLS (its ``up.json``, also when ``up`` was killed;
    else whether it made a CA)."""
    try:
        return bool(json.loads((root / "up.json").read_text()).get("security"))
    except (OSError, ValueError, AttributeError):
        return (root / "tls").is_dir()


def processes(root: Path) -> list[Proc]:
    """``up`` itself (when it left ``up.json`` or ``up.log``) and every daemon directory under
    ``root`` with an ``endpoint.json``, a ``lock`` or a line in ``supervisor.json`` (one being
    restarted has no endpoint yet), in the order ``up`` starts them."""
    from corpusd.daemon import lock_holder
    from corpusd.supervisor import restarts

    out = []
    again = restarts(root)
    up_json, up_log = root / "up.json", root / "up.log"
    if up_json.exists() or up_log.exists():
        info = env.running_up(str(root))
        pid = int(info["pid"]) if info else 0
        out.append(
            Proc("up", pid, info is not None, "", "", -1, uptime(pid) if pid else 0, str(up_log))
        )
    # a daemon `up` is restarting has no endpoint.json yet, but its lock or supervisor.json
    dirs = {p.parent for p in root.glob("*/endpoint.json")} | {
        p.parent for p in root.glob("*/lock")
    }
    dirs |= {root / name for name in again}
    for d in dirs:
        try:
            e = json.loads((d / "endpoint.json").read_text())
            pid = int(e.get("pid", 0))
        except FileNotFoundError:
            e, pid = {}, 0
        except (OSError, ValueError, AttributeError):
            continue
        if (who := lock_holder(d)) is not None:  # the live one, where endpoint.json is older
            pid = who[0]
        logs = sorted(d.glob("*.log"))
        running = bool(pid) and is_corpusd(pid)
        out.append(
            Proc(
                name=d.name,
                pid=pid,
                running=running,
                daemon_id=str(e.get("holder_id") or e.get("worker_id") or ""),
                address=str(e.get("address", "")),
                metrics_port=int(e.get("metrics_port", -1)),
                uptime_s=uptime(pid) if running else 0.0,
                log=str(logs[0]) if logs else "",
                restarts=again.get(d.name, 0),
            )
        )
    return sorted(out, key=lambda p: _order(p.name))


def duration(seconds: float) -> str:
    """``seconds`` as ``ps`` shows an uptime: "42s", "7m05s", "5h03m", "3d04h"."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def render(procs: Sequence[Proc], tls: bool = False) -> str:
    """``corpusd ps``'s table: daemon, state, pid, id, address, metrics URL (https when the
    ``up`` serves ``tls``; "-" once it exited: nothing serves it), uptime, restarts by ``up``."""
    rows = [("DAEMON", "STATE", "PID", "ID", "ADDRESS", "METRICS", "UPTIME", "RESTARTS")]
    for p in procs:
        scheme = "https" if tls else "http"
        serving = p.running and p.metrics_port >= 0
        metrics = f"{scheme}://127.0.0.1:{p.metrics_port}/metrics" if serving else "-"
        rows.append(
            (
                p.name,
                "running" if p.running else "exited",
                str(p.pid) if p.pid else "-",
                p.daemon_id or "-",
                p.address or "-",
                metrics,
                duration(p.uptime_s) if p.running else "-",
                str(p.restarts) if p.name != "up" else "-",
            )
        )
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, width, strict=True)).rstrip() for r in rows
    )


def log_files(root: Path, name: str = "") -> dict[str, Path]:
    """Daemon name → its log, every one under ``root`` or only ``name``'s. Raises ValueError
    naming the daemons there when ``name`` is not one of them, or when there is none."""
    logs = {p.name: Path(p.log) for p in processes(root) if p.log and Path(p.log).is_file()}
    if not logs:
        raise ValueError(f"no daemon logs in {root}: start one with `corpusd up`")
    if name and name not in logs:
        raise ValueError(f"no daemon {name!r} in {root}; its daemons: {', '.join(logs)}")
    return {name: logs[name]} if name else logs


def tail(path: Path, lines: int) -> tuple[str, int]:
    """The last ``lines`` lines of ``path`` (all with ``lines`` 0) and the file's size (where a
    follow starts reading)."""
    data = path.read_bytes()
    text = data.decode(errors="replace")
    if lines > 0:
        text = "".join(text.splitlines(keepends=True)[-lines:])
    return text, len(data)


def show_logs(
    logs: dict[str, Path],
    lines: int,
    follow: bool,
    out: TextIO,
    stop: Callable[[], bool] = lambda: False,
    poll_s: float = 0.2,
) -> None:
    """Print the tail of each log (under a ``==> name (path) <==`` header when there are
    several); with ``follow``, then what is appended to any of them, each line prefixed with its
    daemon's name when there are several, until ``stop()`` or Ctrl-C."""
    many = len(logs) > 1
    offsets: dict[str, int] = {}
    for name, path in logs.items():
        text, offsets[name] = tail(path, lines)
        if many:
            out.write(f"==> {name} ({path}) <==\n")
        out.write(text if not text or text.endswith("\n") else text + "\n")
    out.flush()
    partial = dict.fromkeys(logs, "")
    while follow and not stop():
        for name, path in logs.items():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size < offsets[name]:  # truncated or replaced: start over
                offsets[name] = 0
            if size == offsets[name]:
                continue
            with path.open("rb") as f:
                f.seek(offsets[name])
                chunk = f.read(size - offsets[name])
            offsets[name] = size
            *done, partial[name] = (partial[name] + chunk.decode(errors="replace")).split("\n")
            for line in done:
                out.write(f"{name}| {line}\n" if many else f"{line}\n")
        out.flush()
        time.sleep(poll_s)
