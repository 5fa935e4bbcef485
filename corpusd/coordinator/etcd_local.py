"""An etcd cluster of ``n`` members on loopback (``corpusd up --state etcd``, tests, tools).

Each member is a real ``etcd`` process (Debian's ``etcd-server`` 3.4 is enough) with its data
directory under ``root/etcd-<i>``, its log beside it, and free client and peer ports, kept in
``root/ports.json`` so that starting again in the same ``root`` brings the same cluster back.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def etcd_binary() -> str | None:
    """The ``etcd`` on PATH (or in /usr/bin, where Debian puts it), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class EtcdCluster:
    root: Path
    client_ports: list[int]
    peer_ports: list[int]
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """``127.0.0.1:p1,127.0.0.1:p2,…`` (every member, live or not)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def url(self, prefix: str) -> str:
        """The ``--state`` URL of this cluster under ``prefix``."""
        return f"etcd://{self.endpoints}/{prefix}"

    def _status(self, i: int) -> dict[str, object]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status", data=b"{}"
        )
        with urllib.request.urlopen(req, timeout=2) as r:
            return dict(json.loads(r.read()))

    def leader(self) -> int:
        """Index of the member that is raft leader now. Raises RuntimeError if none answers."""
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is not None:
                continue
            try:
                st = self._status(i)
            except OSError:
                continue
            header = st["header"]
            assert isinstance(header, dict)
            if st.get("leader") == header.get("member_id"):
                return i
        raise RuntimeError("no etcd member says it leads")

    def wait_ready(self, timeout: float = 30) -> None:
        """Until a leader is elected. Raises RuntimeError with the members' log tails."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.leader()
                return
            except RuntimeError:
                time.sleep(0.1)
        tails = "\n".join(
            (self.root / f"etcd-{i}.log").read_text()[-800:] for i in range(len(self.procs))
        )
        raise RuntimeError(f"etcd did not elect a leader in {timeout} s:\n{tails}")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays: ``start(i)`` brings it back)."""
        p = self.procs[i]
        if p is not None:
            p.kill()
            p.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self.procs[i] = None


def start_etcd(root: Path, n: int = 1, timeout: float = 30) -> EtcdCluster:
    """Start ``n`` etcd members on loopback and wait for a leader. Raises FileNotFoundError
    when no etcd binary is installed, RuntimeError when the cluster does not form."""
    exe = etcd_binary()
    if exe is None:
        raise FileNotFoundError("no etcd binary (Debian: apt-get install etcd-server)")
    saved = root / "ports.json"  # a restart reuses them: the members' data records them
    ports = json.loads(saved.read_text()) if saved.exists() else _free_ports(2 * n)
    if len(ports) != 2 * n:
        raise RuntimeError(f"{saved} is for {len(ports) // 2} members, not {n}")
    c = EtcdCluster(root, ports[:n], ports[n:])
    initial = ",".join(f"m{i}=http://127.0.0.1:{c.peer_ports[i]}" for i in range(n))
    root.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(ports))
    for i in range(n):
        client = f"http://127.0.0.1:{c.client_ports[i]}"
        peer = f"http://127.0.0.1:{c.peer_ports[i]}"
        log = open(root / f"etcd-{i}.log", "ab")  # noqa: SIM115  # the child keeps it open
        c.procs.append(
            subprocess.Popen(
                [exe, "--name", f"m{i}", "--data-dir", str(root / f"etcd-{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"corpusd-{root.name}",
                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        )  # fmt: skip
        log.close()
    try:
        c.wait_ready(timeout)
    except BaseException:
        c.stop()
        raise
    return c
