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


def test_blocks_by_core_keep_hyperthread_siblings_together() -> None:
    # 8 logical cpus on 4 cores, siblings numbered n and n + 4 (the usual Linux layout)
    def core_of(c: int) -> tuple[int, int]:
        return 0, c % 4

    order = cpu_pin.by_core(list(range(8)), core_of)
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    h0, h1, rest = cpu_pin.blocks([2, 2], order)
    assert {core_of(c) for c in h0} == {(0, 0)} and {core_of(c) for c in h1} == {(0, 1)}
    assert cpu_pin.span(h0) == "0,4" and cpu_pin.span(rest) == "2-3,6-7"
    # where sysfs says nothing, each cpu is its own core and the order is unchanged
    assert cpu_pin.by_core([3, 1, 2], lambda c: (0, c)) == [1, 2, 3]
    # on this machine's real sysfs: the same cpus, reordered only
    assert sorted(cpu_pin.by_core(cpu_pin.available())) == cpu_pin.available()


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
