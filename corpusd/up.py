"""``corpusd up``: the embedded default on loopback — a coordinator, N holders and one agent
worker with the tiny model, state under one directory, stopped together on Ctrl-C / SIGTERM.

``up.json`` in the state directory names every daemon's address and metrics URL while it runs;
the other commands (``pin``, ``status``, ``agents``) find the coordinator through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpusd import env
from corpusd.coordinator.client import CoordinatorClient
from corpusd.coordinator.etcd_local import start_etcd
from corpusd.coordinator.launch import start_coordinator
from corpusd.daemon import Daemon
from holder.launch import start_holder
from requester.launch import start_agent


@dataclass(frozen=True, slots=True)
class UpConfig:
    holders: int = field(default=2, metadata={"help": "holder processes"})
    state_dir: str = field(
        default="", metadata={"help": "every daemon's state and log (default: $CORPUSD_HOME/up)"}
    )
    store: str = field(default="", metadata={"help": "page store (default: $CORPUSD_STORE)"})
    model: str = field(default="", metadata={"help": "model directory (default: the tiny model)"})
    capacity_tokens: int = field(
        default=65536, metadata={"help": "per holder (its pool is allocated up front)"}
    )
    detach: int = field(
        default=0,
        metadata={"help": "1 (or the flag alone): start in the background, return once serving",
                  "const": 1},
    )  # fmt: skip
    timeout_s: float = field(default=180.0, metadata={"help": "for everything to come up"})
    state: str = field(
        default="sqlite",
        metadata={
            "help": "sqlite: one coordinator; etcd: a 3-member etcd on loopback and 2 "
            "coordinators sharing it (one leads; every daemon knows both)"
        },
    )

    def __post_init__(self) -> None:
        if self.state not in ("sqlite", "etcd"):
            raise ValueError(f"state must be sqlite or etcd, got {self.state!r}")
        if not 1 <= self.holders <= 64:
            raise ValueError(f"holders must be in 1..64, got {self.holders}")
        if self.capacity_tokens <= 0 or not self.timeout_s > 0:
            raise ValueError("capacity_tokens and timeout_s must be > 0")
        if self.detach not in (0, 1):
            raise ValueError(f"detach must be 0 or 1, got {self.detach}")


def describe(info: dict[str, Any]) -> str:
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}/metrics" if port >= 0 else "-"

    c = info["coordinator"]
    lines = [
        f"corpusd up (pid {info['pid']}, state {info['state_dir']})",
        f"  coordinator  {c['address']:<22} {url(c['metrics'])}",
    ]
    for h in info["holders"]:
        lines.append(f"  holder       {h['address']:<22} {url(h['metrics'])}")
    a = info["agent"]
    lines.append(f"  agent        {a['address']:<22} {url(a['metrics'])}")
    lines.append("  other commands find the coordinator through up.json; stop: corpusd down")
    return "\n".join(lines)


def up(cfg: UpConfig) -> int:
    root = env.up_dir(cfg.state_dir)
    if (other := env.running_up(cfg.state_dir)) is not None:
        raise ValueError(f"corpusd up is already running (pid {other['pid']}) in {root}")
    if cfg.detach:
        return _detach(cfg, root)
    from corpusd.corpus.pin import default_model  # torch: `down` and `--help` go without

    root.mkdir(parents=True, exist_ok=True)
    store = Path(cfg.store).expanduser() if cfg.store else env.default_store_dir()
    model = Path(cfg.model) if cfg.model else default_model(sys.stderr)
    daemons: list[Daemon] = []
    stack = contextlib.ExitStack()  # etcd, stopped after the daemons
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    # SIGINT too: a shell script's background job starts with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt, so Ctrl-C / kill -INT would not stop the daemons.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"starting a coordinator, {cfg.holders} holders and an agent under {root}")
        flags: tuple[str, ...] = ()
        if cfg.state == "etcd":
            etcd = start_etcd(root / "etcd", 3)
            stack.callback(etcd.stop)
            flags = ("--state", etcd.url("corpusd"))
        coord = start_coordinator(root / "coordinator", store, *flags, timeout=cfg.timeout_s)
        daemons.append(coord)
        address = coord.address
        if cfg.state == "etcd":  # a standby; both addresses go to every daemon and up.json
            standby = start_coordinator(
                root / "coordinator-1", store, *flags, timeout=cfg.timeout_s
            )
            daemons.append(standby)
            address = f"{coord.address},{standby.address}"
        cap = ("--capacity-tokens", str(cfg.capacity_tokens))
        with ThreadPoolExecutor(cfg.holders + 1) as pool:
            hs = [
                pool.submit(
                    start_holder,
                    store,
                    root / f"holder-{i}",
                    model,
                    "--coordinator",
                    address,
                    *cap,
                    timeout=cfg.timeout_s,
                )
                for i in range(cfg.holders)
            ]
            ag = pool.submit(
                start_agent,
                store,
                root / "agent",
                model,
                "--coordinator",
                address,
                timeout=cfg.timeout_s,
            )
            holders = [f.result() for f in hs]
            daemons += holders
            agent = ag.result()
            daemons.append(agent)
        asyncio.run(_ready(address, cfg.holders, cfg.timeout_s))
        info = {
            "pid": os.getpid(),
            "state_dir": str(root),
            "store": str(store),
            "model": str(model),
            "coordinator": {"address": address, "metrics": coord.metrics_port},
            "holders": [{"address": h.address, "metrics": h.metrics_port} for h in holders],
            "agent": {"address": agent.address, "metrics": agent.metrics_port},
        }
        tmp = root / "up.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, root / "up.json")
        print(describe(info), flush=True)
        while True:  # until a signal; a daemon that dies is reported, the rest keep serving
            time.sleep(1)
            for d in list(daemons):
                if d.proc.poll() is not None:
                    print(
                        f"corpusd up: {d.state_dir.name} exited ({d.proc.returncode}); "
                        f"see {d.state_dir}",
                        file=sys.stderr,
                        flush=True,
                    )
                    daemons.remove(d)
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
    finally:
        (root / "up.json").unlink(missing_ok=True)
        for d in reversed(daemons):  # agent, holders, coordinator
            try:
                d.stop(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
        if daemons:
            print(f"stopped {len(daemons)} daemons; state kept in {root}", flush=True)
        stack.close()
    return 0


async def _ready(address: str, holders: int, timeout: float) -> None:
    """Until the coordinator sees every holder live and the agent reported."""
    async with CoordinatorClient(address) as c:
        await c.wait_holders(holders, timeout)
        deadline = time.monotonic() + timeout
        while not any(w.live for w in await c.list_workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent did not report to the coordinator in {timeout} s")
            await asyncio.sleep(0.1)


def _detach(cfg: UpConfig, root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    log = root / "up.log"
    args = [
        sys.executable,
        "-m",
        "corpusd",
        "up",
        "--holders",
        str(cfg.holders),
        "--state-dir",
        str(root),
        "--capacity-tokens",
        str(cfg.capacity_tokens),
        "--timeout-s",
        str(cfg.timeout_s),
        "--state",
        cfg.state,
    ]
    if cfg.store:
        args += ["--store", cfg.store]
    if cfg.model:
        args += ["--model", cfg.model]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + cfg.timeout_s + 30
    while (info := env.running_up(str(root))) is None or info["pid"] != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"corpusd up did not start: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    print(describe(info))
    print(f"  log: {log}")
    return 0


def _orphans(root: Path) -> list[int]:
    """Pids of daemons a dead ``corpusd up`` left running under ``root`` (their endpoint.json),
    checked to be corpusd processes (a pid may have been reused since)."""
    pids = []
    for ep in root.glob("*/endpoint.json"):
        try:
            pid = int(json.loads(ep.read_text())["pid"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, KeyError):
            continue
        if b"corpusd" in cmdline:
            pids.append(pid)
    return pids


def _stop_orphans(root: Path, timeout: float) -> int:
    """Stop the daemons a dead ``corpusd up`` left under ``root``; returns how many."""
    orphans = _orphans(root)
    for pid in orphans:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    left, deadline = orphans, time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if _alive(pid)]
        time.sleep(0.2)
    for pid in left:  # did not drain in time
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(orphans)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return not env.zombie(pid)


def down(flag: str = "", timeout: float = 60) -> int:
    """Stop ``corpusd up`` (it stops its daemons). If it is gone (killed), stop the daemons it
    left and remove its stale ``up.json``."""
    root = env.up_dir(flag)
    info = env.running_up(flag)
    if info is not None:
        pid = int(info["pid"])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"corpusd up (pid {pid}) did not stop in {timeout} s")
            time.sleep(0.2)
        print(f"stopped corpusd up (pid {pid})")
    stopped = _stop_orphans(root, timeout)
    stale = (root / "up.json").exists()
    (root / "up.json").unlink(missing_ok=True)
    if info is None and (stopped or stale):
        print(
            f"corpusd up in {root} was gone: stopped {stopped} daemon(s) it left"
            + (", removed its stale up.json" if stale else "")
        )
    elif info is None:
        print(f"corpusd up is not running in {root}")
    return 0
