"""The pieces of ``corpusd up``'s supervision that need no daemon: the restart backoff, the
state-dir lock (refused in one line naming its holder) and :class:`Supervisor` restarting a
process that exits, with its count in ``supervisor.json``, ``supervisor.prom`` and its log."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corpusd.daemon import (
    Daemon,
    StateDirInUse,
    lock_holder,
    lock_state_dir,
    release_state_dir,
)
from corpusd.supervisor import RESTART_FILE, Backoff, Supervisor, restarts


def test_backoff_doubles_to_30_s_and_starts_over_after_a_stable_minute() -> None:
    b = Backoff()
    waits = [b.next(1.0) for _ in range(9)]
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert b.next(61.0) == 0.5 and b.next(0.0) == 1


def test_a_second_process_on_a_locked_state_dir_is_refused_naming_the_holder(
    tmp_path: Path,
) -> None:
    d = tmp_path / "holder-0"
    code = (
        "import sys, time; from pathlib import Path; from corpusd.daemon import lock_state_dir; "
        f"lock_state_dir(Path({str(d)!r}), 'holder'); print('locked', flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "locked\n"
        assert lock_holder(d) == (other.pid, "holder")
        with pytest.raises(StateDirInUse) as e:
            lock_state_dir(d, "holder")
        assert f"in use by corpusd holder (pid {other.pid})" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        other.kill()
        other.wait()
    assert lock_holder(d) is None  # the lock died with its process
    lock_state_dir(d, "coordinator")
    lock_state_dir(d, "coordinator")  # again in the process that holds it: a no-op
    assert lock_holder(d) is not None and lock_holder(d)[1] == "coordinator"  # type: ignore[index]
    release_state_dir(d)
    assert lock_holder(d) is None


def _sleeper(state_dir: Path) -> Daemon:
    state_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return Daemon(proc, state_dir, "127.0.0.1:1", -1)


def test_the_supervisor_restarts_a_daemon_that_exits_and_records_it(tmp_path: Path) -> None:
    d = tmp_path / "holder-0"
    first = _sleeper(d)
    (d / "holder.log").write_text("")
    starts: list[Daemon] = []

    def start() -> Daemon:
        starts.append(_sleeper(d))
        return starts[-1]

    out = io.StringIO()
    sup = Supervisor(tmp_path, out)
    sup.add(first, start)
    try:
        sup.poll()
        assert not starts  # alive: nothing to do
        first.proc.kill()
        first.proc.wait()
        t0 = time.monotonic()
        sup.poll(t0)  # noticed; due in 0.5 s
        assert (
            not starts and "holder-0 exited (-9); restarting in 0.5 s (restart 1)" in out.getvalue()
        )
        sup.poll(t0 + 0.6)
        assert len(starts) == 1 and sup.daemons() == starts
        assert restarts(tmp_path) == {"holder-0": 1}
        prom = (tmp_path / "supervisor.prom").read_text()
        assert 'corpusd_up_restarts_total{daemon="holder-0"} 1' in prom
        assert json.loads((tmp_path / "supervisor.json").read_text())["holder-0"]["last_exit"] == -9
        assert "corpusd up: holder-0 restarted" in (d / "holder.log").read_text()
        (d / RESTART_FILE).touch()  # `corpusd restart holder-0`: no wait
        starts[0].proc.terminate()
        starts[0].proc.wait()
        sup.poll()
        assert len(starts) == 2 and "asked by corpusd restart; restarting in 0 s" in out.getvalue()
        assert not (d / RESTART_FILE).exists() and restarts(tmp_path) == {"holder-0": 2}
    finally:
        for s in [first, *starts]:
            s.proc.kill()
            s.proc.wait()


def test_a_process_whose_main_thread_exited_is_alive_while_a_thread_runs() -> None:
    """The soak's finding: `up` after a killed `up` stopped the old daemons, took one for gone
    because its main thread was a zombie while its other threads still held its ports, and
    refused its own start ("in use"). Alive means some task of the process is not a zombie."""

    from corpusd.supervisor import alive

    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,)).start()\n"
        "print('ready', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        stat = f"/proc/{p.pid}/stat"
        while time.monotonic() < deadline:  # wait for the leader to become a zombie
            if Path(stat).read_text().split(") ")[1].startswith("Z"):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the main thread did not exit")
        assert alive(p.pid), "a process with a running thread was taken for gone"
    finally:
        p.kill()
        p.wait()
    assert not alive(p.pid)
