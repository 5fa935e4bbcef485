"""A daemon started on a port another daemon listens on refuses with one line and exit 2, and
leaves nothing behind (issue 19, defects 1 and 2). Before, gRPC's SO_REUSEPORT let a second
``corpusd serve`` share the port ("serving on 127.0.0.1:P", two listeners), and a taken port
printed a 34–45-line traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corpusd.coordinator.launch import CoordinatorProcess, start_coordinator


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    tmp = tmp_path_factory.mktemp("ports")
    co = start_coordinator(tmp / "coord", tmp / "store")
    yield co
    assert co.stop() == 0


def corpusd(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CORPUSD_HOME": str(tmp / "home")}
    return subprocess.run(
        [sys.executable, "-m", "corpusd", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def port_of(co: CoordinatorProcess) -> int:
    return int(co.address.rsplit(":", 1)[1])


@pytest.mark.parametrize("daemon", ["serve", "holder", "agent"])
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_taken_port_is_refused_in_one_line_and_nothing_is_left(
    running: CoordinatorProcess, tmp_path: Path, tiny_dir: Path, daemon: str, flag: str
) -> None:
    taken = port_of(running) if flag == "--port" else running.metrics_port
    state = tmp_path / "state"
    extra = {
        "serve": [],
        "holder": ["--model", str(tiny_dir)],
        "agent": ["--model", str(tiny_dir), "--holders", "127.0.0.1:1"],
    }[daemon]
    r = corpusd(
        tmp_path, daemon, "--state-dir", str(state), "--store", str(tmp_path / "store"),
        flag, str(taken), *extra,
    )  # fmt: skip
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(err) == 1 and f"{flag} {taken}" in err[0] and "in use" in err[0], err
    assert not state.exists() and not (tmp_path / "store").exists()
    assert "Traceback" not in r.stderr and not r.stdout.strip()


def test_the_daemon_on_the_port_keeps_serving(running: CoordinatorProcess, tmp_path: Path) -> None:
    r = corpusd(tmp_path, "status", "--coordinator", running.address)
    assert r.returncode == 0, r.stderr
    assert running.proc.poll() is None
