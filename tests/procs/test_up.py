"""`corpusd up`: the README's path (up in the background, pin, sub-agents, status, down) and a
foreground `up` stopped by Ctrl-C, with every daemon gone afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from corpusd.testing.cli import run_cli


def corpusd(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    r = run_cli(env, *args, timeout=timeout)
    assert r.returncode == 0, f"corpusd {' '.join(args)}: {r.stdout}\n{r.stderr}"
    return r.stdout


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def daemon_pids(root: Path) -> list[int]:
    return [int(json.loads(p.read_text())["pid"]) for p in root.glob("*/endpoint.json")]


@pytest.fixture
def home(tmp_path: Path, tiny_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CORPUSD_COORDINATOR", None)
    env.update(CORPUSD_HOME=str(tmp_path / "home"), CORPUSD_MODEL=str(tiny_dir))
    env["CORPUSD_CALIBRATE"] = "off"  # seconds each; test_up_ports.py checks that it runs
    return env


def test_up_pin_agents_status_down(home: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text(
        "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(24))
    )
    with tarfile.open(tmp_path / "repo.tar", "w") as tar:
        tar.add(src, arcname="repo")
    out = corpusd(home, "up", "--holders", "2", "--capacity-tokens", "4096", "--detach", "1")
    assert "agent" in out and "/metrics" in out
    root = Path(home["CORPUSD_HOME"]) / "up"
    pids = daemon_pids(root)
    assert len(pids) == 4  # coordinator, 2 holders, agent
    try:
        out = corpusd(home, "pin", "--corpus", str(tmp_path / "repo.tar"), "--name", "repo")
        assert "published via" in out  # found the coordinator through up.json
        out = corpusd(home, "agents", "--corpus", "repo", "--agents", "3", "--tokens", "4")
        assert out.count("  Q: ") == 3 and "inter-token p50" in out and "/metrics" in out
        assert "the built-in tiny model has random weights" in out  # its answers are noise
        status = corpusd(home, "status")
        assert "holders (2 live of 2)" in status and "agent workers (1 live of 1)" in status
        assert "repo" in status and "ready" in status
        rows = [line.split() for line in corpusd(home, "ps").splitlines()[1:]]
        assert [r[0] for r in rows] == ["up", "coordinator", "holder-0", "holder-1", "agent"]
        assert all(r[1] == "running" for r in rows) and sorted(
            int(r[2]) for r in rows[1:]
        ) == sorted(pids)
        assert "published corpus" in corpusd(home, "logs", "coordinator", "-n", "0")
        assert "==> holder-1 (" in corpusd(home, "logs", "-n", "1")
        repo = corpusd(home, "ls").splitlines()[2].split()
        assert repo[0] == "repo" and repo[3] == "1" and repo[5] == "ready", repo
        unpinned = corpusd(home, "unpin", "repo")
        assert unpinned.startswith("unpinned repo (corpus ") and "released" in unpinned
    finally:
        corpusd(home, "down")
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "a daemon outlived corpusd down"
    assert not (root / "up.json").exists()
    gone = json.loads(corpusd(home, "ps", "--json"))  # after down: all exited, logs still there
    assert [p["running"] for p in gone] == [False] * 5
    assert "stopped 4 daemons" in corpusd(home, "logs", "up")


def test_ctrl_c_stops_every_daemon(home: dict[str, str]) -> None:
    root = Path(home["CORPUSD_HOME"]) / "up"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corpusd", "up", "--holders", "1", "--capacity-tokens", "1024"],
        env=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (root / "up.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()  # type: ignore[union-attr]
            time.sleep(0.2)
        pids = daemon_pids(root)
        assert len(pids) == 3
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "stopped 3 daemons" in out
    assert not any(alive(p) for p in pids)
    assert not (root / "up.json").exists()


def test_the_readme_demo_line_stops_the_daemons_when_a_step_fails(
    home: dict[str, str],
) -> None:
    """The README's first command (issue 19, defect 6): whatever step after ``corpusd up`` fails,
    ``corpusd down`` still runs and no daemon outlives the line. Before, the steps were chained
    with ``&&``, so a failing demo left five daemons running. Here the demo step is made to
    fail fast (a pin of a tar that does not exist) and the installs are left out."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = readme.split("```bash\n", 1)[1].splitlines()[0].split("   #", 1)[0]
    line = re.sub(
        r"corpusd demo[^&;)]*", "corpusd pin --corpus /no.tar ", line[line.index("corpusd up") :]
    )
    shell = f'corpusd() {{ "{sys.executable}" -m corpusd "$@"; }}; {line}'
    r = subprocess.run(["bash", "-c", shell], env=home, capture_output=True, text=True, timeout=300)
    root = Path(home["CORPUSD_HOME"]) / "up"
    assert r.returncode != 0, r.stdout + r.stderr  # the failing step's status is the line's
    assert "no.tar" in r.stderr, r.stderr
    pids = daemon_pids(root)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not any(alive(p) for p in pids), "a daemon outlived the README's line"
    assert not (root / "up.json").exists()


def test_down_after_a_killed_up_stops_what_it_left(home: dict[str, str]) -> None:
    """Issue 19: ``down`` left a stale ``up.json`` (and the daemons of a ``corpusd up`` that was
    SIGKILLed kept running): it said "not running" and did nothing."""
    corpusd(home, "up", "--holders", "1", "--capacity-tokens", "1024", "--detach", "1")
    root = Path(home["CORPUSD_HOME"]) / "up"
    pids = daemon_pids(root)
    up_pid = int(json.loads((root / "up.json").read_text())["pid"])
    os.kill(up_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(up_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 3 and all(alive(p) for p in pids)  # orphans, and a stale up.json
    out = corpusd(home, "down")
    assert "was gone" in out, out
    assert not any(alive(p) for p in pids), "a daemon outlived corpusd down"
    assert not (root / "up.json").exists()
    assert "not running" in corpusd(home, "down")
