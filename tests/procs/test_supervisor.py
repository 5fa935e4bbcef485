"""`corpusd up` as a supervisor (issue 37, item 1): killing `up`, a holder and the coordinator in
turn and running `up` again leaves exactly one daemon per role and port, and the corpus
servable; `corpusd restart` restarts one role; `down` leaves no process and no listener. And
the smaller defects: a daemon whose port is taken, or whose state dir another daemon holds,
is refused in one line before it writes anything (it wrote the 69 MB default model first);
`up --detach` shows its progress."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.procs.test_up import alive, corpusd
from tests.procs.test_up import home as home  # the fixture
from tests.procs.test_up_ports import free_ports


def ours(root: Path) -> dict[str, list[int]]:
    """Daemon name → pids of the live processes run with a ``--state-dir`` under ``root``."""
    found: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not alive(int(proc.name)):
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "corpusd" not in args or "--state-dir" not in args:
            continue
        d = Path(args[args.index("--state-dir") + 1])
        if d.parent == root:
            found.setdefault(d.name, []).append(int(proc.name))
    return found


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, check: object, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.3)


def ps(env: dict[str, str]) -> dict[str, dict[str, object]]:
    return {p["name"]: p for p in json.loads(corpusd(env, "ps", "--json"))}


def servable(env: dict[str, str]) -> None:
    out = corpusd(env, "agents", "--corpus", "repo", "--agents", "1", "--tokens", "2", timeout=900)
    assert out.count("  Q: ") == 1, out


def test_kill_up_a_holder_and_the_coordinator_then_up_again_leaves_one_of_each(
    home: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "repo"
    src.mkdir()
    (src / "a.py").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(12)))
    with tarfile.open(tmp_path / "repo.tar", "w") as tar:
        tar.add(src, arcname="repo")
    root = Path(home["CORPUSD_HOME"]) / "up"
    c, h0, h1, a, http = free_ports(5)
    flags = ["--holders", "2", "--capacity-tokens", "2048", "--coordinator-port", str(c),
             "--holder-ports", f"{h0},{h1}", "--agent-port", str(a),
             "--http-port", str(http), "--timeout-s", "600"]  # fmt: skip
    slow = 900  # seconds a whole `up` may take on the shared 2-core machine at load 20
    ports = [c, h0, h1, a, http]
    try:
        out = corpusd(home, "up", "--detach", *flags, timeout=slow)
        # progress before the summary (it printed nothing until everything served)
        said = out.index("starting a coordinator, 2 holders")
        assert said < out.index("  holder-1     serving on") < out.index(", state "), out
        corpusd(home, "pin", "--corpus", str(tmp_path / "repo.tar"), "--name", "repo", timeout=slow)
        first = ps(home)

        # 1. `up` SIGKILLed: its daemons run on; the next `up` stops them, says so, starts anew
        os.kill(int(first["up"]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        wait_for("dead up", lambda: not alive(int(first["up"]["pid"])))  # type: ignore[call-overload]
        out = corpusd(home, "up", "--detach", *flags, timeout=slow)
        assert f"an earlier corpusd up in {root} left daemons running: " in out, out
        assert "stopping them" in out
        procs = ours(root)
        assert sorted(procs) == ["agent", "coordinator", "holder-0", "holder-1"], procs
        assert all(len(p) == 1 for p in procs.values()), procs  # was two of each
        assert all(listening(p) for p in ports)
        servable(home)

        # 2. a holder SIGKILLed: `up` restarts it on its port, and counts it
        holder = ps(home)["holder-0"]
        os.kill(int(holder["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        wait_for("restarted holder-0", lambda: ps(home)["holder-0"]["restarts"] == 1, slow)
        wait_for("holder-0 running", lambda: ps(home)["holder-0"]["running"], slow)
        after = ps(home)["holder-0"]
        assert after["pid"] != holder["pid"] and after["address"] == f"127.0.0.1:{h0}"
        up_log = corpusd(home, "logs", "up", "-n", "0")
        assert "holder-0 exited (-9); restarting in 0.5 s (restart 1)" in up_log, up_log
        assert "holder-0 restarted" in corpusd(home, "logs", "holder-0", "-n", "0")

        # 3. the coordinator SIGKILLed: the same
        coord = ps(home)["coordinator"]
        os.kill(int(coord["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        wait_for("restarted coordinator", lambda: ps(home)["coordinator"]["restarts"] == 1, slow)
        wait_for("coordinator running", lambda: ps(home)["coordinator"]["running"], slow)
        wait_for(
            "holders re-registered",
            lambda: "holders (2 live of 2)" in corpusd(home, "status"),
            slow,
        )
        servable(home)

        # 4. one role restarted on request
        out = corpusd(home, "restart", "agent", timeout=slow)
        assert out.startswith("restarted agent (pid ") and f"127.0.0.1:{a}" in out, out
        assert ps(home)["agent"]["restarts"] == 1
        procs = ours(root)
        assert all(len(p) == 1 for p in procs.values()) and len(procs) == 4, procs
        servable(home)
    finally:
        down = corpusd(home, "down", timeout=slow)
    assert "stopped corpusd up" in down, down
    wait_for("no daemon", lambda: not ours(root), 60)
    assert not [p for p in ports if listening(p)], "a port still listens after down"


def test_down_stops_the_daemons_of_a_killed_up(home: dict[str, str]) -> None:
    root = Path(home["CORPUSD_HOME"]) / "up"
    corpusd(home, "up", "--detach", "--holders", "1", "--capacity-tokens", "1024")
    up_pid = int(json.loads((root / "up.json").read_text())["pid"])
    os.kill(up_pid, signal.SIGKILL)
    wait_for("dead up", lambda: not alive(up_pid))
    assert len(ours(root)) == 3
    out = corpusd(home, "down")
    assert "stopped 3 daemon(s) left running" in out and "was gone" in out, out
    wait_for("no daemon", lambda: not ours(root), 60)
    rows = corpusd(home, "ps").splitlines()[1:]
    assert rows and all(" - " in r and "/metrics" not in r for r in rows), rows


def test_a_daemon_refuses_a_taken_port_or_state_dir_before_writing_anything(
    home: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in home.items() if k != "CORPUSD_MODEL"}  # the default model
    model = Path(env["CORPUSD_HOME"]) / "models" / "tiny"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for role, extra in (("holder", []), ("agent", ["--holders", "127.0.0.1:1"])):
            r = subprocess.run(
                [sys.executable, "-m", "corpusd", role, "--state-dir", str(tmp_path / role),
                 "--port", str(port), "--insecure", "1", *extra],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert r.returncode == 2, r.stderr
            assert r.stderr.count("\n") == 1 and f"--port {port}" in r.stderr, r.stderr
            assert not model.exists(), f"{role} wrote the default model before refusing"
    # a second holder on a state dir a live holder holds: refused in one line naming it
    first = subprocess.Popen(
        [sys.executable, "-m", "corpusd", "holder", "--state-dir", str(tmp_path / "h"),
         "--model", home["CORPUSD_MODEL"], "--insecure", "1", "--capacity-tokens", "256"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for("holder", lambda: (tmp_path / "h" / "endpoint.json").exists(), 120)
        r = subprocess.run(
            [sys.executable, "-m", "corpusd", "holder", "--state-dir", str(tmp_path / "h"),
             "--model", home["CORPUSD_MODEL"], "--insecure", "1"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"is in use by corpusd holder (pid {first.pid})" in r.stderr, r.stderr
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)
