"""Start a corpusd daemon of a role as a subprocess and wait until it serves (:func:`start`:
tests, tools, ``up``), and what every daemon does to start serving (``listen``,
``write_endpoint``).

Every daemon (``corpusd holder``, ``corpusd serve``, ``corpusd agent``) first ``claim``s its state
directory: its ports are checked free and it takes an exclusive lock on ``<state-dir>/lock``
(which names its pid and role) before it writes anything, so a second daemon on the same
directory is refused in one line. It writes ``endpoint.json`` (address and metrics port) there
once it listens; its log goes to ``<role>.log`` beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from corpusd import env, heap, security
from corpusd.rpc import DecodeGuard


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    state_dir: Path
    address: str
    metrics_port: int

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, as far as its state is concerned."""
        self.proc.kill()
        self.proc.wait(30)

    @property
    def http_port(self) -> int:
        """An agent's OpenAI-compatible API port (``--http-port``); -1: not served."""
        return int(json.loads((self.state_dir / "endpoint.json").read_text()).get("http_port", -1))


@dataclass(frozen=True, slots=True)
class Role:
    """How a daemon of a role is started: its ``corpusd`` subcommand and how long it may take
    to serve (a holder or an agent loads a model)."""

    command: str
    timeout_s: float


ROLES = {
    "coordinator": Role("serve", 60.0),
    "holder": Role("holder", 120.0),
    "agent": Role("agent", 120.0),
}


