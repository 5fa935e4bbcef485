"""A closed stdout ends a command quietly (issue 37: ``corpusd ask … | head -2`` ended in a
BrokenPipeError traceback): exit status 141, a shell's for a writer killed by SIGPIPE, and
nothing on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("command", [["ps"], ["ls"]])
def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path: Path, command: list[str]) -> None:
    env = {**os.environ, "CORPUSD_HOME": str(tmp_path)}
    env.pop("CORPUSD_COORDINATOR", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "corpusd", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
