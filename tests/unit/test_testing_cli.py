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


def test_a_corpus_command_gives_up_with_its_stacks_rather_than_hang() -> None:
    """``corpusd status / ls / unpin / rm`` end themselves (status 1, every thread's stack on
    stderr) once far past their calls' deadlines (``cli_corpora.bounded``), and a command that
    returns disarms the timer (a process running commands one after another lives on)."""
    from corpusd.cli_corpora import hang_bound

    assert hang_bound(10.0) == 70.0  # the CLI's default --timeout-s: 70 s, never forever
    code = (
        "import time, types\nfrom corpusd import cli_corpora\n"
        "cli_corpora.hang_bound = lambda t: t\n"
        "quick = cli_corpora.bounded(lambda a: 0)\n"
        "assert quick(types.SimpleNamespace(timeout_s=1.0)) == 0\n"
        "time.sleep(1.5)\nprint('outlived the quick one', flush=True)\n"
        "@cli_corpora.bounded\ndef stuck_in_teardown(a):\n    time.sleep(60)\n"
        "stuck_in_teardown(types.SimpleNamespace(timeout_s=1.0))"
    )
    r = run_python(os.environ, ["-c", code], timeout=50)
    assert r.returncode == 1 and "outlived the quick one" in r.stdout, (r.returncode, r.stderr)
    assert "Timeout" in r.stderr and "stuck_in_teardown" in r.stderr, r.stderr
