"""tests/support/procwatch: a worker that is renamed is not an exit, a worker that exits is."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procwatch import Workers, descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# the watched process starts two children whose command lines say "multiprocessing": one is
# renamed (exec: same pid, new cmdline, as setproctitle does to SGLang's scheduler) and lives on,
# the other exits after a second
LAUNCHER = """
import subprocess, sys, time
renamed = subprocess.Popen(["sh", "-c", "sleep 0.5; exec sleep 30", "multiprocessing-fork"])
dies = subprocess.Popen(["sh", "-c", "sleep 1.5", "multiprocessing-fork"])
time.sleep(30)
"""


def test_a_renamed_worker_is_followed_by_pid_and_an_exited_one_is_reported() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER])
    try:
        workers = Workers(proc.pid)
        deadline = time.monotonic() + 10
        while len(workers.seen) < 2 and time.monotonic() < deadline:
            assert workers.poll() == []
            time.sleep(0.05)
        assert len(workers.seen) == 2
        # the renamed one's command line says "30" before and after its exec
        (renamed,) = [p for p in workers.seen if b"30" in Path(f"/proc/{p}/cmdline").read_bytes()]
        (dies,) = workers.seen - {renamed}
        time.sleep(1.0)  # the first is renamed now; the second still runs
        assert b"multiprocessing" not in Path(f"/proc/{renamed}/cmdline").read_bytes()
        assert workers.poll() == []
        time.sleep(1.5)  # the second has exited
        assert workers.poll() == [dies]
        assert renamed in descendants(proc.pid) and dies not in descendants(proc.pid)
    finally:
        for pid in descendants(proc.pid):
            subprocess.run(["kill", str(pid)], check=False)
        proc.kill()
        proc.wait()
