"""Start a corpusd daemon as a subprocess and wait until it serves (tests, tools, ``up``).

Every daemon (``corpusd holder``, ``corpusd serve``) writes ``endpoint.json`` (address and
metrics port) in its state directory once it listens; its log goes to ``<role>.log`` beside it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


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


def spawn(
    role: str, command: str, args: list[str], state_dir: Path, timeout: float
) -> tuple[subprocess.Popen[bytes], Path, str, int]:
    """Run ``corpusd <command> --state-dir state_dir <args>``; returns once its endpoint file
    appears. Raises RuntimeError (with the log's tail) if it exits or times out."""
    state_dir.mkdir(parents=True, exist_ok=True)
    endpoint = state_dir / "endpoint.json"
    endpoint.unlink(missing_ok=True)
    log_path = state_dir / f"{role}.log"
    cmd = [sys.executable, "-m", "corpusd", command, "--state-dir", str(state_dir), *args]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not endpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    ep = json.loads(endpoint.read_text())
    return proc, state_dir, ep["address"], ep["metrics_port"]
