"""``corpusd ps`` and ``corpusd logs`` over a made-up ``corpusd up`` state directory: live and
dead daemons, the order ``up`` starts them, uptime, tails and ``--follow``, and bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corpusd import ps
from corpusd.cli import main as cli_main


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process whose command line says corpusd (as a daemon's does)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "corpusd-test"])
    yield p
    p.kill()
    p.wait()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _daemon(root: Path, name: str, role: str, pid: int, **extra: object) -> None:
    d = root / name
    d.mkdir(parents=True)
    port = 40000 + len(list(root.iterdir()))
    ep = {"address": f"127.0.0.1:{port}", "metrics_port": port + 100, "pid": pid, **extra}
    (d / "endpoint.json").write_text(json.dumps(ep))
    (d / f"{role}.log").write_text("".join(f"{name} line {i}\n" for i in range(30)))


@pytest.fixture
def root(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> Path:
    """up (live), coordinator (live), holders 0, 2 and 10 (10 dead), agent (live)."""
    r = tmp_path / "up"
    dead = _dead_pid()
    for name in ("agent", "holder-10", "holder-2", "coordinator", "holder-0"):
        role = name.split("-")[0]
        pid = dead if name == "holder-10" else sleeper.pid
        extra = {"holder_id": f"holder-{name[-1]}abc"} if role == "holder" else {}
        if role == "agent":
            extra = {"worker_id": "agent-7"}
        _daemon(r, name, "coordinator" if name == "coordinator" else role, pid, **extra)
    (r / "up.json").write_text(json.dumps({"pid": sleeper.pid}))
    (r / "up.log").write_text("starting\nstopped 5 daemons\n")
    (r / "supervisor.json").write_text(json.dumps({"holder-2": {"restarts": 3}}))
    return r


def test_ps_lists_the_daemons_in_start_order_with_state_and_uptime(root: Path) -> None:
    procs = ps.processes(root)
    assert [p.name for p in procs] == [
        "up", "coordinator", "holder-0", "holder-2", "holder-10", "agent",
    ]  # fmt: skip
    by = {p.name: p for p in procs}
    assert [n for n, p in by.items() if not p.running] == ["holder-10"]
    assert by["holder-10"].uptime_s == 0 and 0 < by["agent"].uptime_s < 60
    assert by["holder-2"].daemon_id == "holder-2abc" and by["agent"].daemon_id == "agent-7"
    assert by["up"].address == "" and by["up"].log == str(root / "up.log")
    assert by["coordinator"].log == str(root / "coordinator" / "coordinator.log")
    lines = ps.render(procs).splitlines()
    head = ["DAEMON", "STATE", "PID", "ID", "ADDRESS", "METRICS", "UPTIME", "RESTARTS"]
    assert lines[0].split() == head
    h10 = lines[5].split()
    assert h10[:2] == ["holder-10", "exited"] and h10[-2] == "-", lines[5]
    assert h10[5] == "-", lines[5]  # nothing serves an exited daemon's metrics (was its URL)
    assert [r.split()[-1] for r in lines[1:]] == ["-", "0", "0", "3", "0", "0"]  # supervisor.json
    co = lines[2].split()
    assert co[1] == "running" and co[3] == "-" and co[5].endswith("/metrics") and co[6][-1] == "s"
    assert [ps.duration(s) for s in (0, 59, 60, 3599, 3600, 86399, 86400 + 7200)] == [
        "0s", "59s", "1m00s", "59m59s", "1h00m", "23h59m", "1d02h",
    ]  # fmt: skip


def test_logs_tail_every_daemon_or_one_and_refuse_an_unknown_one(root: Path) -> None:
    out = io.StringIO()
    ps.show_logs(ps.log_files(root), 2, False, out)
    text = out.getvalue()
    assert text.startswith(f"==> up ({root / 'up.log'}) <==\nstarting\nstopped 5 daemons\n")
    assert f"==> holder-10 ({root / 'holder-10' / 'holder.log'}) <==\n" in text
    assert "holder-10 line 28\nholder-10 line 29\n" in text and "line 27" not in text
    out = io.StringIO()
    ps.show_logs(ps.log_files(root, "agent"), 0, False, out)
    assert out.getvalue() == "".join(f"agent line {i}\n" for i in range(30))  # no header
    with pytest.raises(ValueError, match=r"no daemon 'holder-1' in .*; its daemons: up, coord"):
        ps.log_files(root, "holder-1")
    with pytest.raises(ValueError, match="no daemon logs in"):
        ps.log_files(root / "nothing")


def test_logs_follow_prints_what_is_appended(root: Path) -> None:
    out, done = io.StringIO(), threading.Event()
    logs = ps.log_files(root)
    follow = threading.Thread(
        target=ps.show_logs, args=(logs, 1, True, out, done.is_set, 0.01), daemon=True
    )
    follow.start()
    time.sleep(0.1)
    with (root / "agent" / "agent.log").open("a") as f:
        f.write("new one\nhalf a li")
        f.flush()
        time.sleep(0.1)
        f.write("ne\n")
    with (root / "holder-0" / "holder.log").open("a") as f:
        f.write("holder news\n")
    deadline = time.monotonic() + 5
    while "holder news" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    done.set()
    follow.join(5)
    tail = out.getvalue().split("agent line 29\n", 1)[1].splitlines()
    assert [x for x in tail if x.startswith("agent| ")] == ["agent| new one", "agent| half a line"]
    assert [x for x in tail if not x.startswith("agent| ")] == ["holder-0| holder news"]


def test_cli_ps_and_logs(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ps", "--state-dir", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed][:2] == ["up", "coordinator"] and len(listed) == 6
    assert cli_main(["ps", "--state-dir", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.startswith("no daemons: nothing was started with `corpusd up`")
    assert cli_main(["logs", "coordinator", "-n", "1", "--state-dir", str(root)]) == 0
    assert capsys.readouterr().out == "coordinator line 29\n"
    for args, words in (
        (["logs", "holder-9"], "no daemon 'holder-9' in "),
        (["logs", "-n", "-1"], "--lines must be >= 0, got -1"),
    ):
        assert cli_main([*args, "--state-dir", str(root)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"corpusd: error: {words}") and err.count("\n") == 1, err
    assert os.path.exists(root / "up.json")  # nothing was changed