def start(
    role: str,
    state_dir: Path,
    *args: str,
    store: Path | None = None,
    model: Path | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> Daemon:
    """Run the daemon of ``role`` (a key of :data:`ROLES`) with ``--state-dir state_dir``,
    ``--store``/``--model`` when given, then ``args``; returns once it serves (its log:
    ``state_dir/<role>.log``). ``env`` replaces this process's environment (e.g.
    ``CUDA_VISIBLE_DEVICES``). Raises KeyError for an unknown role, RuntimeError (with the
    log's tail) if it exits or does not serve within ``timeout`` (default: the role's)."""
    r = ROLES[role]
    flags = [*(["--store", str(store)] if store is not None else [])]
    flags += ["--model", str(model)] if model is not None else []
    wait = r.timeout_s if timeout is None else timeout
    return Daemon(*spawn(role, r.command, [*flags, *args], state_dir, wait, env))


def spawn(
    role: str,
    command: str,
    args: list[str],
    state_dir: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Path, str, int]:
    """Run ``corpusd <command> --state-dir state_dir <args>`` (with ``env``, default this
    process's); returns once its endpoint file appears. Raises RuntimeError (with the log's
    tail) if it exits or times out."""
    state_dir.mkdir(parents=True, exist_ok=True)
    endpoint = state_dir / "endpoint.json"
    endpoint.unlink(missing_ok=True)
    log_path = state_dir / f"{role}.log"
    cmd = [sys.executable, "-m", "corpusd", command, "--state-dir", str(state_dir), *args]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while not endpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    ep = json.loads(endpoint.read_text())
    return proc, state_dir, ep["address"], ep["metrics_port"]


class PortInUse(ValueError):
    """A daemon's port is taken: refused before anything is started or written."""


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Refuse ports another process listens on (``ports``: flag → port; 0 and -1 are skipped),
    before a daemon creates its state. gRPC binds with SO_REUSEPORT by default, so without this
    (and ``grpc.so_reuseport`` off in :func:`listen`) two daemons would share a port. Raises
    PortInUse naming the flag."""
    for flag, port in ports.items():
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not in use
            try:
                s.bind((host, port))
            except OSError as e:
                raise PortInUse(
                    f"{flag} {port}: {host}:{port} is in use ({e.strerror}); is another corpusd "
                    f"daemon running there? Pick another port ({flag} 0 picks a free one)"
                ) from None


class StateDirInUse(ValueError):
    """Another live process holds a state directory's lock."""


LOCK_FILE = "lock"
_HELD: dict[Path, int] = {}  # state dir → the fd of its lock, held for this process's life


def lock_holder(state_dir: Path) -> tuple[int, str] | None:
    """``(pid, role)`` of the live process that holds ``state_dir``'s lock, else None (no lock
    file, or its process is gone: a lock dies with its process). Read from the lock file, the
    pid checked alive; it does not take the lock."""
    try:
        pid_text, role = (state_dir / LOCK_FILE).read_text().split()[:2]
        pid = int(pid_text)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    if _zombie(pid):
        return None
    return pid, role


def lock_state_dir(state_dir: Path, role: str) -> None:
    """Take the exclusive lock on ``state_dir`` (created if missing) for the rest of this
    process's life and write ``<pid> <role>`` into it; again for a directory this process holds
    is a no-op. The descriptor is not inherited by children. Raises StateDirInUse naming the
    process that holds it."""
    state_dir = state_dir.resolve()
    if state_dir in _HELD:
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        who = lock_holder(state_dir)
        by = f"corpusd {who[1]} (pid {who[0]})" if who else "another process"
        raise StateDirInUse(
            f"state dir {state_dir} is in use by {by}; stop it first (corpusd down, or kill "
            "that pid), or give another --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)
    _HELD[state_dir] = fd


def release_state_dir(state_dir: Path) -> None:
    """Give up this process's lock on ``state_dir`` (if it holds it)."""
    fd = _HELD.pop(state_dir.resolve(), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def claim(state_dir: Path, role: str, host: str, ports: dict[str, int]) -> None:
    """What a daemon does before it writes anything (a model, its state): refuse taken
    ``ports`` (:func:`check_ports`), then lock ``state_dir`` (:func:`lock_state_dir`). Raises
    PortInUse or StateDirInUse, each in one line."""
    check_ports(host, ports)
    lock_state_dir(state_dir, role)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False


@dataclass
class Listening:
    """A started gRPC server with its health service and metrics endpoint."""

    server: grpc.aio.Server
    health: HealthServicer
    port: int
    metrics_port: int  # -1: none
    scheme: str = "http"  # of the metrics endpoint: "https" when the daemon serves TLS

    async def until_signal(
        self,
        name: str,
        drain_s: float,
        tasks: Sequence[asyncio.Task[Any]] = (),
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        """Serve until SIGTERM or SIGINT, then drain: health turns NOT_SERVING, new RPCs are
        refused, running ones get ``drain_s``; the daemon's background ``tasks`` are cancelled.
        ``on_drain`` is called as the drain starts (another listener stops accepting)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logging.getLogger("corpusd").info("%s draining (up to %.1f s)", name, drain_s)
        if on_drain is not None:
            on_drain()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(drain_s)
        for task in tasks:
            task.cancel()


async def listen(
    add: Callable[[grpc.aio.Server], None],
    service: str,
    host: str,
    port: int,
    metrics_port: int,
    registry: CollectorRegistry,
    options: Sequence[tuple[str, Any]] = (),
) -> Listening:
    """Start a daemon's gRPC server (``add`` puts its servicer on it) beside the health
    service, both SERVING, and its Prometheus endpoint (``metrics_port`` 0: any free port,
    -1: none), with TLS and tokens as this process is configured (:mod:`corpusd.security`).
    Raises PortInUse when either port cannot be bound (nothing is left serving), ValueError for
    a non-loopback ``host`` without TLS or --insecure."""
    sec = security.serving(host)
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *options],
        interceptors=[*sec.interceptors, DecodeGuard()],
    )
    add(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = (
            server.add_secure_port(f"{host}:{port}", sec.credentials)
            if sec.credentials is not None
            else server.add_insecure_port(f"{host}:{port}")
        )
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise PortInUse(f"--port {port}: cannot listen on {host}:{port} (in use?)")
    mport = -1
    if metrics_port >= 0:
        watch_process(registry)
        try:
            httpd, _ = start_http_server(
                metrics_port, addr=host, registry=registry, **sec.metrics_tls
            )
        except OSError as e:
            raise PortInUse(f"--metrics-port {metrics_port}: {e.strerror}") from None
        mport = httpd.server_address[1]
    await server.start()
    heap.start_trimming(env.get("CORPUSD_MALLOC_TRIM_S"))
    for name in (service, ""):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Listening(server, health, bound, mport, sec.scheme)


def watch_process(registry: CollectorRegistry) -> None:
    """The process's own gauges on ``registry``: prometheus_client's ``process_*`` (RSS, open
    fds, CPU) and glibc's heap (``corpusd_heap_bytes``: in use against kept free)."""
    ProcessCollector(registry=registry)
    registry.register(heap.HeapCollector())


def write_endpoint(state_dir: Path, endpoint: dict[str, Any]) -> None:
    """``endpoint.json`` (atomically): what ``spawn`` waits for."""
    tmp = state_dir / "endpoint.json.tmp"
    tmp.write_text(json.dumps(endpoint))
    os.replace(tmp, state_dir / "endpoint.json")
