"""tools/cpu_pin.py: blocks of cores, and every thread of a running process pinned to one."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import cpu_pin


def test_blocks_are_consecutive_and_the_rest_comes_last() -> None:
    assert cpu_pin.blocks([2, 1], list(range(6))) == [[0, 1], [2], [3, 4, 5]]
    assert cpu_pin.blocks([1, 1], [4, 7]) == [[4], [7], []]
    with pytest.raises(ValueError, match=r"4 \+ 4 \+ 1 = 9 cores asked for, 8 available \(0-7\)"):
        cpu_pin.blocks([4, 4, 1], list(range(8)))
    with pytest.raises(ValueError, match="at least one core"):
        cpu_pin.blocks([0], [0, 1])
    assert cpu_pin.span([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_pin_moves_every_thread_of_a_running_process() -> None:
    # a child with a second thread already running when it is pinned
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        tasks = Path(f"/proc/{child.pid}/task")
        deadline = time.monotonic() + 10
        while len(list(tasks.iterdir())) < 2:
            assert time.monotonic() < deadline, "the child's thread did not start"
            time.sleep(0.02)
        core = cpu_pin.available()[-1]
        assert cpu_pin.pin(child.pid, [core]) >= 2
        for t in tasks.iterdir():
            status = (t / "status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
            assert line.split()[-1] == str(core), f"thread {t.name}: {line}"
    finally:
        child.kill()
        child.wait()
