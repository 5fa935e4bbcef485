"""The tests' CLI runner: a run past its deadline fails naming where it stood, not only that it
timed out (a rare hang in CI is then diagnosable from its log)."""

from __future__ import annotations

import os

import pytest

from corpusd.testing.cli import CliHung, run_python


def test_a_hung_run_fails_with_its_stack() -> None:
    code = (
        "import time\ndef stuck_here():\n    time.sleep(120)\n"
        "print('started', flush=True)\nstuck_here()"
    )
    with pytest.raises(CliHung) as e:
        run_python(os.environ, ["-c", code], timeout=3)
    assert "started" in str(e.value)  # what it wrote before
    assert "stuck_here" in str(e.value), str(e.value)  # faulthandler's stack names the frame


def test_a_run_that_ends_returns_its_output() -> None:
    r = run_python(os.environ, ["-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (r.returncode, r.stdout) == (3, "out\n")
